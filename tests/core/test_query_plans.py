"""The store's cached plans stay index lookups however small the table was when cached.

plpgsql caches the plans of the statements inside the schema's functions (the
completion's UPDATE) per connection, and PostgreSQL settles on a *generic* plan
after a few executions. When that happens while ``idempotency_records`` is empty or tiny (a
fresh deployment, a table just purged, a benchmark's first seconds), the
cheapest plan is a sequential scan, and the connection keeps it until
something invalidates it: every later claim then reads the whole table. That
showed as one benchmark subject paying twice the database CPU of an identical
one started a few seconds later, and in production it would make each claim
O(table) on the connections that were opened first.

These tests cache the plans on an empty, freshly analysed table, grow the
table, and count the sequential scans the next claim and completion make on
that same connection.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Iterator

import psycopg2
import psycopg2.extras
import pytest

from flask_idempotency.settings import Settings
from flask_idempotency.store.base import Claimed, StoredResponse
from flask_idempotency.store.pool import EnginePool, build_engine
from flask_idempotency.store.postgres import PostgresStore

#: Enough rows that a sequential scan is never the cheapest plan.
GROWN_TO = 20_000
#: More executions than PostgreSQL's five custom plans before it settles on one.
WARM_EXECUTIONS = 10


@pytest.fixture
def store(clean_db: str) -> Iterator[PostgresStore]:
    """A store with one pooled connection, so every claim reuses its cached plans."""
    store = PostgresStore(_one_connection(clean_db), Settings(async_claim_commit=False))
    store.migrate()
    try:
        yield store
    finally:
        store.close()


def _one_connection(dsn: str) -> EnginePool:
    engine = build_engine(Settings(database_url=dsn, pool_size=1, connect_timeout=3))
    return EnginePool(engine, owned=True)


def _claim_params(key: bytes) -> dict[str, object]:
    return {"key": key, "fp": b"fp", "token": 7, "lease": 30.0, "ttl": 3600.0, "recovery": None}


def _run(dsn: str, sql: str) -> None:
    conn = psycopg2.connect(dsn)
    conn.autocommit = True  # VACUUM refuses to run in a transaction block
    try:
        with conn.cursor() as cur:
            cur.execute(sql)
    finally:
        conn.close()


def _sequential_scans(cur: psycopg2.extensions.cursor) -> int:
    """Sequential scans of the records table this backend has not yet reported
    (the current transaction's, and possibly a few before it): compare two readings."""
    cur.execute(
        "SELECT seq_scan FROM pg_stat_xact_user_tables WHERE relname = 'idempotency_records'"
    )
    row = cur.fetchone()
    return int(row[0]) if row else 0


def test_plans_cached_on_an_empty_table_still_use_the_index_once_it_grows(
    store: PostgresStore, clean_db: str
) -> None:
    _run(clean_db, "VACUUM ANALYZE idempotency_records")  # the planner now knows it is empty
    for _ in range(WARM_EXECUTIONS):
        key = secrets.token_bytes(32)
        request = store.begin()
        try:
            claimed = request.claim(key, b"fp", lease=30, ttl=3600)
            assert isinstance(claimed, Claimed)
            request.connection()  # BEGIN, as a view asking for the connection does
            request.complete(key, claimed.token, StoredResponse(201, (), b"{}"))
            # A replay: the claim's second branch reads the row.
            assert not isinstance(request.claim(key, b"fp", lease=30, ttl=3600), Claimed)
        finally:
            request.close()
    _run(
        clean_db,
        "INSERT INTO idempotency_records (record_key, fingerprint, state, expires_at)"
        " SELECT sha256(i::text::bytea), 'fp', 'completed', now() + interval '1 hour'"
        f" FROM generate_series(1, {GROWN_TO}) AS i",
    )

    key, new_key = secrets.token_bytes(32), secrets.token_bytes(32)
    grown = hashlib.sha256(b"1").digest()
    answer = (201, psycopg2.extras.Json([]), b"{}")
    with store.pool.connection() as conn, conn.cursor() as cur:  # the same, only connection
        cur.execute("BEGIN")
        before = _sequential_scans(cur)
        for claim_key, claims in ((key, True), (grown, False), (new_key, True)):
            cur.execute(store.statements.claim, _claim_params(claim_key))
            row = cur.fetchone()
            assert row is not None and row[0] is claims
            assert _sequential_scans(cur) == before, "the claim scanned the whole table"
        cur.execute(store.statements.complete.removesuffix(";\nCOMMIT"), (key, 7, *answer))
        assert _sequential_scans(cur) == before, "the completion scanned the whole table"
        cur.execute("ROLLBACK")


def test_the_claims_settings_do_not_reach_the_views_transaction(clean_db: str) -> None:
    """The timeouts and the asynchronous commit are ``SET LOCAL`` in the claim's
    own implicit transaction: the view's queries, on the same connection right
    after, run as the session says, and its COMMIT is durable."""
    store = PostgresStore(_one_connection(clean_db), Settings(async_claim_commit=True))
    store.migrate()
    request = store.begin()
    try:
        claimed = request.claim(secrets.token_bytes(32), b"fp", lease=30, ttl=3600)
        assert isinstance(claimed, Claimed)
        conn = request.connection()  # BEGIN: the business transaction
        with conn.cursor() as cur:
            cur.execute(
                "SELECT current_setting('statement_timeout'), current_setting('synchronous_commit')"
            )
            assert cur.fetchone() == ("0", "on")
    finally:
        request.close()
        store.close()
