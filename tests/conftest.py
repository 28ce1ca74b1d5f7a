"""Fixtures shared by the whole suite, in two tiers (as psycopg's fix_db.py).

Run-wide servers: ``database_url`` and ``redis_url`` come from DATABASE_URL
and REDIS_URL when those are set (CI, or a developer's own servers), else
from throwaway servers started once for the run.  A URL that is set but
unreachable fails the tests that need it instead of skipping them: a CI run
whose database went missing must not come out green.

Per test: ``clean_db`` and ``clean_redis`` reset those servers, and the
factories below give a test its own proxies, gunicorns or servers, closed at
teardown.  Support code lives in ``tests/support`` and is imported as
``support.*`` (pytest puts ``tests/`` on sys.path; there is no
tests/__init__.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from support.servers import (
    GunicornFactory,
    GunicornServer,
    ProxyFactory,
    TcpProxy,
    ThrowawayPostgres,
    ThrowawayRedis,
    check_postgres,
    check_redis,
    flush_redis,
    truncate_public_tables,
)


@pytest.fixture(scope="session")
def database_url() -> Iterator[str]:
    """The run's PostgreSQL: $DATABASE_URL, else a throwaway server."""
    url = os.environ.get("DATABASE_URL")
    if url:
        try:
            check_postgres(url)
        except RuntimeError as exc:
            pytest.fail(f"DATABASE_URL is set but unusable: {exc}", pytrace=False)
        yield url
        return
    with ThrowawayPostgres() as server:
        yield server.dsn


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """The run's Redis: $REDIS_URL, else a throwaway server."""
    url = os.environ.get("REDIS_URL")
    if url:
        try:
            check_redis(url)
        except RuntimeError as exc:
            pytest.fail(f"REDIS_URL is set but unusable: {exc}", pytrace=False)
        yield url
        return
    with ThrowawayRedis() as server:
        yield server.url


@pytest.fixture
def clean_db(database_url: str) -> str:
    """``database_url``, with every public table emptied before the test.

    Tables ending in ``schema_migrations`` keep their rows, so migrations
    applied by an earlier test are not re-run on existing tables.
    """
    truncate_public_tables(database_url)
    return database_url


@pytest.fixture
def clean_redis(redis_url: str) -> str:
    """``redis_url``, with its database flushed before the test."""
    flush_redis(redis_url)
    return redis_url


@pytest.fixture
def tcp_proxy() -> Iterator[ProxyFactory]:
    """Factory: ``tcp_proxy(url)`` or ``tcp_proxy(host, port)`` -> TcpProxy.

    Put one between the code under test and PostgreSQL or Redis, then
    ``cut()`` and ``restore()`` it to stage an outage for that code only.
    """
    proxies: list[TcpProxy] = []

    def make(target: str, port: int | None = None, **kwargs: Any) -> TcpProxy:
        if port is None:
            proxy = TcpProxy.for_url(target, **kwargs)
        else:
            proxy = TcpProxy(target, port, **kwargs)
        proxies.append(proxy)
        return proxy

    yield make
    for proxy in reversed(proxies):
        proxy.close()


@pytest.fixture
def gunicorn_server() -> Iterator[GunicornFactory]:
    """Factory: ``gunicorn_server(wsgi_app, **options)`` -> started GunicornServer.

    Servers stop at teardown; their logs are printed then, and pytest shows
    them under "Captured stdout teardown" when the test failed.
    """
    servers: list[GunicornServer] = []

    def make(wsgi_app: str, **kwargs: Any) -> GunicornServer:
        server = GunicornServer(wsgi_app, **kwargs)
        servers.append(server)  # before start(): a failed start is cleaned up too
        return server.start()

    yield make
    for server in reversed(servers):
        try:
            server.stop()
            print(f"--- {server!r} log ---\n{server.log_text()}")
        finally:
            server.close()


@pytest.fixture
def throwaway_postgres() -> Iterator[ThrowawayPostgres]:
    """A fresh PostgreSQL of the test's own, for outages that stop the server.

    Never stop the run-wide ``database_url`` server: other tests share it.
    """
    with ThrowawayPostgres() as server:
        yield server
        if server.log_path.exists():
            print(f"--- {server!r} log ---\n{server.log_path.read_text(errors='replace')}")


@pytest.fixture
def throwaway_redis() -> Iterator[ThrowawayRedis]:
    """A fresh Redis of the test's own, for tests that kill Redis outright."""
    with ThrowawayRedis() as server:
        yield server


# ---------------------------------------------------------------------------
# Application fixtures (make_app and friends) — maintained by the core author.
# Add them below this line.
# ---------------------------------------------------------------------------


@pytest.fixture
def make_app(clean_db: str) -> Iterator[Any]:
    """Factory: ``make_app(**config)`` -> the core test app (support/core_app.py) on a
    clean database, its pool, keeper thread and cache closed at teardown."""
    from flask import Flask

    from support import core_app

    apps: list[Flask] = []

    def make(**config: Any) -> Flask:
        app = core_app.create_app(clean_db, config)
        apps.append(app)
        return app

    yield make
    for app in apps:
        app.extensions["idempotency"].close()
