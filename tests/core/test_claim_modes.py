"""What only the transaction claim mode does: a holder's claim is its session.

The shared guarantees (replay, 409, 422, crashes through gunicorn) run in both
modes (``make test-transaction-mode``); these pin the mode's own mechanism:
a dead holder frees its key at once (no lease to wait out), its late
completion keeps nothing, and no processing row is ever written.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg2
from flask import Flask

from flask_idempotency.store.base import Claimed, StoredResponse, StoreUnavailableError
from flask_idempotency.store.sql import advisory_locks
from support.waiting import wait_until

MakeApp = Callable[..., Flask]
TRANSACTION = {"IDEMPOTENCY_CLAIM_MODE": "transaction"}
FINGERPRINT = b"one request"


def sql(dsn: str, query: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    conn = psycopg2.connect(dsn)
    try:
        with conn, conn.cursor() as cur:
            cur.execute(query, params)
            return cur.fetchall() if cur.description else []
    finally:
        conn.close()


def test_a_killed_holder_frees_its_key_at_once_and_its_completion_keeps_nothing(
    make_app: MakeApp, database_url: str
) -> None:
    app = make_app(**TRANSACTION)
    store = app.extensions["idempotency"].store
    record = b"k" * 32
    holder = store.begin()
    assert isinstance(holder.claim(record, FINGERPRINT, lease=30, ttl=60), Claimed)
    conn = holder.connection()
    with conn.cursor() as cur:
        cur.execute("INSERT INTO core_business_rows (label) VALUES ('holder')")
        cur.execute("SELECT pg_backend_pid()")
        row = cur.fetchone()
    assert row is not None
    # Nothing of the claim is visible: no processing row, only the session's locks.
    assert sql(database_url, "SELECT count(*) FROM idempotency_records") == [(0,)]
    request_lock, key_lock = advisory_locks(record, FINGERPRINT)
    held = sql(
        database_url,
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = %s",
        (row[0],),
    )
    assert held == [(2,)]

    sql(database_url, "SELECT pg_terminate_backend(%s)", (row[0],))  # the worker dies
    # pg_terminate_backend only signals: the session's locks go when its process exits.
    wait_until(
        lambda: (
            sql(database_url, "SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (row[0],))
            == [(0,)]
        ),
        10,
        "the terminated session to exit",
    )

    taker = store.begin()
    try:
        assert isinstance(taker.claim(record, FINGERPRINT, lease=30, ttl=60), Claimed)
        taker.complete(record, 1, StoredResponse(201, (), b"taker"))
    finally:
        taker.close()
    try:
        holder.complete(record, 1, StoredResponse(201, (), b"holder"))
        raise AssertionError("a dead session's completion was accepted")
    except StoreUnavailableError:
        pass
    finally:
        holder.close()
    assert sql(database_url, "SELECT convert_from(body, 'UTF8') FROM idempotency_records") == [
        ("taker",)
    ]
    assert sql(database_url, "SELECT count(*) FROM core_business_rows") == [(0,)]
    assert request_lock != key_lock


def test_a_raise_rolls_back_and_frees_the_key(make_app: MakeApp, database_url: str) -> None:
    app = make_app(**TRANSACTION)
    client = app.test_client()
    headers = {"Idempotency-Key": "tx-raise"}
    assert client.post("/charges", json={"raise": True}, headers=headers).status_code == 500
    assert sql(database_url, "SELECT count(*) FROM idempotency_records") == [(0,)]
    again = client.post("/charges", json={"raise": True}, headers=headers)
    assert again.status_code == 500  # ran again: nothing was kept
    assert app.extensions["runs"] == ["charges", "charges"]
    assert app.extensions["idempotency"].keeper.held() == []


def test_a_schema_without_the_read_only_check_is_named_and_runs_nothing(
    make_app: MakeApp, database_url: str
) -> None:
    """Code that relies on migration 0007's check, on a schema that lacks it (the
    migration not run before a deploy), refuses to claim rather than claim unchecked,
    and says why: 500 schema_outdated, not an outage's 503 (test_schema_missing.py)."""
    app = make_app(**TRANSACTION)  # migrated: the function exists
    sql(database_url, "DROP FUNCTION idempotency_claim_in_transaction_rw(bytea, bigint, bigint)")
    try:
        client = app.test_client()
        answer = client.post("/charges", json={}, headers={"Idempotency-Key": "tx-unmigrated"})
        assert answer.status_code == 500
        assert answer.get_json()["error"]["code"] == "schema_outdated"
        assert "Retry-After" not in answer.headers
        assert app.extensions["runs"] == []
        assert sql(database_url, "SELECT count(*) FROM idempotency_records") == [(0,)]
    finally:
        # Put the function back for the tests after this one, as `migrate` would.
        sql(
            database_url,
            "DELETE FROM idempotency_schema_migrations WHERE name LIKE %s",
            ("%0007%",),
        )
        state = app.extensions["idempotency"]
        state.store.migrate(state.settings.migration_dirs)
