"""A record's clock, moved and watched in SQL: tests that name the clock instead of
waiting it out.

A lease or a TTL is a timestamp on the record. A test about what happens once
one has passed moves that timestamp back (``end_leases``); a test about the
keeper moving it forward watches it move (``wait_for_renewal``). Neither sleeps
for the length of a lease, so neither is slow on a quiet machine or flaky on a
busy one.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import psycopg2

from .waiting import wait_until


def _run(database_url: str, statement: str, params: Any = None) -> list[tuple[Any, ...]]:
    conn = psycopg2.connect(database_url, connect_timeout=5)
    try:
        with conn, conn.cursor() as cur:
            cur.execute(statement, params)
            return cur.fetchall() if cur.description else []
    finally:
        conn.close()


def end_leases(database_url: str, seconds_ago: float = 1.0, record_key: bytes | None = None) -> int:
    """End every processing record's lease (or only ``record_key``'s) ``seconds_ago``,
    as time does for a holder that stopped renewing (a dead worker, a keeper turned
    off). How many records."""
    rows = _run(
        database_url,
        "UPDATE idempotency_records SET lease_expires_at = now() - make_interval(secs => %s)"
        " WHERE state = 'processing' AND (%s::bytea IS NULL OR record_key = %s::bytea)"
        " RETURNING 1",
        (seconds_ago, record_key, record_key),
    )
    return len(rows)


def leases(database_url: str) -> dict[bytes, datetime]:
    """Each processing record's lease end, by record key."""
    rows = _run(
        database_url,
        "SELECT record_key, lease_expires_at FROM idempotency_records WHERE state = 'processing'",
    )
    return {bytes(key): expires for key, expires in rows}


def wait_for_renewal(database_url: str, timeout: float = 10.0) -> None:
    """Until the lease keeper has renewed every processing record's lease since the
    call (each ``lease_expires_at`` later than it was): proof of a renewal, instead
    of sleeping past the first lease. A record that completes or goes meanwhile
    was not renewed, and times out."""
    before = leases(database_url)
    assert before, "no processing record whose lease could be renewed"

    def renewed() -> bool:
        now = leases(database_url)
        return all(key in now and now[key] > then for key, then in before.items())

    wait_until(renewed, timeout, "the lease keeper to renew the lease")
