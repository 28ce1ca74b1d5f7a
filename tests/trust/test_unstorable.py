"""An answer the store cannot hold is the extension's ``500 response_not_storable``
(contract sections 1 and 7), not the outage's ``503``.

A header echoing a client's value with a NUL or a lone surrogate (both arrive in
a JSON string as ``\\u0000`` / ``\\ud800``) cannot go into PostgreSQL's
``jsonb``: it was answered ``503`` with ``Retry-After: 1`` on every retry, so a
client could raise false "store down" alarms at will. Now nothing of the attempt
is kept (no record, none of the view's writes), no ``Retry-After``, and the
store's breaker never hears of it.
"""

from __future__ import annotations

import pytest

from flask_idempotency import responses
from support.pg_query import query
from support.servers import GunicornFactory, http_request

from .conftest import MakeTrustApp


def counts(database_url: str) -> tuple[int, int, int]:
    """Records, business rows kept, and attempts the view made."""
    ((records, rows, attempts),) = query(
        database_url,
        "SELECT (SELECT count(*) FROM idempotency_records),"
        " (SELECT count(*) FROM trust_rows), (SELECT count(*) FROM trust_attempts)",
    )
    return records, rows, attempts


@pytest.mark.parametrize("echo", ["a\x00b", "a\ud800b"], ids=["nul", "lone-surrogate"])
def test_an_unstorable_answer_is_500_under_gunicorn(
    gunicorn_server: GunicornFactory, clean_db: str, echo: str
) -> None:
    server = gunicorn_server("trust.trust_app:create_app()", env={"DATABASE_URL": clean_db})
    for attempt in (1, 2):
        answer = http_request(
            "POST", server.url + "/echo", {"Idempotency-Key": "echo-1"}, json={"echo": echo}
        )
        assert answer.status == 500, answer
        assert answer.json()["error"]["code"] == "response_not_storable"
        assert answer.headers["Retry-After"] is None
        assert answer.headers["Idempotent-Replayed"] is None
        # Nothing kept: the retry runs the view again, and fails the same way.
        assert counts(clean_db) == (0, 0, attempt)
    ok = http_request(
        "POST", server.url + "/echo", {"Idempotency-Key": "echo-1"}, json={"echo": "fine"}
    )
    assert ok.status == 201 and ok.headers["X-Echo"] == "fine"
    assert counts(clean_db) == (1, 1, 3)


def test_the_stores_own_refusal_gives_the_same_answer(
    make_trust_app: MakeTrustApp, clean_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the check before the completion out of the way, PostgreSQL itself
    refuses the header (SQLSTATE class 22): mapped to the same answer, the view's
    transaction rolled back, the claim released."""
    monkeypatch.setattr(responses, "storable", lambda stored: True)
    app = make_trust_app()
    # More refusals than the store breaker's threshold (3): an answer, not an outage.
    for attempt in range(1, 5):
        answer = app.test_client().post(
            "/echo", json={"echo": "a\x00b"}, headers={"Idempotency-Key": "echo-2"}
        )
        assert answer.status_code == 500
        assert answer.get_json()["error"]["code"] == "response_not_storable"
        assert "Retry-After" not in answer.headers
        assert answer.headers["Stripe-Should-Retry"] == "false"
        assert counts(clean_db) == (0, 0, attempt)
    ok = app.test_client().post("/echo", json={"echo": "ok"}, headers={"Idempotency-Key": "e3"})
    assert ok.status_code == 201
