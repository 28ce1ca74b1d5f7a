"""HTTP requests, event consumers and Celery tasks are separate key namespaces
(contract section 7).

A consumer's (and a Celery task's) records live under the scope
``consumer:<name>``, and an HTTP scope function could return that very string
(a tenant or login a user chose): its request then pre-claimed the message's
key, and the real event was dead-lettered as ``key_reused``. An HTTP scope in
that namespace is now refused (``400 missing_scope``, nothing claimed), which
leaves every record key and derived key as it was (``tests/upgrade/test_keys.py``).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from flask import Flask, Request, jsonify

from flask_idempotency import Idempotency
from flask_idempotency.events import ConsumerOutcome, Delivery
from support.pg_query import query

from .conftest import MakeTrustApp

ORDER_ID = "order_1001"


def tenant_from_header(request: Request) -> str | None:
    """A scope a client names itself (a tenant slug it registered)."""
    return request.headers.get("X-Tenant")


def _app_with_consumer(make_trust_app: MakeTrustApp) -> tuple[Flask, Any, list[str]]:
    app = make_trust_app()
    idem: Idempotency = app.extensions["idem"]
    runs: list[str] = []

    @app.post("/orders")
    @idem.required(scope_func=tenant_from_header)
    def orders() -> Any:
        return jsonify(ok=True), 201

    @idem.consumer("receipts", key=lambda d: d.payload["order"])
    def receipts(delivery: Delivery) -> None:
        runs.append(str(delivery.payload["order"]))

    return app, receipts, runs


@pytest.mark.parametrize("scope", ["consumer:receipts", "consumer:", "consumer:tasks.charge"])
def test_an_http_scope_cannot_claim_a_consumers_key(
    make_trust_app: MakeTrustApp, scope: str
) -> None:
    app, receipts, runs = _app_with_consumer(make_trust_app)
    dsn = app.config["IDEMPOTENCY_DATABASE_URL"]
    answer = app.test_client().post(
        "/orders", json={}, headers={"Idempotency-Key": ORDER_ID, "X-Tenant": scope}
    )
    assert answer.status_code == 400, answer.get_data()
    assert json.loads(answer.get_data())["error"]["code"] == "missing_scope"
    assert "Idempotent-Replayed" not in answer.headers
    assert query(dsn, "SELECT count(*) FROM idempotency_records") == [(0,)]

    event = Delivery.from_body({"order": ORDER_ID}, message_id="evt_1")
    result = receipts.handle(event, app=app)
    assert result.outcome is ConsumerOutcome.HANDLED, result
    assert runs == [ORDER_ID]


def test_other_scopes_are_unchanged(make_trust_app: MakeTrustApp) -> None:
    """A scope that merely mentions a consumer is an ordinary principal."""
    app, receipts, runs = _app_with_consumer(make_trust_app)
    client = app.test_client()
    for scope in ("Consumer:receipts", "consumers:receipts", "tenant consumer:receipts"):
        answer = client.post(
            "/orders", json={}, headers={"Idempotency-Key": ORDER_ID, "X-Tenant": scope}
        )
        assert answer.status_code == 201, (scope, answer.get_data())
    event = Delivery.from_body({"order": ORDER_ID}, message_id="evt_1")
    assert receipts.handle(event, app=app).outcome is ConsumerOutcome.HANDLED
    assert runs == [ORDER_ID]
