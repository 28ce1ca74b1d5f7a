"""A forgotten or outdated schema is named as such, not answered as an outage.

Each test gets a database of its own, empty (``fresh_database_url``): a missing
schema is the state under test. The contract's outage row (PostgreSQL
unreachable: ``503 store_unavailable`` with ``Retry-After``) still holds; a
database that answers without the extension's tables is a misconfiguration:
``500 schema_missing`` (or ``schema_outdated``), no ``Retry-After``, the view
never runs, and one ERROR that names the command to run.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg2
import pytest
from flask import Flask
from werkzeug.test import TestResponse

from flask_idempotency import (
    Idempotency,
    SchemaMissing,
    SchemaOutdated,
    StoreUnavailable,
    global_scope,
)
from flask_idempotency.completer import Recoverer
from flask_idempotency.events.messages import ConsumerOutcome, Delivery
from flask_idempotency.events.relay import Backoff, Relay
from flask_idempotency.store import migrations
from flask_idempotency.store.base import StoreUnavailableError
from flask_idempotency.store.schema import Problem, SchemaWatch
from flask_idempotency.testing import databases
from support.clock import FakeClock
from support.tcp_proxy import TcpProxy

STORE_LOGGER = "flask_idempotency.store"
LAST_MIGRATION = migrations.package_migrations()[-1][0]
#: The ledger of a database last migrated by the previous release.
FORGET_LAST_MIGRATION = f"DELETE FROM idempotency_schema_migrations WHERE name = '{LAST_MIGRATION}'"

MakeApp = Callable[..., Flask]


@pytest.fixture
def make_app(fresh_database_url: str) -> Iterator[MakeApp]:
    """``make_app(**config)``: a one-route app on the test's own empty database;
    ``app.extensions["runs"]`` counts the view's runs."""
    apps: list[tuple[Flask, Any]] = []

    def make(url: str | None = None, *, db: Any = None, **config: Any) -> Flask:
        app = Flask(__name__)
        app.config.update(IDEMPOTENCY_SCOPE_FUNC=global_scope, **config)
        if db is None:
            app.config["IDEMPOTENCY_DATABASE_URL"] = url or fresh_database_url
        else:
            app.config["SQLALCHEMY_DATABASE_URI"] = url
            db.init_app(app)
        idempotency = Idempotency(app, db)
        runs: list[str] = []
        app.extensions["runs"] = runs

        @app.post("/charges")
        @idempotency.required
        def charge() -> tuple[dict[str, int], int]:
            runs.append("charge")
            with idempotency.connection().cursor() as cur:
                cur.execute("SELECT 1")
            return {"id": len(runs)}, 201

        @app.get("/healthz")
        def healthz() -> dict[str, str]:
            idempotency.ping()
            return {"status": "ok"}

        apps.append((app, db))
        return app

    yield make
    for app, db in apps:
        app.extensions["idempotency"].close()
        if db is not None:
            with app.app_context():
                db.engine.dispose()  # before the database is dropped


def post(app: Flask, key: str = "k-1") -> TestResponse:
    return app.test_client().post("/charges", json={"amount": 1}, headers={"Idempotency-Key": key})


def sql(url: str, statement: str) -> None:
    conn = psycopg2.connect(url)
    try:
        with conn, conn.cursor() as cur:
            cur.execute(statement)
    finally:
        conn.close()


