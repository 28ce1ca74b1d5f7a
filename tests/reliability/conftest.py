"""Fixtures of the reliability suite: the shared stack, time limits and the figures.

Every test here runs against the real stack (gunicorn workers, PostgreSQL,
Redis, the processor service); see ``stack.py``. The tests that need a stack
configured their own way (a short lease, a throwaway database or Redis they
stop) build it in a module fixture with ``running_stack``.

Each test reports what it held through the ``figures`` fixture (figures.py):
printed in the test's output and again in a "reliability figures" section at
the end of the run, so a CI log shows them whatever pytest's capture mode.
"""

from __future__ import annotations

from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest

from support.xdist_worker import worker_redis_db

from .figures import Figures
from .fixtures import api_key, run_id, time_limited, write_figures
from .stack import Stack, StackOptions, drop_stale_databases, own_database, running_stack

#: Hard limit for one test (not its module's stack start-up, which has its own):
#: a hung test dumps every thread's stack and ends the run, instead of eating
#: the CI job's whole time budget.
TEST_TIME_LIMIT = 180.0

#: Redis logical database of the stacks on the run's Redis (see ``stack_redis_url``);
#: each xdist worker counts down from it (the workers' own dbs count up from REDIS_URL's).
REDIS_DB = 14 - worker_redis_db(0)


@pytest.fixture
def figures(request: pytest.FixtureRequest) -> Figures:
    return Figures(request.node)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    write_figures(terminalreporter, Figures.section)


@pytest.fixture(autouse=True)
def time_limit() -> Iterator[None]:
    """Dump all stacks and exit if one test runs past ``TEST_TIME_LIMIT``."""
    with time_limited(TEST_TIME_LIMIT):
        yield


@pytest.fixture(scope="session")
def server_database_url(database_url: str) -> str:
    """The run's PostgreSQL server, with leftovers of killed runs of this suite dropped."""
    drop_stale_databases(database_url)
    return database_url


@pytest.fixture(scope="session")
def stack_redis_url(redis_url: str) -> str:
    """The run's Redis server, in a logical database of this suite's own: other tests
    FLUSHDB theirs, which must not empty the cache under a test that counts on it."""
    return str(urlsplit(redis_url)._replace(path=f"/{REDIS_DB}").geturl())


@pytest.fixture(scope="session")
def stack(server_database_url: str, stack_redis_url: str) -> Iterator[Stack]:
    """The shared stack: its own database on the run's PostgreSQL (behind a proxy the
    tests may cut), the run's Redis, four gunicorn workers, the default lease."""
    with own_database(server_database_url) as url:
        with running_stack(url, stack_redis_url, StackOptions(pg_proxy=True)) as running:
            yield running


__all__ = ["api_key", "run_id"]  # fixtures shared with the other suite
