"""A replay carries the answer's headers, not the request's (contract sections 1 and 7).

Two browser origins are allowed, and the app's CORS layer is set up after the
extension (its ``after_request`` runs first, and leaves alone a response that
already carries ``Access-Control-Allow-Origin``, as flask-cors does). A retry
from the second origin got the first one's header, which the browser rejects.
CORS's headers (the default of ``IDEMPOTENCY_NOT_REPLAYED_HEADERS``) are now
neither stored nor replayed, so the layer adds this request's; ``Set-Cookie``
never, whatever the store holds.
"""

from __future__ import annotations

import json

import pytest
from flask import Flask
from werkzeug.test import TestResponse

from flask_idempotency.responses import replay
from flask_idempotency.store.base import StoredResponse
from support.pg_query import query

from .conftest import MakeTrustApp
from .trust_app import ALLOWED_ORIGINS

ONE, TWO = ALLOWED_ORIGINS


def charge(app: Flask, origin: str, key: str = "cors-1", request_id: str = "r1") -> TestResponse:
    return app.test_client().post(
        "/cors",
        json={"amount": 1500},
        headers={"Idempotency-Key": key, "Origin": origin, "X-Request-Id": request_id},
    )


def stored_headers(database_url: str) -> list[list[str]]:
    ((headers,),) = query(database_url, "SELECT headers FROM idempotency_records")
    return [list(pair) for pair in headers]


def test_a_retry_from_another_origin_gets_its_own_cors_headers(
    make_trust_app: MakeTrustApp, clean_db: str
) -> None:
    app = make_trust_app()
    first = charge(app, ONE)
    assert first.status_code == 201
    assert first.headers["Access-Control-Allow-Origin"] == ONE
    assert first.headers["Set-Cookie"].startswith("session=")
    names = {name.lower() for name, _ in stored_headers(clean_db)}
    assert not any(name.startswith("access-control-") for name in names), names
    assert "set-cookie" not in names

    retry = charge(app, TWO)
    assert retry.headers["Idempotent-Replayed"] == "true"
    assert retry.headers.getlist("Access-Control-Allow-Origin") == [TWO]
    assert retry.headers["Access-Control-Allow-Credentials"] == "true"
    assert "Set-Cookie" not in retry.headers
    assert retry.get_json() == {"charged": True}
    assert retry.headers["X-Request-Id"] == "r1"  # the answer's own headers come back
    assert query(clean_db, "SELECT count(*) FROM trust_attempts") == [(1,)]


def test_a_stored_cors_header_is_not_replayed(make_trust_app: MakeTrustApp, clean_db: str) -> None:
    """A record written before the header was dropped (by 0.2.x, which stored it)
    replays without it: the filter runs on the way out too."""
    app = make_trust_app()
    assert charge(app, ONE).status_code == 201
    planted = [*stored_headers(clean_db), ["Access-Control-Allow-Origin", ONE]]
    planted.append(["Set-Cookie", "session=planted"])
    query(clean_db, "UPDATE idempotency_records SET headers = %s::jsonb", (json.dumps(planted),))
    retry = charge(app, TWO)
    assert retry.headers["Idempotent-Replayed"] == "true"
    assert retry.headers.getlist("Access-Control-Allow-Origin") == [TWO]
    assert "Set-Cookie" not in retry.headers


def test_the_list_is_configurable(make_trust_app: MakeTrustApp, clean_db: str) -> None:
    """Here the request id is the request's, and CORS's headers left to be stored."""
    app = make_trust_app(IDEMPOTENCY_NOT_REPLAYED_HEADERS=["x-request-ID"])
    assert charge(app, ONE).status_code == 201
    names = {name for name, _ in stored_headers(clean_db)}
    assert "X-Request-Id" not in names
    assert "Access-Control-Allow-Origin" in names
    retry = charge(app, ONE, request_id="r2")
    assert retry.headers["Idempotent-Replayed"] == "true"
    assert retry.headers.getlist("X-Request-Id") == []


@pytest.mark.parametrize("value", ["", "*", "Access-*-Origin", "X Y", 42])
def test_a_bad_header_pattern_fails_at_start(make_trust_app: MakeTrustApp, value: object) -> None:
    with pytest.raises(ValueError, match="IDEMPOTENCY_NOT_REPLAYED_HEADERS"):
        make_trust_app(IDEMPOTENCY_NOT_REPLAYED_HEADERS=[value])


def test_a_replay_drops_what_no_answer_may_carry() -> None:
    """Whatever the store or the cache hands over: cookies, hop-by-hop headers, a
    length of its own; the marker of an omitted body stays."""
    stored = StoredResponse(
        201,
        (
            ("Set-Cookie", "session=x"),
            ("Transfer-Encoding", "chunked"),
            ("Content-Length", "999"),
            ("access-control-allow-origin", ONE),
            ("Idempotency-Body-Omitted", "true"),
            ("Location", "/charges/1"),
        ),
        b"{}",
    )
    answer = replay(stored, not_replayed=("Access-Control-*",))
    assert sorted(answer.headers.keys()) == sorted(
        ["Content-Length", "Content-Type", "Idempotency-Body-Omitted", "Location"]
        + ["Idempotent-Replayed"]
    )
    assert answer.headers["Content-Length"] == "2"


def test_a_replay_from_redis_gets_fresh_cors_headers(
    make_trust_app: MakeTrustApp, clean_db: str, clean_redis: str
) -> None:
    app = make_trust_app(
        SECRET_KEY="trust-tests",
        IDEMPOTENCY_REDIS_URL=clean_redis,
        IDEMPOTENCY_REDIS_OPTIONS={"fill": "completion"},
    )
    assert charge(app, ONE).headers["Access-Control-Allow-Origin"] == ONE
    # Gone from PostgreSQL: a replay now can only come from Redis.
    query(clean_db, "DELETE FROM idempotency_records")
    retry = charge(app, TWO)
    assert retry.headers["Idempotent-Replayed"] == "true"
    assert retry.headers.getlist("Access-Control-Allow-Origin") == [TWO]
    assert "Set-Cookie" not in retry.headers


def test_a_replay_from_redis_follows_the_configured_list_too(
    make_trust_app: MakeTrustApp, clean_db: str, clean_redis: str
) -> None:
    """The same headers come back whether PostgreSQL or Redis answers: with
    CORS's headers left to be stored, a Redis replay carries them as a PostgreSQL
    one does, and drops the configured request id."""
    app = make_trust_app(
        SECRET_KEY="trust-tests",
        IDEMPOTENCY_REDIS_URL=clean_redis,
        IDEMPOTENCY_REDIS_OPTIONS={"fill": "completion"},
        IDEMPOTENCY_NOT_REPLAYED_HEADERS=["x-request-ID"],
    )
    assert charge(app, ONE).status_code == 201
    from_postgres = charge(app, TWO, request_id="r2")  # (Redis is filled on completion)
    query(clean_db, "DELETE FROM idempotency_records")
    from_redis = charge(app, TWO, request_id="r3")
    for retry in (from_postgres, from_redis):
        assert retry.headers["Idempotent-Replayed"] == "true"
        assert retry.headers.getlist("X-Request-Id") == []
        # Stored with the answer, so replayed (the CORS layer leaves it alone).
        assert retry.headers.getlist("Access-Control-Allow-Origin") == [ONE]
