"""Fixtures and helpers of the Flask-SQLAlchemy tests (contract section 6).

No ``__init__.py`` and no ``conftest.py`` here (as in ``tests/celery``): a
package ``tests/sqlalchemy`` would be imported as ``sqlalchemy`` and hide
SQLAlchemy itself, and a second top-level conftest trips mypy. The test
modules star-import the fixtures from this module.

Every test marks its rows with a label of its own and counts them in
PostgreSQL through a connection of its own (``rows``), so the tests share one
database and one gunicorn per dialect without cleaning up between them.
"""

from __future__ import annotations

import contextlib
import secrets
import shutil
import tempfile
import threading
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psycopg2
import pytest
import sa_app
from flask import Flask
from flask.testing import FlaskClient
from werkzeug.test import TestResponse

from support.gunicorn_server import TESTS_DIR, GunicornServer
from support.http_client import HttpResponse, http_request
from support.waiting import wait_until

HERE = Path(__file__).resolve().parent
#: The two SQLAlchemy dialects the contract names.
DIALECTS = ("psycopg2", "psycopg")
#: What gunicorn needs on its path to import ``sa_app``.
GUNICORN_PYTHONPATH = ":".join([str(TESTS_DIR.parent), str(TESTS_DIR), str(HERE)])
API_KEY = "sa-tests-client"

WORKERS = 2
THREADS = 32
#: db's engine connections per worker: fewer than its threads, as in production.
POOL_SIZE = 12
#: Duplicates wait for the first attempt and replay it (the contract's opt-in wait
#: mode), so every answer of a storm is the same 201.
WAIT_SECONDS = 10


def sa_url(database_url: str, dialect: str) -> str:
    """``database_url`` (``postgresql://``) spelled for SQLAlchemy's ``dialect``."""
    scheme, rest = database_url.split("://", 1)
    assert scheme in ("postgresql", "postgres"), database_url
    return f"postgresql+{dialect}://{rest}"


def query(database_url: str, statement: str, params: Any = None) -> list[tuple[Any, ...]]:
    conn = psycopg2.connect(sa_app.plain_dsn(database_url), connect_timeout=5)
    try:
        with conn, conn.cursor() as cur:
            cur.execute(statement, params)
            return cur.fetchall() if cur.description else []
    finally:
        conn.close()


def rows(database_url: str, label: str) -> list[str]:
    """The committed transfers of ``label``, as their sorted steps."""
    found = query(database_url, "SELECT step FROM sa_transfers WHERE label = %s", (label,))
    return sorted(step for (step,) in found)


def user_row(database_url: str, api_key: str) -> tuple[int, str | None]:
    """(transfers_made, touched_by) of the user with ``api_key``."""
    found = query(
        database_url,
        "SELECT transfers_made, touched_by FROM sa_users WHERE api_key = %s",
        (api_key,),
    )
    assert len(found) == 1, found
    return int(found[0][0]), found[0][1]


def seed_user(database_url: str, api_key: str) -> None:
    query(database_url, "INSERT INTO sa_users (api_key, transfers_made) VALUES (%s, 0)", (api_key,))


def record_states(database_url: str) -> dict[str, int]:
    found = query(database_url, "SELECT state, count(*) FROM idempotency_records GROUP BY state")
    return {state: int(n) for state, n in found}


def new_label(tag: str) -> str:
    """A label (and idempotency key) no other test uses."""
    return f"{tag}-{secrets.token_hex(6)}"


class Client:
    """The test client of one app, speaking the transfer API."""

    def __init__(self, app: Flask) -> None:
        self.app = app
        self.client: FlaskClient = app.test_client()

    def post(
        self,
        label: str,
        *,
        then: str | None = None,
        key: str | None = "",
        path: str = "/transfers",
        headers: Mapping[str, str] | None = None,
        api_key: str = API_KEY,
    ) -> TestResponse:
        """POST a transfer of ``label``; ``key`` defaults to the label, None sends none.
        ``then`` goes in the ``X-Then`` header, outside the fingerprint, so a retry
        of the same request can behave otherwise (a transient failure)."""
        sent = {"Authorization": f"Bearer {api_key}", **(headers or {})}
        if key is not None:
            sent["Idempotency-Key"] = key or label
        if then is not None:
            sent["X-Then"] = then
        return self.client.post(path, json={"label": label, "amount": 100}, headers=sent)


