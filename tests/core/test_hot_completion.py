"""A row-mode completion is a HOT update: no index entry written (migration 0009).

A first request writes its record twice, the claim's ``INSERT`` and the
completion's ``UPDATE``. PostgreSQL keeps an update on the row's page and
writes no index entry (a heap-only tuple) only when no column an index names
changes, so these tests fail whenever an index or a ``SET`` item starts naming
a column the completion changes. ``n_tup_hot_upd`` counts such updates, in
``pg_stat_xact_user_tables`` for the transaction that made them and in
``pg_stat_user_tables`` once a backend reports them.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from typing import Any

import psycopg2
import pytest
from flask import Flask

from flask_idempotency.settings import Settings
from flask_idempotency.store.sql import Statements
from flask_idempotency.testing import databases
from support.pg_query import query as sql
from support.waiting import wait_until

MakeApp = Callable[..., Flask]

ANSWER = (201, '[["Content-Type", "application/json"]]', b'{"id": 1}')
#: The request path's texts as a store with the default settings sends them.
STATEMENTS = Statements.build(
    Settings(statement_timeout=5.0, lock_timeout=2.0, async_claim_commit=True)
)
CLAIM_PARAMS = {"fp": b"fp", "token": 7, "lease": 30.0, "ttl": 3600.0}
#: How long a request's record lives (the core app's ``/optional`` route).
TTL = 3600.0


def _updates(cur: Any) -> tuple[int, int]:
    """This transaction's updates of the records table: (all, heap-only)."""
    cur.execute(
        "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_xact_user_tables"
        " WHERE relname = 'idempotency_records'"
    )
    row = cur.fetchone()
    return (int(row[0]), int(row[1])) if row else (0, 0)


@pytest.fixture
def cur(clean_db: str) -> Iterator[Any]:
    """A cursor on its own connection, outside any transaction, to a migrated database."""
    databases.migrate(clean_db)
    conn = psycopg2.connect(clean_db)
    conn.autocommit = True
    try:
        with conn.cursor() as cursor:
            yield cursor
    finally:
        conn.close()


def _claim(cur: Any, *, recovery: bytes | None = None) -> bytes:
    """A new key claimed as a row-mode request claims it (committed, lock token 7)."""
    key = secrets.token_bytes(32)
    cur.execute(STATEMENTS.claim, {"key": key, "recovery": recovery, **CLAIM_PARAMS})
    assert cur.fetchone()[0] is True
    return key


@pytest.mark.parametrize(
    ("recovery", "hot"),
    [
        (None, True),
        # A recover= route's completion clears the payload its index is on.
        (b"payload", False),
    ],
)
def test_a_completion_writes_no_index_entry_unless_the_route_keeps_recovery(
    cur: Any, clean_db: str, recovery: bytes | None, hot: bool
) -> None:
    key = _claim(cur, recovery=recovery)
    cur.execute("BEGIN")
    cur.execute(STATEMENTS.complete.removesuffix(";\nCOMMIT"), (key, 7, *ANSWER))
    assert _updates(cur) == (1, 1 if hot else 0)
    cur.execute("COMMIT")
    [(state, lives)] = sql(
        clean_db,
        "SELECT state, expires_at - created_at = interval '1 hour' FROM idempotency_records",
    )
    assert (state, lives) == ("completed", True)  # the claim's expiry stands


def test_a_slow_views_answer_lives_nine_tenths_of_the_ttl_after_it_is_stored(
    cur: Any, clean_db: str
) -> None:
    """The one completion that moves ``expires_at``: a view that ran past a tenth of
    the TTL (here its claim is made to look 50 minutes old, of one hour)."""
    key = _claim(cur)
    cur.execute(
        "UPDATE idempotency_records SET created_at = created_at - interval '50 min',"
        " expires_at = expires_at - interval '50 min' WHERE record_key = %s",
        (key,),
    )
    cur.execute("BEGIN")
    cur.execute(STATEMENTS.complete.removesuffix(";\nCOMMIT"), (key, 7, *ANSWER))
    [remaining] = cur.fetchone()
    cur.execute("COMMIT")
    assert remaining == pytest.approx(0.9 * TTL, abs=5)
    [(after_completion,)] = sql(
        clean_db,
        "SELECT extract(epoch FROM expires_at - completed_at)::float8 FROM idempotency_records",
    )
    assert after_completion == pytest.approx(0.9 * TTL, abs=5)


