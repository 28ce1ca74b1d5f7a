"""The prepared claim, first-request claim and completion, against real PostgreSQL.

A connection's first claim prepares three statements in one round trip: the
full claim, the cheaper claim a request tries first (``CLAIM_NEW_BODY``: a new
key inserted, a held one read), and the completion (in transaction mode: the
claim's and the completed record's calls). The completion then runs prepared
on the connection its claim ran on. These tests hold what that must not
change: the prepared completion stores exactly what the schema's function
stores and is fenced the same way, and a view that drops the session's
prepared statements (``DEALLOCATE ALL`` on its own connection) loses its
attempt, never half of it.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from flask import Flask

from flask_idempotency import Idempotency, global_scope
from flask_idempotency.store.base import Claimed, LeaseLostError, StoredResponse
from flask_idempotency.store.pool import ConnectionPool
from flask_idempotency.store.postgres import PostgresStore
from flask_idempotency.testing import databases
from support.pg_query import query as sql

ANSWER = StoredResponse(201, (("Content-Type", "application/json"),), b'{"id": 1}')
#: What the completion writes, and what it clears, read back per record.
COMPLETED_COLUMNS = """
SELECT state, status_code, headers, body, lock_token, lease_expires_at, recovery, phases,
       completed_at IS NOT NULL, expires_at - completed_at >= interval '59 seconds'
  FROM idempotency_records WHERE record_key = %s
"""


@pytest.fixture
def stores(clean_db: str) -> Iterator[dict[bool, PostgresStore]]:
    """A store with prepared statements (``True``) and one without (``False``)."""
    databases.migrate(clean_db)
    made = {
        prepared: PostgresStore(ConnectionPool(clean_db, max_size=2), prepare_statements=prepared)
        for prepared in (True, False)
    }
    yield made
    for store in made.values():
        store.close()


def complete_one(store: PostgresStore, record_key: bytes, *, recovery: bytes | None) -> None:
    tx = store.begin()
    try:
        claimed = tx.claim(record_key, b"fp", lease=30, ttl=60, recovery=recovery)
        assert isinstance(claimed, Claimed)
        with tx.connection().cursor() as cur:
            cur.execute("SELECT 1")
        tx.complete(record_key, claimed.token, ANSWER)
    finally:
        tx.close()


@pytest.mark.parametrize("recovery", [None, b"payload"])
def test_the_prepared_completion_stores_what_the_function_stores(
    stores: dict[bool, PostgresStore], clean_db: str, recovery: bytes | None
) -> None:
    for prepared, store in stores.items():
        complete_one(store, f"key-{prepared}".encode(), recovery=recovery)
    [by_function] = sql(clean_db, COMPLETED_COLUMNS, (b"key-False",))
    [prepared_row] = sql(clean_db, COMPLETED_COLUMNS, (b"key-True",))
    assert prepared_row == by_function
    assert prepared_row[0] == "completed" and prepared_row[6] is None  # recovery dropped


def test_the_prepared_completion_is_fenced(
    stores: dict[bool, PostgresStore], clean_db: str
) -> None:
    """A holder whose record was taken over stores nothing, and its transaction's
    writes go with it."""
    sql(clean_db, "CREATE TABLE IF NOT EXISTS prepared_fenced_rows (id serial PRIMARY KEY)")
    sql(clean_db, "TRUNCATE prepared_fenced_rows")
    store = stores[True]
    tx = store.begin()
    try:
        claimed = tx.claim(b"fenced", b"fp", lease=30, ttl=60)
        assert isinstance(claimed, Claimed)
        with tx.connection().cursor() as cur:
            cur.execute("INSERT INTO prepared_fenced_rows DEFAULT VALUES")
        sql(clean_db, "UPDATE idempotency_records SET lock_token = 1 WHERE record_key = 'fenced'")
        with pytest.raises(LeaseLostError):
            tx.complete(b"fenced", claimed.token, ANSWER)
    finally:
        tx.close()
    assert sql(clean_db, "SELECT count(*) FROM prepared_fenced_rows") == [(0,)]
    assert sql(clean_db, "SELECT state FROM idempotency_records") == [("processing",)]


@pytest.mark.parametrize("claim_mode", ["row", "transaction"])
def test_a_view_that_deallocates_the_statements_loses_its_attempt_whole(
    clean_db: str, claim_mode: str
) -> None:
    """``DEALLOCATE ALL`` on the view's own connection takes the prepared completion
    with it: the attempt fails closed (503) with none of its writes, and the retry
    runs the view once more and is stored."""
    databases.migrate(clean_db)
    sql(clean_db, "CREATE TABLE IF NOT EXISTS prepared_view_rows (id serial PRIMARY KEY)")
    sql(clean_db, "TRUNCATE prepared_view_rows")
    app = Flask(__name__)
    app.config.update(
        IDEMPOTENCY_DATABASE_URL=clean_db,
        IDEMPOTENCY_SCOPE_FUNC=global_scope,
        IDEMPOTENCY_CLAIM_MODE=claim_mode,
    )
    idempotency = Idempotency(app)
    runs: list[int] = []

    @app.post("/charges")
    @idempotency.required
    def charge() -> tuple[dict[str, int], int]:
        runs.append(1)
        with idempotency.connection().cursor() as cur:
            cur.execute("INSERT INTO prepared_view_rows DEFAULT VALUES RETURNING id")
            row = cur.fetchone()
            if len(runs) == 1:
                cur.execute("DEALLOCATE ALL")
        assert row is not None
        return {"id": row[0]}, 201

    try:
        client = app.test_client()
        first = client.post("/charges", json={}, headers={"Idempotency-Key": "k"})
        assert first.status_code == 503, first.data
        assert sql(clean_db, "SELECT count(*) FROM prepared_view_rows") == [(0,)]
        retry = client.post("/charges", json={}, headers={"Idempotency-Key": "k"})
        assert retry.status_code == 201, retry.data
        replay = client.post("/charges", json={}, headers={"Idempotency-Key": "k"})
        assert replay.headers["Idempotent-Replayed"] == "true"
        assert replay.get_json() == retry.get_json()
        assert len(runs) == 2
        assert sql(clean_db, "SELECT count(*) FROM prepared_view_rows") == [(1,)]
    finally:
        app.extensions["idempotency"].close()


def test_statements_gone_from_a_session_turn_prepared_completions_off(
    clean_db: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A claim can prepare its statements again, a completion cannot (the view's
    writes are in its transaction): once a session is found without them (a pooler
    in transaction mode moving sessions, an application deallocating them), the
    store completes through the function, and says why once."""
    databases.migrate(clean_db)
    store = PostgresStore(ConnectionPool(clean_db, max_size=1))
    try:
        complete_one(store, b"before", recovery=None)
        prepared_before = store.prepared_completion  # (a local: mypy narrows the attribute)
        assert prepared_before
        with store.pool.connection() as conn, conn.cursor() as cur:  # the only connection
            cur.execute("DEALLOCATE ALL")
        with caplog.at_level("WARNING", logger="flask_idempotency.store"):
            complete_one(store, b"after", recovery=None)
            complete_one(store, b"later", recovery=None)
        prepared_after = store.prepared_completion
        assert not prepared_after
        said = [r.getMessage() for r in caplog.records if "vanished" in r.getMessage()]
        assert len(said) == 1 and "prepare_statements" in said[0]
        states = sql(clean_db, "SELECT state FROM idempotency_records ORDER BY record_key")
        assert states == [("completed",)] * 3
    finally:
        store.close()
