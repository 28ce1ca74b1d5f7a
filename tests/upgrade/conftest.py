"""Fixtures of the rolling-upgrade tests: the previous release from git, and stacks
where its workers and this checkout's share one database.

A stack is a session fixture (a rollout takes a few seconds: two migrates, two
gunicorns); the tests keep apart by using keys of their own. tests/conftest.py
runs this folder on one xdist worker, so each stack starts once per run.
Without git or the previous release's commit the tests skip and say why,
except under CI (``CI`` set), where that is a failure: a clean clone has the
history, and a rollout test that cannot run must not come out green.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from .rollout import Release, ReleaseUnavailable, Stack, extract_previous_release

#: Both claim modes of 0.2.0; every process of a deployment uses the same one.
CLAIM_MODES = ("row", "transaction")


@pytest.fixture(scope="session")
def previous_release(tmp_path_factory: pytest.TempPathFactory) -> Release:
    """0.2.0's package, taken from git, to run the old workers with."""
    try:
        root = extract_previous_release(tmp_path_factory.mktemp("previous-release"))
    except ReleaseUnavailable as exc:
        message = f"the previous release is unavailable: {exc}"
        if os.environ.get("CI"):
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    return Release("previous", root)


def _stack(
    name: str,
    tmp: Path,
    *,
    base_url: str,
    previous: Release,
    claim_mode: str,
    redis_url: str | None = None,
) -> Iterator[Stack]:
    stack = Stack(
        name,
        base_url=base_url,
        previous=previous,
        claim_mode=claim_mode,
        redis_url=redis_url,
        gate_dir=tmp,
    )
    try:
        yield stack.start()
    finally:
        stack.close()


@pytest.fixture(scope="session", params=CLAIM_MODES)
def stack(
    request: pytest.FixtureRequest,
    previous_release: Release,
    database_url: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Stack]:
    """Old and new workers on one database, in each claim mode, without Redis."""
    mode = request.param
    yield from _stack(
        mode,
        tmp_path_factory.mktemp(f"gates-{mode}"),
        base_url=database_url,
        previous=previous_release,
        claim_mode=mode,
    )


@pytest.fixture(scope="session")
def redis_stack(
    previous_release: Release,
    database_url: str,
    redis_url: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Stack]:
    """Old and new workers sharing one database and one Redis (row claims)."""
    from support.databases import flush_redis

    flush_redis(redis_url)
    yield from _stack(
        "redis",
        tmp_path_factory.mktemp("gates-redis"),
        base_url=database_url,
        previous=previous_release,
        claim_mode="row",
        redis_url=redis_url,
    )
