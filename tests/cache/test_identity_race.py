"""The database's identity, read while another process makes it (after a TRUNCATE).

Its read inserts the row when it is gone; a second process doing the same at once
waits on the first's insert and then finds, in its statement's snapshot, no row.
It must read again rather than leave its Redis cache off for ``IDENTITY_RETRY``
seconds (a replay answered from PostgreSQL instead of the cache: seen as a flaky
count in tests/observability/test_metrics_gunicorn.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import psycopg2
from flask import Flask

from flask_idempotency.store.identity import database_identity
from support.pg_query import query
from support.waiting import wait_until


def test_a_read_racing_the_row_being_made_sees_it(
    make_app: Callable[..., Flask], clean_db: str
) -> None:
    app = make_app()
    store = app.extensions["idempotency"].store
    made = bytes(range(16))
    other = psycopg2.connect(clean_db)
    try:
        with other.cursor() as cur:  # another process, its insert not yet committed
            cur.execute("DELETE FROM idempotency_deployment")
            other.commit()
            cur.execute("INSERT INTO idempotency_deployment (id) VALUES (%s)", (made,))
        read: list[Any] = []
        reader = threading.Thread(target=lambda: read.append(_identity_or_error(store)))
        reader.start()
        _wait_for_a_lock_wait(clean_db)  # our read's insert waits on the other's row
        other.commit()
        reader.join(30)
    finally:
        other.close()
    assert read == [made]


def _identity_or_error(store: Any) -> bytes | Exception:
    try:
        return database_identity(store)
    except Exception as error:
        return error


def _wait_for_a_lock_wait(database_url: str) -> None:
    waiting = (
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
        " AND datname = current_database() AND query LIKE '%idempotency_deployment%'"
    )
    wait_until(
        lambda: query(database_url, waiting)[0][0] > 0,
        20,
        "the identity read to wait on the other insert",
    )
