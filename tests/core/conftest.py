"""The core tests, over each store that claims the contract.

A module that sets ``pytestmark = pytest.mark.each_store`` runs each of its tests
that builds the core app (``make_app``) twice: on PostgreSQL and on the
in-memory store (``IDEMPOTENCY_DATABASE_URL = "memory://"``). A test that looks
into PostgreSQL (it asks for ``database_url`` or ``clean_db``) or is marked
``postgres_only`` runs on PostgreSQL alone. ``records`` reads and moves the
records the same way on either store, so a contract test need not know which.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import psycopg2
import pytest
from flask import Flask

from support import core_app

STORES = ("postgres", "memory")
#: Fixtures that reach PostgreSQL itself: a test asking for one is PostgreSQL's only.
POSTGRES_FIXTURES = frozenset({"database_url", "clean_db", "fresh_database_url"})


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "each_store: run the module's make_app tests per store")
    config.addinivalue_line("markers", "postgres_only: a core test of PostgreSQL's own")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    definition, fixtures = metafunc.definition, set(metafunc.fixturenames)
    if definition.get_closest_marker("each_store") is None or "make_app" not in fixtures:
        return
    if definition.get_closest_marker("postgres_only") or POSTGRES_FIXTURES & fixtures:
        return
    metafunc.parametrize("store", STORES)


@pytest.fixture
def store() -> str:
    """The store ``make_app`` builds on: PostgreSQL unless parametrized."""
    return "postgres"


@pytest.fixture
def make_app(request: pytest.FixtureRequest, store: str) -> Iterator[Any]:
    """Factory: ``make_app(**config)`` -> the core test app (support/core_app.py) on
    ``store``: a clean PostgreSQL database, or ``memory://``; closed at teardown."""
    url = core_app.MEMORY_URL if store == "memory" else request.getfixturevalue("clean_db")
    apps: list[Flask] = []

    def make(**config: Any) -> Flask:
        app = core_app.create_app(url, config)
        apps.append(app)
        return app

    yield make
    for app in apps:
        app.extensions["idempotency"].close()


class Records(Protocol):
    """The records of an app's store, as the contract tests look at them."""

    def count(self, app: Flask) -> int: ...

    def expire(self, app: Flask) -> None:
        """Every record past its TTL."""

    def kept_writes(self, app: Flask) -> int | None:
        """The core app's business rows that were kept; ``None`` where the view has
        no transaction to write in (memory://)."""

    def expire_leases(self, app: Flask) -> None:
        """Every processing record's lease run out (its holder looks dead)."""


class PostgresRecords:
    def __init__(self, dsn: str) -> None:
        self.dsn = dsn

    def _execute(self, query: str) -> list[tuple[Any, ...]]:
        with psycopg2.connect(self.dsn) as conn, conn.cursor() as cur:
            cur.execute(query)
            rows = cur.fetchall() if cur.description else []
        conn.close()
        return rows

    def count(self, app: Flask) -> int:
        return int(self._execute("SELECT count(*) FROM idempotency_records")[0][0])

    def kept_writes(self, app: Flask) -> int | None:
        return int(self._execute("SELECT count(*) FROM core_business_rows")[0][0])

    def expire(self, app: Flask) -> None:
        self._execute("UPDATE idempotency_records SET expires_at = now() - interval '1 second'")

    def expire_leases(self, app: Flask) -> None:
        self._execute(
            "UPDATE idempotency_records SET lease_expires_at = now() - interval '1 second'"
            " WHERE state = 'processing'"
        )


class MemoryRecords:
    @staticmethod
    def _store(app: Flask) -> Any:
        return app.extensions["idempotency"].store

    def count(self, app: Flask) -> int:
        figures = self._store(app).stats()
        return int(figures["processing"] + figures["completed"] + figures["expired"])

    def kept_writes(self, app: Flask) -> int | None:
        return None

    def expire(self, app: Flask) -> None:
        self._store(app).advance(10**7)  # past any TTL a test sets

    def expire_leases(self, app: Flask) -> None:
        # Past the default lease and the tests' own, well within the default TTL.
        self._store(app).advance(app.extensions["idempotency"].settings.lease + 1)


@pytest.fixture
def records(request: pytest.FixtureRequest, store: str) -> Records:
    """The records of the app ``make_app`` built, on its store."""
    if store == "memory":
        return MemoryRecords()
    return PostgresRecords(request.getfixturevalue("clean_db"))
