"""gunicorn.conf.py's values from the environment, read as gunicorn reads the file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

READ_CONF = """
import json, os, runpy
conf = runpy.run_path("gunicorn.conf.py")
print(json.dumps({"threads": conf["threads"], "pool": os.environ.get("IDEMPOTENCY_POOL_SIZE")}))
"""


def read_conf(**env: str) -> dict[str, object]:
    environ = {
        k: v
        for k, v in os.environ.items()
        if k not in ("GUNICORN_THREADS", "IDEMPOTENCY_POOL_SIZE")
    }
    done = subprocess.run(
        [sys.executable, "-c", READ_CONF],
        cwd=REPO_ROOT,
        env=environ | env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize(
    ("env", "threads", "pool"),
    [
        ({}, 4, "10"),  # the extension's default already covers the default threads
        ({"GUNICORN_THREADS": "32"}, 32, "32"),  # more threads than the default pool
        ({"GUNICORN_THREADS": "32", "IDEMPOTENCY_POOL_SIZE": "40"}, 32, "40"),  # set: kept
    ],
)
def test_the_pool_covers_the_worker_threads(env: dict[str, str], threads: int, pool: str) -> None:
    assert read_conf(**env) == {"threads": threads, "pool": pool}
