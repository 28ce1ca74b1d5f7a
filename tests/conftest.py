"""Fixtures shared by the whole suite, in two tiers (as psycopg's fix_db.py).

Run-wide servers: ``database_url`` and ``redis_url`` come from DATABASE_URL
and REDIS_URL when those are set (CI, or a developer's own servers), else
from throwaway servers started once for the run (PostgreSQL through
pytest-postgresql's process fixture, ``postgresql_server``).  A URL that is
set but unreachable fails the tests that need it instead of skipping them: a
CI run whose database went missing must not come out green.

Per test: ``clean_db`` and ``clean_redis`` reset those servers, and the
factories below give a test its own proxies, gunicorns or servers, closed at
teardown.  Support code lives in ``tests/support`` and is imported as
``support.*`` (pytest puts ``tests/`` on sys.path; there is no
tests/__init__.py). The test files live in folders by area (``core/``,
``example/``...), each a package, so that two files of one basename in two
folders are two modules (``core.test_recovery``, ``reliability.test_recovery``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

# SQLAlchemy's PostgreSQL dialect registers its SQL functions in a process-wide
# registry when first imported. pytester's in-process runs (tests/tooling) take the
# modules they imported out of sys.modules again, so a later import registered them
# twice, which SQLAlchemy warns about (an error here): imported once, up front.
import sqlalchemy.dialects.postgresql  # noqa: F401
from pytest_postgresql import factories

from flask_idempotency.testing.databases import dsn_for, noproc_arguments
from support.postgres_proc import SERVER_OPTIONS, pg_ctl_executable, watchdog
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
from support.xdist_worker import isolate_worker

# Under pytest-xdist, a database and a Redis db of this worker's own (before anything
# reads DATABASE_URL / REDIS_URL): the per-test resets would empty another worker's.
isolate_worker()

# The run's PostgreSQL server, as pytest-postgresql sees it: without DATABASE_URL
# its process fixture starts one from pgserver's binaries (support/postgres_proc.py:
# how, as root too); with DATABASE_URL its noproc fixture points at that server.
DATABASE_URL = os.environ.get("DATABASE_URL", "").strip() or None
_PG_CTL_ERROR: str | None = None
if DATABASE_URL is None:
    try:
        _pg_ctl: str | None = pg_ctl_executable()
    except RuntimeError as exc:  # reported by the tests that need the server, not at import
        _pg_ctl, _PG_CTL_ERROR = None, str(exc)
    _postgresql_server: Any = factories.postgresql_proc(
        executable=_pg_ctl, host="127.0.0.1", port=None, postgres_options=SERVER_OPTIONS
    )
else:
    _postgresql_server = factories.postgresql_noproc(
        **noproc_arguments(DATABASE_URL), dbname=f"idem_tests_{os.getpid()}"
    )


@pytest.fixture(scope="session")
def postgresql_server(request: pytest.FixtureRequest) -> Iterator[Any]:
    """pytest-postgresql's executor for the run's server (``.host``, ``.port``...)."""
    if DATABASE_URL is not None:
        check_database_url()
        yield request.getfixturevalue("_postgresql_server")
        return
    if _PG_CTL_ERROR is not None:
        pytest.fail(_PG_CTL_ERROR, pytrace=False)
    server = request.getfixturevalue("_postgresql_server")
    with watchdog(server):
        yield server


#: A database of the test's own on the run's server, created from pytest-postgresql's
#: template and dropped after the test (a psycopg 3 connection to it).
fresh_database = factories.postgresql("postgresql_server")


@pytest.fixture
def fresh_database_url(fresh_database: Any, postgresql_server: Any) -> str:
    """The URL of ``fresh_database``."""
    return dsn_for(postgresql_server, fresh_database.info.dbname, dsn=DATABASE_URL)


def check_database_url() -> None:
    """Fail (never skip) when DATABASE_URL is set but its server does not answer."""
    assert DATABASE_URL is not None
    try:
        check_postgres(DATABASE_URL)
    except RuntimeError as exc:
        pytest.fail(f"DATABASE_URL is set but unusable: {exc}", pytrace=False)


@pytest.fixture(scope="session")
def database_url(request: pytest.FixtureRequest) -> str:
    """The run's PostgreSQL: $DATABASE_URL, else the ``postgres`` database of the
    server pytest-postgresql started."""
    if DATABASE_URL is not None:
        check_database_url()
        return DATABASE_URL
    return dsn_for(request.getfixturevalue("postgresql_server"), "postgres")


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


@pytest.fixture(scope="session")
def amqp_url() -> str:
    """The run's RabbitMQ (``AMQP_URL``), for the events, Celery and docs tests. Nothing
    starts one: unset, those tests skip and say why, except under CI (``CI`` set),
    where a missing broker fails them; set but unusable, they fail."""
    url = os.environ.get("AMQP_URL")
    if not url:
        if os.environ.get("CI"):
            pytest.fail("AMQP_URL is unset under CI: the broker tests need RabbitMQ")
        pytest.skip("AMQP_URL is unset: no RabbitMQ for the broker tests")
    import kombu

    try:
        with kombu.Connection(url, connect_timeout=5) as conn:
            conn.connect()
    except Exception as exc:
        pytest.fail(f"AMQP_URL is set but unusable: {type(exc).__name__}: {exc}", pytrace=False)
    return url


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


# ---------------------------------------------------------------------------
# pytest-xdist scheduling (``make test`` runs ``-n 4 --dist loadgroup``).
# ---------------------------------------------------------------------------

#: Folders whose tests run on one worker, one after the other: the reliability
#: tests share a session-wide stack (four gunicorn workers and a processor), so one
#: worker starts one stack instead of each worker its own on 2 cores; the upgrade
#: tests share their rollouts (two releases' gunicorns on one database) the same way.
SERIAL_FOLDERS = {"reliability": "reliability", "upgrade": "upgrade", "client": "client"}


@pytest.hookimpl(optionalhook=True)  # an xdist hook: unknown under -p no:xdist
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadgroup``, with the tests of ``SERIAL_FOLDERS`` in one group each.

    A scheduler rather than ``xdist_group`` marks: pytest-xdist 3.8 groups by
    rewriting ``item._nodeid``, which pytest 9.2 no longer reads, so its marks
    group nothing there.
    """
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling  # type: ignore[import-untyped]

    class FolderGroupScheduling(LoadGroupScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            parts = nodeid.split("/", 2)
            if len(parts) == 3 and parts[0] == "tests" and parts[1] in SERIAL_FOLDERS:
                return SERIAL_FOLDERS[parts[1]]
            return str(super()._split_scope(nodeid))

    return FolderGroupScheduling(config, log)
