"""Two claimers taking over the same expired record at the same instant.

Both read the expired row in their snapshot; one wins the takeover's ``UPDATE``
(migration 0012; ``ON CONFLICT DO UPDATE`` before), the other's update no longer
applies. The loser must then see the winner's live claim (a 409), never the
stale read: replaying the expired answer, or a 422 against the expired record's
fingerprint, would be wrong.
The race is made deterministic by holding the row lock in a third session
until both claimers wait on it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import psycopg2
import pytest
from flask import Flask

from flask_idempotency import flow
from flask_idempotency.store.base import Claimed, ClaimResult, Existing
from support.waiting import wait_until

MakeApp = Callable[..., Flask]
RECORD = b"r" * 32
NEW_REQUEST = b"fingerprint of the retried request"


def _insert_expired_completed(database_url: str, fingerprint: bytes) -> None:
    with psycopg2.connect(database_url) as conn, conn.cursor() as cur:
        cur.execute(
            "INSERT INTO idempotency_records (record_key, fingerprint, state, created_at,"
            " expires_at, completed_at, status_code, headers, body)"
            " VALUES (%s, %s, 'completed', now() - interval '2 days',"
            " now() - interval '1 day', now() - interval '2 days', 201, '[]', 'old answer')",
            (RECORD, fingerprint),
        )
    conn.close()


def _wait_for_lock_waiters(database_url: str, count: int) -> None:
    conn = psycopg2.connect(database_url)
    conn.autocommit = True

    def queued() -> bool:
        with conn.cursor() as cur:
            cur.execute(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE wait_event_type = 'Lock' AND datname = current_database()"
            )
            row = cur.fetchone()
        return row is not None and row[0] >= count

    try:
        wait_until(queued, 10, f"{count} claimers to queue on the row lock")
    finally:
        conn.close()


@pytest.mark.parametrize(
    "old_fingerprint",
    [NEW_REQUEST, b"fingerprint of the expired record's request"],
    ids=["same-request-as-expired", "other-request-than-expired"],
)
def test_the_loser_of_a_simultaneous_takeover_gets_409(
    make_app: MakeApp, database_url: str, old_fingerprint: bytes
) -> None:
    app = make_app()
    store = app.extensions["idempotency"].store
    _insert_expired_completed(database_url, old_fingerprint)

    locker = psycopg2.connect(database_url)
    with locker.cursor() as cur:  # holds the row lock until committed
        cur.execute("SELECT 1 FROM idempotency_records WHERE record_key = %s FOR UPDATE", (RECORD,))

    results: list[ClaimResult] = []
    requests = [store.begin() for _ in range(2)]

    def claim(index: int) -> None:
        results.append(requests[index].claim(RECORD, NEW_REQUEST, lease=30, ttl=3600))

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    try:
        _wait_for_lock_waiters(database_url, 2)
    finally:
        locker.commit()
        locker.close()
    for thread in threads:
        thread.join(10)
    for request in requests:
        request.close()

    assert len(results) == 2
    winners = [r for r in results if isinstance(r, Claimed)]
    losers = [r for r in results if isinstance(r, Existing)]
    assert len(winners) == 1 and len(losers) == 1, results
    decision = flow.decide(losers[0], NEW_REQUEST)
    assert decision is flow.Rejection.IN_PROGRESS, losers[0]
    assert losers[0].state == "processing"


def test_a_new_key_inserted_between_the_claims_read_and_its_insert_is_read_again(
    make_app: MakeApp, database_url: str
) -> None:
    """Row mode's claim reads the key, and inserts it without ``ON CONFLICT`` when it
    is absent (migration 0012). Another claimer's insert, committed after that read,
    makes the INSERT fail with ``unique_violation``: the claim is asked again and
    sees the other's live claim (a 409), never a 503."""
    app = make_app()
    store = app.extensions["idempotency"].store
    other = psycopg2.connect(database_url)
    with other.cursor() as cur:  # inserted, not yet committed: invisible to the read
        cur.execute(
            "INSERT INTO idempotency_records (record_key, fingerprint, state, lock_token,"
            " lease_expires_at, expires_at) VALUES (%s, %s, 'processing', 1,"
            " now() + interval '30 seconds', now() + interval '1 hour')",
            (RECORD, NEW_REQUEST),
        )
    results: list[ClaimResult] = []
    request = store.begin()
    thread = threading.Thread(
        target=lambda: results.append(request.claim(RECORD, NEW_REQUEST, lease=30, ttl=3600))
    )
    thread.start()
    try:
        _wait_for_lock_waiters(database_url, 1)  # its INSERT waits on the other's
    finally:
        other.commit()
        other.close()
    thread.join(10)
    request.close()
    [result] = results
    assert isinstance(result, Existing), result
    assert flow.decide(result, NEW_REQUEST) is flow.Rejection.IN_PROGRESS
