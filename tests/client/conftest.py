"""Fixtures of the client tests: the example app under gunicorn with a fault-injecting
proxy in front of it, and the reliability suite's per-test fixtures and figures.

The proxy stands between the client and the APP (not PostgreSQL): what it fails
is the HTTP exchange a retrying client has to get past, one request at a time
(``TcpProxy.inject``). The stack (reliability's ``running_stack``) and the proxy
are started once for the folder, which runs on one xdist worker
(``SERIAL_FOLDERS`` in tests/conftest.py); each test is a tenant of its own
(``api_key``) with customers of its own (``run_id``).
"""

from __future__ import annotations

from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest
from reliability.figures import Figures
from reliability.fixtures import api_key, run_id, time_limited, write_figures
from reliability.stack import Stack, StackOptions, drop_stale_databases, own_database, running_stack

from support.tcp_proxy import TcpProxy
from support.xdist_worker import worker_redis_db

#: A hung test dumps every thread's stack and ends the run.
TEST_TIME_LIMIT = 120.0

#: Two workers of sixteen threads: the storms' eight client threads, their retries
#: and the connections a held answer keeps open all fit without queueing, and a
#: duplicate still lands on another process than its original half of the time.
STACK_OPTIONS = StackOptions(workers=2, threads=16)

#: The reliability suite's Redis database (see its conftest): the other tests
#: FLUSHDB their own, and no two tests here or there share an API key.
REDIS_DB = 14 - worker_redis_db(0)


class ClientFigures(Figures):
    """The reliability suite's figures, in a "client figures" section of their own."""

    section = "client figures"


@pytest.fixture
def figures(request: pytest.FixtureRequest) -> Figures:
    return ClientFigures(request.node)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    write_figures(terminalreporter, ClientFigures.section)


@pytest.fixture(autouse=True)
def time_limit() -> Iterator[None]:
    with time_limited(TEST_TIME_LIMIT):
        yield


@pytest.fixture(scope="session")
def stack(database_url: str, redis_url: str) -> Iterator[Stack]:
    """The payments API and its processor on a database of their own."""
    drop_stale_databases(database_url)
    stack_redis = str(urlsplit(redis_url)._replace(path=f"/{REDIS_DB}").geturl())
    with own_database(database_url) as url, running_stack(url, stack_redis, STACK_OPTIONS) as s:
        yield s


@pytest.fixture(scope="session")
def app_proxy(stack: Stack) -> Iterator[TcpProxy]:
    """The proxy in front of the payments API; ``proxy.url`` is the API through it."""
    with TcpProxy.for_url(stack.url) as proxy:
        yield proxy


@pytest.fixture
def proxy(app_proxy: TcpProxy) -> Iterator[TcpProxy]:
    """``app_proxy`` with no faults scheduled, before the test and after it."""
    app_proxy.inject(None)
    yield app_proxy
    app_proxy.inject(None)


__all__ = ["api_key", "run_id"]  # fixtures shared with the reliability suite
