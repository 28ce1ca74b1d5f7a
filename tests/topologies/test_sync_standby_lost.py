"""A synchronous standby that is gone: every COMMIT that writes waits for it.

PostgreSQL turns ``statement_timeout`` off for a COMMIT's wait for a standby,
so only the extension's client-side deadline (statement timeout + 1 s, see
``store/watchdog.py``) ends it. The idempotent request and the application's
own ``idempotency.transaction()`` must both answer ``503`` within it, not hang,
and the view must not run again on retry: the record stays claimed (or its
commit lands) until the standby returns.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import psycopg2
import pytest
from flask import Flask, jsonify, request

from flask_idempotency import Idempotency, StoreUnavailable, global_scope
from support.postgres_server import ThrowawayPostgres

pytestmark = pytest.mark.topology

STATEMENT_TIMEOUT = 1.0
#: The client-side deadline is the statement timeout plus one second; the
#: watchdog looks every 0.1 s.
WAIT_BOUND = STATEMENT_TIMEOUT + 1.0 + 1.5


@pytest.fixture
def server() -> Iterator[ThrowawayPostgres]:
    with ThrowawayPostgres() as pg:
        yield pg


def require_a_missing_standby(dsn: str, on: bool) -> None:
    """Make every writing COMMIT wait for a standby named ``ghost`` (never there)."""
    conn = psycopg2.connect(dsn, connect_timeout=5)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            if on:
                cur.execute("ALTER SYSTEM SET synchronous_standby_names = 'ghost'")
            else:
                cur.execute("ALTER SYSTEM RESET synchronous_standby_names")
            cur.execute("SELECT pg_reload_conf()")
    finally:
        conn.close()
    time.sleep(0.3)  # backends apply the reload before their next command


def make_app(dsn: str) -> Flask:
    app = Flask(__name__)
    app.config.update(
        IDEMPOTENCY_DATABASE_URL=dsn,
        IDEMPOTENCY_AUTO_MIGRATE=True,
        IDEMPOTENCY_SCOPE_FUNC=global_scope,
        IDEMPOTENCY_DATABASE_OPTIONS={"statement_timeout": STATEMENT_TIMEOUT, "lock_timeout": 0.5},
    )
    idempotency = Idempotency(app)
    runs: list[int] = []
    app.extensions["runs"] = runs

    @app.post("/charges")
    @idempotency.required
    def charge() -> Any:
        runs.append(1)
        with idempotency.connection().cursor() as cur:
            cur.execute("INSERT INTO charges (amount) VALUES (%s)", (request.get_json()["amount"],))
        return jsonify(n=len(runs)), 201

    @app.post("/notes")
    def note() -> Any:
        with idempotency.transaction() as conn, conn.cursor() as cur:
            cur.execute("INSERT INTO charges (amount) VALUES (0)")
        return jsonify(ok=True), 201

    return app


def test_a_lost_synchronous_standby_answers_503_within_the_deadline(
    server: ThrowawayPostgres,
) -> None:
    with psycopg2.connect(server.dsn) as conn, conn.cursor() as cur:
        cur.execute("CREATE TABLE charges (id serial PRIMARY KEY, amount int)")
    conn.close()
    app = make_app(server.dsn)
    client = app.test_client()
    try:
        warm = client.post("/charges", json={"amount": 1}, headers={"Idempotency-Key": "warm"})
        assert warm.status_code == 201  # migrated, pool open, before the standby goes

        require_a_missing_standby(server.dsn, True)
        started = time.monotonic()
        answer = client.post("/charges", json={"amount": 2}, headers={"Idempotency-Key": "k"})
        charge_seconds = time.monotonic() - started
        assert answer.status_code == 503, answer.get_data()
        assert answer.get_json()["error"]["code"] == "store_unavailable"
        assert charge_seconds < WAIT_BOUND, charge_seconds

        # The application's own transaction: the same deadline, a 503, not a hang.
        started = time.monotonic()
        with app.test_request_context(), pytest.raises(StoreUnavailable):
            app.view_functions["note"]()
        note_seconds = time.monotonic() - started
        assert note_seconds < WAIT_BOUND, note_seconds

        # A retry while the standby is still gone does not run the view again.
        retry = client.post("/charges", json={"amount": 2}, headers={"Idempotency-Key": "k"})
        assert retry.status_code in (409, 503), retry.get_data()
        assert len(app.extensions["runs"]) == 2  # warm and k, once

        # The standby is back (here: no longer required): the waiting commit lands,
        # and the retry replays it.
        require_a_missing_standby(server.dsn, False)
        deadline = time.monotonic() + 15
        while True:
            final = client.post("/charges", json={"amount": 2}, headers={"Idempotency-Key": "k"})
            if final.status_code == 201 or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        assert final.status_code == 201, final.get_data()
        assert len(app.extensions["runs"]) in (2, 3)  # 3 only if the commit never landed
        with psycopg2.connect(server.dsn) as conn, conn.cursor() as cur:
            cur.execute("SELECT count(*) FROM charges WHERE amount = 2")
            row = cur.fetchone()
        conn.close()
        assert row is not None and row[0] == 1  # one charge row for k, whichever way
    finally:
        app.extensions["idempotency"].close()