@pytest.fixture(params=DIALECTS)
def dialect(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def dialect_url(database_url: str, dialect: str) -> str:
    return sa_url(database_url, dialect)


@pytest.fixture
def make_sa_app(dialect_url: str) -> Iterator[Any]:
    """Factory: ``make_sa_app(**config)`` -> sa_app on the dialect's URL, its
    extension and engine closed at teardown."""
    apps: list[Flask] = []

    def make(**config: Any) -> Flask:
        app = sa_app.create_app(dialect_url, config)
        apps.append(app)
        return app

    yield make
    for app in apps:
        app.extensions["idempotency"].close()
        with app.app_context():
            for engine in sa_app.db.engines.values():
                engine.dispose()


@pytest.fixture
def client(make_sa_app: Any) -> Client:
    return Client(make_sa_app())


class Gates:
    """The file gates of ``sa_app`` (its docstring), in a directory of their own."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="sa-gates-"))
        self.root.chmod(0o777)

    def wait_entered(self, name: str, timeout: float = 15.0) -> int:
        """Until a view waits at ``name``; the pid of its worker."""
        path = self.root / f"{name}.entered"
        wait_until(lambda: path.exists() and path.read_text(), timeout, f"a view at gate {name}")
        return int(path.read_text())

    def open(self, name: str) -> None:
        (self.root / f"{name}.open").touch()

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="module")
def gates() -> Iterator[Gates]:
    opened = Gates()
    yield opened
    opened.close()


@contextlib.contextmanager
def serving(url: str, gates: Gates, **env: str) -> Iterator[GunicornServer]:
    """``sa_app`` on ``url`` (a SQLAlchemy URL) under gunicorn: 2 gthread workers x
    32 threads; ``env`` adds to its environment. Its log is printed at the end."""
    running = GunicornServer(
        "sa_app:create_app()",
        env={
            "PYTHONPATH": GUNICORN_PYTHONPATH,
            "SA_APP_DATABASE_URL": url,
            "SA_APP_GATE_DIR": str(gates.root),
            "SA_APP_SQLALCHEMY_POOL_SIZE": str(POOL_SIZE),
            "SA_APP_IDEMPOTENCY_WAIT": str(WAIT_SECONDS),
            **env,
        },
        workers=WORKERS,
        worker_class="gthread",
        threads=THREADS,
    )
    try:
        running.start()
        yield running
    finally:
        running.stop()
        print(f"--- {running!r} log ---\n{running.log_text()[-6000:]}")
        running.close()


def post(
    server: GunicornServer,
    label: str,
    *,
    headers: Mapping[str, str] | None = None,
    body: Mapping[str, object] | None = None,
    timeout: float = 30.0,
) -> HttpResponse:
    """POST a transfer of ``label`` (also its key) to a served ``sa_app``."""
    sent = {"Authorization": f"Bearer {API_KEY}", "Idempotency-Key": label, **(headers or {})}
    return http_request(
        "POST",
        server.url + "/transfers",
        sent,
        json=dict(body or {"label": label, "amount": 100}),
        timeout=timeout,
    )


def storm(server: GunicornServer, *, keys: int, duplicates: int) -> None:
    """``duplicates`` simultaneous requests for each of ``keys`` keys: each key's view
    runs once (one row), and its requests all get the same 201."""
    labels = [new_label("storm") for _ in range(keys)]
    start = threading.Barrier(keys * duplicates)

    def send(label: str) -> HttpResponse:
        start.wait()
        return post(server, label, body={"label": label, "then": "sleep", "seconds": 0.3})

    with ThreadPoolExecutor(max_workers=keys * duplicates) as pool:
        futures = {label: [pool.submit(send, label) for _ in range(duplicates)] for label in labels}
        answers = {label: [f.result(timeout=60) for f in fs] for label, fs in futures.items()}

    for label, got in answers.items():
        statuses = sorted({a.status for a in got})
        assert statuses == [201], f"{label}: {statuses} {got[0].body!r}"
        assert len({a.body for a in got}) == 1, f"{label}: different answers"
        replayed = sorted(a.headers["Idempotent-Replayed"] for a in got)
        assert replayed == ["false"] + ["true"] * (duplicates - 1), label
        assert rows(server.env["SA_APP_DATABASE_URL"], label) == ["first"], label


__all__ = ["client", "dialect", "dialect_url", "gates", "make_sa_app"]
