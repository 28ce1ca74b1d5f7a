"""The run-wide PostgreSQL through pytest-postgresql: what support/postgres_proc.py adds.

pytest-postgresql's executor runs pgserver's ``pg_ctl`` (as an unprivileged
account when we are root); a run killed with SIGKILL must not leave that
server behind, which pytest-postgresql alone would (``pg_ctl`` detaches it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import psycopg2
import pytest

from support._files import WORKDIR_PREFIX, remove_tree
from support.waiting import wait_until

TESTS_DIR = Path(__file__).resolve().parents[1]

# A process that starts a server the way the process fixture does, watches it, and
# waits to be killed.
SERVER_SCRIPT = """
import sys, time
sys.path.insert(0, sys.argv[1])
from pytest_postgresql.executors import PostgreSQLExecutor
from support._procs import free_port
from support.postgres_proc import SERVER_OPTIONS, pg_ctl_executable, watchdog

root = sys.argv[2]
server = PostgreSQLExecutor(
    executable=pg_ctl_executable(), host="127.0.0.1", port=free_port(),
    datadir=root + "/data", unixsocketdir=root, logfile=root + "/postgresql.log",
    startparams="-w", dbname="tests", postgres_options=SERVER_OPTIONS,
)
server.start()
with watchdog(server):
    print(server.port, flush=True)
    time.sleep(300)
"""


def _answers(port: int) -> bool:
    try:
        psycopg2.connect(
            host="127.0.0.1", port=port, user="postgres", dbname="postgres", connect_timeout=2
        ).close()
    except psycopg2.OperationalError:
        return False
    return True


def test_the_run_wide_server_comes_from_pytest_postgresql(
    postgresql_server: Any, database_url: str
) -> None:
    """Its process fixture without DATABASE_URL, its noproc fixture with it."""
    expected = "NoopExecutor" if os.environ.get("DATABASE_URL") else "PostgreSQLExecutor"
    assert type(postgresql_server).__name__ == expected
    conn = psycopg2.connect(database_url, connect_timeout=5)
    try:
        assert conn.info.port == int(postgresql_server.port)
        with conn.cursor() as cur:
            cur.execute("SHOW server_encoding")
            assert cur.fetchone() == ("UTF8",)  # charges carry any Unicode text
    finally:
        conn.close()


def test_a_killed_run_does_not_leave_its_server_running(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER_SCRIPT, str(TESTS_DIR), str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            pytest.fail(f"the server did not start:\n{proc.communicate(timeout=30)[1][-3000:]}")
        port = int(line)
        assert _answers(port)
    finally:
        proc.send_signal(signal.SIGKILL)  # no teardown, no atexit: only the watchdog is left
        proc.communicate(timeout=30)
    wait_until(lambda: not _answers(port), 20, "the server to stop with the killed process")
    # What a killed run cannot delete, the next run's sweep would; do it now.
    for workdir in Path(tempfile.gettempdir()).glob(f"{WORKDIR_PREFIX}*"):
        owner = workdir / "owner.pid"
        if owner.exists() and owner.read_text().strip() == str(proc.pid):
            remove_tree(workdir)
