"""``purpose_key``: a claimed request's key for one downstream call, the same in
every attempt at the record, and refused when one attempt names a purpose twice."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest
from flask import Flask, jsonify

from flask_idempotency import Idempotency
from flask_idempotency.client import IdempotentSession, IdempotentTransport, purpose_key


@pytest.fixture
def app(make_app: Callable[..., Flask]) -> Flask:
    app = make_app()
    idempotency: Idempotency = app.extensions["idem"]
    seen: list[dict[str, Any]] = []
    app.extensions["purpose_keys"] = seen

    @app.post("/downstream/<int:status>")
    @idempotency.required
    def downstream(status: int) -> Any:
        keys = {"processor": purpose_key("processor"), "notify": purpose_key("notify")}
        try:
            purpose_key("processor")
        except ValueError as refused:
            keys["again"] = str(refused)
        keys["derived"] = idempotency.derived_key("processor")
        seen.append(keys)
        return jsonify(keys), status

    return app


def test_one_key_per_purpose_kept_across_attempts(app: Flask) -> None:
    client = app.test_client()
    first = client.post("/downstream/502", headers={"Idempotency-Key": "k-1"})
    retry = client.post("/downstream/502", headers={"Idempotency-Key": "k-1"})
    other = client.post("/downstream/201", headers={"Idempotency-Key": "k-2"})
    assert (first.status_code, retry.status_code, other.status_code) == (502, 502, 201)
    attempt, again, elsewhere = app.extensions["purpose_keys"]
    # A 502 is not stored: the retry ran the view again and sent the same keys.
    assert attempt["processor"] == again["processor"] == attempt["derived"]
    assert attempt["notify"] == again["notify"] != attempt["processor"]
    assert elsewhere["processor"] != attempt["processor"]
    assert "'processor' already named a call" in attempt["again"]


def test_a_call_from_a_claimed_request_without_a_key_is_refused(
    make_app: Callable[..., Flask],
) -> None:
    """A key made up for it would be a new one in the view's next attempt: a second
    charge downstream. So the call is refused, naming ``purpose_key``."""
    app = make_app()
    idempotency: Idempotency = app.extensions["idem"]
    refused: list[str] = []

    @app.post("/calls-out")
    @idempotency.required
    def calls_out() -> Any:
        for client in ("requests", "httpx"):
            try:
                if client == "requests":
                    with IdempotentSession() as session:
                        session.post("http://127.0.0.1:9/never-sent")
                else:
                    with httpx.Client(transport=IdempotentTransport()) as http:
                        http.post("http://127.0.0.1:9/never-sent")
            except ValueError as error:
                refused.append(str(error))
        return jsonify(refused=len(refused)), 201

    answer = app.test_client().post("/calls-out", headers={"Idempotency-Key": "k-3"})
    assert answer.status_code == 201 and len(refused) == 2
    assert all("purpose_key" in message for message in refused)


def test_needs_a_claimed_request(app: Flask) -> None:
    with pytest.raises(RuntimeError, match="needs a running idempotent request"):
        with app.test_request_context("/"):
            purpose_key("processor")
