"""Leases, takeover and fencing: a holder whose lease expired cannot store its result.

On PostgreSQL and, where a test does not look into PostgreSQL, on memory:// too."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import psycopg2
import pytest
from flask import Flask
from werkzeug.test import TestResponse

from support.records import wait_for_renewal

from .conftest import Records

pytestmark = pytest.mark.each_store

MakeApp = Callable[..., Flask]
SAME_REQUEST = {"IDEMPOTENCY_FINGERPRINT_FUNC": lambda request: b"same request"}


def post(app: Flask, body: dict[str, Any], key: str = "k") -> TestResponse:
    return app.test_client().post("/charges", json=body, headers={"Idempotency-Key": key})


def execute(database_url: str, query: str) -> list[tuple[Any, ...]]:
    with psycopg2.connect(database_url) as conn, conn.cursor() as cur:
        cur.execute(query)
        rows = cur.fetchall() if cur.description else []
    conn.close()
    return rows


def expire_leases(database_url: str) -> None:
    execute(
        database_url,
        "UPDATE idempotency_records SET lease_expires_at = now() - interval '1 second'"
        " WHERE state = 'processing'",
    )


def start_holder(app: Flask, gate: str) -> tuple[threading.Thread, list[TestResponse]]:
    result: list[TestResponse] = []
    thread = threading.Thread(target=lambda: result.append(post(app, {"gate": gate})))
    thread.start()
    assert app.extensions["gates"].entered_event(gate).wait(10)
    return thread, result


def test_expired_lease_is_taken_over_and_the_old_holder_is_fenced(
    make_app: MakeApp, records: Records
) -> None:
    app = make_app(IDEMPOTENCY_LEASE_RENEW_INTERVAL=0, **SAME_REQUEST)
    thread, old = start_holder(app, "slow")
    assert post(app, {}).status_code == 409  # lease still valid
    records.expire_leases(app)

    new = post(app, {})  # the same request, arriving after the lease ran out
    assert new.status_code == 201
    assert new.headers["Idempotent-Replayed"] == "false"

    app.extensions["gates"].get("slow").set()
    thread.join(10)
    assert old[0].status_code == 409
    assert old[0].get_json()["error"]["code"] == "lease_lost"
    assert int(old[0].headers["Retry-After"]) >= 1

    # Only the new holder's writes and answer were kept.
    assert records.kept_writes(app) in (1, None)
    replay = post(app, {})
    assert replay.data == new.data
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert app.extensions["idempotency"].metrics.snapshot()["takeovers"] == 1
    assert records.count(app) == 1


def test_dead_holder_of_a_different_request_keeps_the_key_bound(
    make_app: MakeApp, records: Records
) -> None:
    app = make_app(IDEMPOTENCY_LEASE_RENEW_INTERVAL=0)
    thread, _ = start_holder(app, "slow")
    records.expire_leases(app)
    assert post(app, {"amount": 2}).status_code == 422
    app.extensions["gates"].get("slow").set()
    thread.join(10)


def test_keeper_renews_the_lease_of_a_slow_live_request(
    make_app: MakeApp, database_url: str
) -> None:
    app = make_app(IDEMPOTENCY_LEASE=1.0, IDEMPOTENCY_LEASE_RENEW_INTERVAL=0.2, **SAME_REQUEST)
    thread, first = start_holder(app, "slow")
    wait_for_renewal(database_url)  # instead of sleeping past the original lease
    duplicate = post(app, {})
    assert duplicate.status_code == 409
    assert duplicate.get_json()["error"]["code"] == "in_progress"
    [(remaining,)] = execute(
        database_url, "SELECT extract(epoch FROM lease_expires_at - now()) FROM idempotency_records"
    )
    assert float(remaining) > 0
    app.extensions["gates"].get("slow").set()
    thread.join(10)
    assert first[0].status_code == 201
    assert app.extensions["runs"] == ["charges"]


def test_in_progress_retry_after_never_exceeds_the_lease(make_app: MakeApp) -> None:
    app = make_app(IDEMPOTENCY_RETRY_AFTER=60, IDEMPOTENCY_LEASE=5, **SAME_REQUEST)
    thread, _ = start_holder(app, "slow")
    response = post(app, {})
    assert 1 <= int(response.headers["Retry-After"]) <= 5
    app.extensions["gates"].get("slow").set()
    thread.join(10)


def test_release_after_failure_lets_the_next_request_run(
    make_app: MakeApp, records: Records
) -> None:
    app = make_app()
    assert post(app, {"raise": True}).status_code == 500
    assert records.count(app) == 0
    assert post(app, {"raise": True}).status_code == 500