def _table_updates(dsn: str) -> tuple[int, int]:
    [(updated, hot)] = sql(
        dsn,
        "SELECT coalesce(sum(n_tup_upd), 0), coalesce(sum(n_tup_hot_upd), 0)"
        " FROM pg_stat_user_tables WHERE relname = 'idempotency_records'",
    )
    return int(updated), int(hot)


def _post(app: Flask, key: str) -> int:
    response = app.test_client().post(
        "/optional", json={"amount": 1}, headers={"Idempotency-Key": key}
    )
    return response.status_code


def test_first_requests_through_the_app_update_their_records_heap_only(
    make_app: MakeApp, clean_db: str
) -> None:
    """End to end: the request path's own completions are HOT.
    A backend reports its counts when it exits, so the app is closed first."""
    requests = 20
    before = _table_updates(clean_db)
    app = make_app()
    assert all(_post(app, f"hot-{n}") == 201 for n in range(requests))
    app.extensions["idempotency"].close()
    wait_until(
        lambda: _table_updates(clean_db)[0] >= before[0] + requests,
        15.0,
        f"{requests} updates reported",
        describe=lambda: f"before {before}, now {_table_updates(clean_db)}",
    )
    after = _table_updates(clean_db)
    assert (after[0] - before[0], after[1] - before[1]) == (requests, requests)
    [(lives,)] = sql(
        clean_db,
        "SELECT bool_and(expires_at - created_at = make_interval(secs => %s))"
        " FROM idempotency_records",
        (TTL,),
    )
    assert lives is True


def test_no_check_expression_is_read_back_on_every_write(clean_db: str) -> None:
    """PostgreSQL deserializes a CHECK constraint's expression for each INSERT and
    UPDATE statement: about a tenth of a first request's database work here
    (``python -m benchmarks.pg_instructions``). Migration 0009 dropped the one on
    ``state``; a new one would bring that cost back."""
    databases.migrate(clean_db)
    checks = sql(
        clean_db,
        "SELECT conname FROM pg_constraint"
        " WHERE conrelid = 'idempotency_records'::regclass AND contype = 'c'",
    )
    assert checks == []


@pytest.mark.parametrize(("view_seconds", "lives_from"), [(0.0, "claim"), (1.2, "completion")])
def test_the_transaction_modes_record_follows_the_same_ttl_rule(
    cur: Any, clean_db: str, view_seconds: float, lives_from: str
) -> None:
    """``claim_mode = "transaction"`` writes its record at completion: its TTL counts
    from the transaction's start (the claim) unless the view took more than a tenth
    of it (here 1.2 s of 10), and the function returns what the record has left."""
    ttl, key = 10.0, secrets.token_bytes(32)
    cur.execute("BEGIN")
    if view_seconds:
        cur.execute("SELECT pg_sleep(%s)", (view_seconds,))
    cur.execute(
        STATEMENTS.insert_completed.removesuffix(";\nCOMMIT"),
        (key, b"fp", ttl, *ANSWER),
    )
    [remaining] = cur.fetchone()
    cur.execute("COMMIT")
    [(from_claim, from_completion)] = sql(
        clean_db,
        "SELECT extract(epoch FROM expires_at - created_at)::float8,"
        " extract(epoch FROM expires_at - completed_at)::float8 FROM idempotency_records",
    )
    if lives_from == "claim":
        assert from_claim == pytest.approx(ttl)
    else:
        assert from_completion == pytest.approx(0.9 * ttl)
    assert remaining == pytest.approx(from_completion, abs=0.01)