def sessions_on(url: str) -> int:
    """Other sessions connected to ``url``'s database."""
    conn = psycopg2.connect(url)
    try:
        with conn.cursor() as cur:
            cur.execute(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
            row = cur.fetchone()
            assert row is not None
            return int(row[0])
    finally:
        conn.close()


def errors_logged(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == STORE_LOGGER and r.levelno >= logging.ERROR
    ]


def assert_named(response: TestResponse, code: str, *, ietf: bool = False) -> None:
    """A non-retryable 500 with ``code``, in the profile's format."""
    assert response.status_code == 500, response.get_data(as_text=True)
    assert "Retry-After" not in response.headers
    assert "Idempotent-Replayed" not in response.headers
    # Final: Stripe's SDKs would otherwise retry a 500 (issue 39).
    assert response.headers.get("Stripe-Should-Retry") == (None if ietf else "false")
    body = json.loads(response.get_data())
    if ietf:
        assert response.mimetype == "application/problem+json"
        assert body["code"] == code and body["status"] == 500
        assert body["type"].endswith(code)
    else:
        assert response.mimetype == "application/json"
        assert body["error"]["code"] == code
        assert body["error"]["type"] == "idempotency_error"


@pytest.mark.parametrize("profile", ["stripe", "ietf"])
@pytest.mark.parametrize("claim_mode", ["row", "transaction"])
def test_a_forgotten_migrate_is_named_and_not_retryable(
    make_app: MakeApp, caplog: pytest.LogCaptureFixture, profile: str, claim_mode: str
) -> None:
    caplog.set_level(logging.INFO)
    app = make_app(IDEMPOTENCY_PROFILE=profile, IDEMPOTENCY_CLAIM_MODE=claim_mode)
    [logged] = errors_logged(caplog)  # at start-up, before any request
    assert "flask idempotency migrate" in logged and "upgrade_schema(op)" in logged

    for key in ("k-1", "k-1", "k-2"):
        assert_named(post(app, key), "schema_missing", ietf=profile == "ietf")
    assert app.extensions["runs"] == []
    assert len(errors_logged(caplog)) == 1, "logged once, not once per request"
    assert not [r for r in caplog.records if r.levelno == logging.WARNING], caplog.text
    assert app.extensions["idempotency"].metrics.snapshot()["schema_missing"] == 3


def test_an_outdated_schema_is_named(
    make_app: MakeApp, fresh_database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The ledger says a migration of this release is not applied."""
    databases.migrate(fresh_database_url)
    sql(fresh_database_url, FORGET_LAST_MIGRATION)
    caplog.set_level(logging.INFO)
    app = make_app()
    [logged] = errors_logged(caplog)
    assert LAST_MIGRATION in logged and "flask idempotency migrate" in logged

    assert_named(post(app), "schema_outdated")
    assert app.extensions["runs"] == []


@pytest.mark.parametrize(
    ("claim_mode", "damage"),
    [
        ("row", "ALTER TABLE idempotency_records RENAME COLUMN fingerprint TO fingerprint_old"),
        ("transaction", "DROP FUNCTION idempotency_claim_in_transaction_rw(bytea, bigint, bigint)"),
    ],
)
def test_an_object_the_claim_misses_is_named(
    make_app: MakeApp,
    fresh_database_url: str,
    caplog: pytest.LogCaptureFixture,
    claim_mode: str,
    damage: str,
) -> None:
    """The ledger says all is applied, but the claim finds a column or function
    missing (SQLSTATE 42703 / 42883): named from the statement's error."""
    databases.migrate(fresh_database_url)
    sql(fresh_database_url, damage)
    caplog.set_level(logging.INFO)
    app = make_app(IDEMPOTENCY_CLAIM_MODE=claim_mode)
    assert errors_logged(caplog) == []

    assert_named(post(app), "schema_outdated")
    assert_named(post(app), "schema_outdated")  # refused from memory now
    assert app.extensions["runs"] == []
    [logged] = errors_logged(caplog)
    assert "flask idempotency migrate" in logged


def test_a_missing_completion_function_rolls_the_attempt_back(
    make_app: MakeApp, fresh_database_url: str
) -> None:
    """It is found only after the view ran: nothing of it is kept, and it is named;
    the next request is refused before its view."""
    databases.migrate(fresh_database_url)
    sql(
        fresh_database_url,
        "DROP FUNCTION idempotency_complete_v2(bytea, bigint, smallint, jsonb, bytea, text)",
    )
    app = make_app()
    assert_named(post(app), "schema_outdated")
    assert_named(post(app), "schema_outdated")
    assert app.extensions["runs"] == ["charge"]  # the second was refused before its view


def test_ping_names_the_schema(make_app: MakeApp, fresh_database_url: str) -> None:
    app = make_app()
    idempotency = app.extensions["idempotency"]
    with app.app_context():
        with pytest.raises(SchemaMissing) as missing:
            Idempotency.ping(Idempotency())
    assert not isinstance(missing.value, StoreUnavailable)  # not the outage's 503
    assert isinstance(missing.value, StoreUnavailableError)  # still fails closed
    assert "flask idempotency migrate" in missing.value.detail
    assert_named(app.test_client().get("/healthz"), "schema_missing")

    databases.migrate(fresh_database_url)
    sql(fresh_database_url, FORGET_LAST_MIGRATION)
    idempotency.store.schema.recheck = 0.0
    response = app.test_client().get("/healthz")
    assert_named(response, "schema_outdated")
    with app.app_context(), pytest.raises(SchemaOutdated):
        Idempotency.ping(Idempotency())

    databases.migrate(fresh_database_url)
    assert app.test_client().get("/healthz").status_code == 200


def test_a_migrate_while_serving_is_picked_up_without_a_restart(
    make_app: MakeApp, fresh_database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    app = make_app()
    assert_named(post(app), "schema_missing")

    databases.migrate(fresh_database_url)  # another process runs the command
    # Within the re-check interval the known problem is answered from memory...
    assert_named(post(app), "schema_missing")
    # ...and once it has passed, the next request looks again and is served.
    app.extensions["idempotency"].store.schema.recheck = 0.0
    response = post(app)
    assert response.status_code == 201, response.get_data(as_text=True)
    assert app.extensions["runs"] == ["charge"]
    assert post(app).headers["Idempotent-Replayed"] == "true"
    assert "schema is in place" in caplog.text


def test_migrate_in_the_same_process_is_picked_up_at_once(make_app: MakeApp) -> None:
    app = make_app()
    assert_named(post(app), "schema_missing")
    result = app.test_cli_runner().invoke(args=["idempotency", "migrate"])
    assert result.exit_code == 0, result.output
    assert post(app).status_code == 201


def test_an_unreachable_start_is_still_an_outage_then_named_on_first_use(
    make_app: MakeApp,
    fresh_database_url: str,
    tcp_proxy: Callable[..., TcpProxy],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    proxy = tcp_proxy(fresh_database_url)
    proxy.cut()
    app = make_app(proxy.url, IDEMPOTENCY_DATABASE_OPTIONS={"connect_timeout": 2})
    assert errors_logged(caplog) == []
    assert "schema not checked" in caplog.text

    down = post(app)
    assert down.status_code == 503
    assert json.loads(down.get_data())["error"]["code"] == "store_unavailable"
    assert int(down.headers["Retry-After"]) >= 1

    proxy.restore()
    assert_named(post(app), "schema_missing")
    assert_named(post(app), "schema_missing")
    assert app.extensions["runs"] == []
    [logged] = errors_logged(caplog)
    assert "flask idempotency migrate" in logged


@pytest.mark.parametrize("dialect", ["psycopg2", "psycopg"])
def test_flask_sqlalchemy_apps_get_the_same_answers(
    make_app: MakeApp, fresh_database_url: str, dialect: str
) -> None:
    from flask_sqlalchemy import SQLAlchemy

    url = fresh_database_url.replace("postgresql://", f"postgresql+{dialect}://", 1)
    before = sessions_on(fresh_database_url)  # the fixture's own
    app = make_app(url, db=SQLAlchemy())
    # The start-up check closed its connection: an app built before gunicorn forks
    # (--preload) leaves its workers no shared socket in db's pool.
    assert sessions_on(fresh_database_url) == before
    assert_named(post(app), "schema_missing")

    databases.migrate(fresh_database_url)
    sql(fresh_database_url, "ALTER TABLE idempotency_records RENAME COLUMN fingerprint TO fp_old")
    app.extensions["idempotency"].store.schema.recheck = 0.0
    assert_named(post(app, "k-2"), "schema_outdated")  # from the claim's SQLSTATE
    assert app.extensions["runs"] == []


def test_a_known_problem_is_read_again_only_every_few_seconds() -> None:
    """The request path reads the ledger at most once per re-check interval."""
    clock = FakeClock(100.0)
    reads: list[float] = []
    answer: list[Problem | None] = [Problem(True, "no tables")]

    def inspect() -> Problem | None:
        reads.append(clock.now)
        return answer[0]

    watch = SchemaWatch(inspect, recheck=5.0, clock=clock)
    for _ in range(3):
        with pytest.raises(StoreUnavailableError):
            watch.ensure()  # the first call reads; the others answer from memory
    assert reads == [100.0]
    clock.now += 4.9
    with pytest.raises(StoreUnavailableError):
        watch.guard()
    assert reads == [100.0]
    answer[0] = None  # someone ran migrate
    clock.now += 0.2
    watch.guard()
    watch.guard()
    assert len(reads) == 2  # one read once the interval had passed, not one per call
    assert watch.problem is None


def test_the_migrate_command_itself_logs_no_schema_error(
    fresh_database_url: str, tmp_path: Path
) -> None:
    """``flask idempotency migrate`` (and ``flask db upgrade``) load the app to find
    their command: no ERROR telling the operator to run what they are running."""
    (tmp_path / "schema_app.py").write_text(
        "import logging\n"
        "from flask import Flask\n"
        "from flask_idempotency import Idempotency, global_scope\n"
        "logging.basicConfig(level=logging.INFO)\n"
        "app = Flask(__name__)\n"
        f"app.config.update(IDEMPOTENCY_DATABASE_URL={fresh_database_url!r},\n"
        "                  IDEMPOTENCY_SCOPE_FUNC=global_scope)\n"
        "Idempotency(app)\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "flask", "--app", "schema_app", "idempotency", "migrate"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "schema is up to date" in done.stdout
    assert "ERROR" not in done.stderr and "no idempotency tables" not in done.stderr


class _Publisher:
    """The relay's publisher: never reached while the outbox table is missing."""

    def publish(self, event: Any) -> bool:
        raise AssertionError("nothing can be published from a missing outbox")

    def close(self) -> None:
        pass


def test_background_workers_name_a_missing_schema_and_keep_waiting(
    fresh_database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The completer, the relay and a consumer on a database nobody migrated: each
    logs an ERROR that names the command (not a WARNING "store unavailable", not a
    traceback), keeps its loop alive, and runs nothing."""
    app = Flask(__name__)
    app.config.update(
        IDEMPOTENCY_DATABASE_URL=fresh_database_url, IDEMPOTENCY_SCOPE_FUNC=global_scope
    )
    idempotency = Idempotency(app)
    handled: list[str] = []

    @idempotency.consumer("receipts")
    def write_receipt(delivery: Delivery) -> None:
        handled.append(str(delivery.id))

    caplog.set_level(logging.INFO)
    try:
        stop = threading.Event()
        threading.Timer(0.6, stop.set).start()
        Recoverer(app).run(stop, interval=0.1)  # returns when stopped: it never raised

        relay = Relay.for_app(app, _Publisher(), backoff=Backoff(initial=0.05, maximum=0.1))
        stop = threading.Event()
        threading.Timer(0.6, stop.set).start()
        relay.run(stop)
        assert relay.stats.outages >= 1 and relay.stats.published == 0

        result = write_receipt.handle(Delivery(id="m-1", type="receipt", payload={}), app=app)
        assert result.outcome is ConsumerOutcome.RETRY and handled == []
    finally:
        app.extensions["idempotency"].close()

    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    for worker in ("idempotency recover: schema missing", "relay:", "consumer receipts: schema"):
        named = [message for message in errors if message.startswith(worker)]
        assert named, (worker, errors)
        assert "flask idempotency migrate" in named[0]
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
    assert not [r for r in caplog.records if "store unavailable" in r.getMessage()]
