"""One principal, one scope (CONTRACT §1): records never cross principals, and a
request whose principal cannot be determined is refused, never pooled.

Real PostgreSQL through Flask's test client, on the core test app
(support/core_app.py). Its ``app.test_client()`` sends an API key by default;
the requests below without one use a plain ``FlaskClient``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import psycopg2
import pytest
from flask import Flask, request, session
from flask.testing import FlaskClient
from werkzeug.test import TestResponse

from flask_idempotency import (
    Idempotency,
    ScopeUnavailable,
    authorization_scope,
    default_scope,
    digests,
    global_scope,
    keys,
    user_scope,
)
from flask_idempotency.scopes import authorization_digest

MakeApp = Callable[..., Flask]

pytestmark = pytest.mark.each_store

BODY = {"amount": 1500, "currency": "eur"}


def anonymous_client(app: Flask) -> FlaskClient:
    """A client that sends no credentials (a cookie session at most)."""
    return FlaskClient(app, app.response_class, use_cookies=True)


def post(
    client: FlaskClient,
    key: str = "key-1",
    path: str = "/charges",
    headers: dict[str, str] | None = None,
) -> TestResponse:
    return client.post(path, json=BODY, headers={"Idempotency-Key": key, **(headers or {})})


def records(database_url: str) -> list[tuple[Any, ...]]:
    with psycopg2.connect(database_url) as conn, conn.cursor() as cur:
        cur.execute("SELECT record_key, state FROM idempotency_records")
        rows = cur.fetchall()
    conn.close()
    return rows


def runs(app: Flask) -> list[str]:
    result: list[str] = app.extensions["runs"]
    return result


#: Cookie sessions for the core app, whose view sets a cookie named "session" itself.
SESSIONS = {"SECRET_KEY": "test", "SESSION_COOKIE_NAME": "app_session"}


def log_in(client: FlaskClient, **values: Any) -> FlaskClient:
    with client.session_transaction() as sess:
        sess.update(values)
    return client


def session_user() -> Any:
    """The app's own notion of the logged-in user: its signed cookie session."""
    return session.get("uid")


# --- two principals, one key ------------------------------------------------------


def test_two_cookie_session_users_with_the_same_key_and_body_get_independent_records(
    make_app: MakeApp,
) -> None:
    app = make_app(**SESSIONS, IDEMPOTENCY_SCOPE_FUNC=user_scope(session_user))
    alice = log_in(anonymous_client(app), uid="alice")
    bob = log_in(anonymous_client(app), uid="bob")

    first_alice = post(alice)
    first_bob = post(bob)
    assert first_alice.status_code == first_bob.status_code == 201
    assert first_bob.headers["Idempotent-Replayed"] == "false"
    assert first_bob.get_json()["row"] != first_alice.get_json()["row"]
    assert runs(app) == ["charges", "charges"]

    # Each one's retry replays their own answer, never the other's.
    again_alice, again_bob = post(alice), post(bob)
    assert again_alice.headers["Idempotent-Replayed"] == "true"
    assert again_alice.data == first_alice.data
    assert again_bob.headers["Idempotent-Replayed"] == "true"
    assert again_bob.data == first_bob.data
    assert runs(app) == ["charges", "charges"]


def test_the_same_key_under_two_api_keys_never_shares_an_answer(make_app: MakeApp) -> None:
    app = make_app()
    client = anonymous_client(app)
    a = post(client, headers={"Authorization": "Bearer sk_a"})
    b = post(client, headers={"Authorization": "Bearer sk_b"})
    assert a.headers["Idempotent-Replayed"] == b.headers["Idempotent-Replayed"] == "false"
    assert a.get_json()["row"] != b.get_json()["row"]


# --- no principal -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "headers"),
    [
        ("/charges", {}),
        ("/optional", {}),
        ("/charges", {"Authorization": ""}),
    ],
)
def test_a_request_without_principal_is_refused_and_claims_nothing(
    make_app: MakeApp, clean_db: str, path: str, headers: dict[str, str]
) -> None:
    app = make_app()
    response = post(anonymous_client(app), path=path, headers=headers)
    assert response.status_code == 400
    error = response.get_json()["error"]
    assert error["type"] == "idempotency_error"
    assert error["code"] == "missing_scope"
    assert "IDEMPOTENCY_SCOPE_FUNC" in error["message"]
    assert "Idempotent-Replayed" not in response.headers
    assert runs(app) == []
    assert records(clean_db) == []
    metrics = app.extensions["idempotency"].metrics.snapshot()
    assert metrics["executed"] == 0


def test_the_refusal_comes_after_the_key_check_and_not_on_keyless_optional_calls(
    make_app: MakeApp,
) -> None:
    app = make_app()
    client = anonymous_client(app)
    missing = client.post("/charges", json=BODY)
    assert missing.get_json()["error"]["code"] == "missing_key"
    invalid = post(client, key="bad key")
    assert invalid.get_json()["error"]["code"] == "invalid_key"
    # Without a key an optional route is not idempotent at all: it needs no scope.
    assert client.post("/optional", json=BODY).status_code == 201


def test_a_cookie_session_without_any_scope_function_is_never_pooled(
    make_app: MakeApp, clean_db: str
) -> None:
    """The bug this replaces: two cookie users shared the empty scope, so the
    second was replayed the first's answer."""
    app = make_app(**SESSIONS)
    alice = log_in(anonymous_client(app), uid="alice")
    bob = log_in(anonymous_client(app), uid="bob")
    assert post(alice).status_code == 400
    replayed = post(bob)
    assert replayed.status_code == 400
    assert replayed.get_json()["error"]["code"] == "missing_scope"
    assert records(clean_db) == []


def test_an_explicit_global_scope_accepts_requests_without_principal(
    make_app: MakeApp, clean_db: str
) -> None:
    app = make_app(IDEMPOTENCY_SCOPE_FUNC=global_scope)
    client = anonymous_client(app)
    first = post(client)
    assert first.status_code == 201
    again = post(client)
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.data == first.data
    assert runs(app) == ["charges"]
    # The empty scope requests without Authorization had before: records stored
    # by a single-principal app before it opted in still replay.
    [(record_key, state)] = records(clean_db)
    assert bytes(record_key) == digests.record_key("", "key-1")
    assert state == "completed"


def test_a_scope_function_returning_a_non_string_is_an_error_before_any_claim(
    make_app: MakeApp, clean_db: str
) -> None:
    app = make_app(IDEMPOTENCY_SCOPE_FUNC=lambda req: 42)
    response = post(app.test_client())
    assert response.status_code == 500
    assert runs(app) == []
    assert records(clean_db) == []

    def returns_bytes(req: Any) -> Any:
        return b"scope"

    with app.test_request_context(), pytest.raises(TypeError, match="must return a str"):
        keys.resolve_scope(returns_bytes, request)


def test_a_route_scope_function_overrides_the_app_one(make_app: MakeApp) -> None:
    app = make_app()
    idem: Idempotency = app.extensions["idem"]

    @app.post("/tenant")
    @idem.required(scope_func=lambda req: req.headers.get("X-Tenant"))
    def tenant() -> tuple[str, int]:
        return "ok", 201

    client = anonymous_client(app)
    # The app's (default) scope refuses a client without credentials...
    assert post(client).get_json()["error"]["code"] == "missing_scope"
    # ...and a route's own scope function decides for that route.
    assert post(client, path="/tenant", headers={"X-Tenant": "t1"}).status_code == 201
    again = post(client, path="/tenant", headers={"X-Tenant": "t1"})
    assert again.headers["Idempotent-Replayed"] == "true"
    assert post(client, path="/tenant").get_json()["error"]["code"] == "missing_scope"


# --- token rotation ---------------------------------------------------------------

#: Two generations of one user's bearer token (an OAuth refresh in between).
TOKENS = {"Bearer token-v1": 42, "Bearer token-v2": 42, "Bearer other": 7}


def user_behind_token() -> int | None:
    return TOKENS.get(request.headers.get("Authorization", ""))


def test_a_retry_after_a_token_refresh_replays_under_a_user_scope(make_app: MakeApp) -> None:
    app = make_app(IDEMPOTENCY_SCOPE_FUNC=user_scope(user_behind_token))
    client = anonymous_client(app)
    first = post(client, headers={"Authorization": "Bearer token-v1"})
    assert first.status_code == 201
    retry = post(client, headers={"Authorization": "Bearer token-v2"})
    assert retry.headers["Idempotent-Replayed"] == "true"
    assert retry.data == first.data
    assert runs(app) == ["charges"]
    other = post(client, headers={"Authorization": "Bearer other"})
    assert other.headers["Idempotent-Replayed"] == "false"
    unknown = post(client, headers={"Authorization": "Bearer unknown"})
    assert unknown.get_json()["error"]["code"] == "missing_scope"


# --- flask-login --------------------------------------------------------------------


def login_app(make_app: MakeApp, **config: Any) -> Flask:
    flask_login = pytest.importorskip("flask_login")
    user_mixin: Any = flask_login.UserMixin

    class User(user_mixin):  # type: ignore[misc]
        def __init__(self, user_id: str) -> None:
            self.id = user_id

    app = make_app(**SESSIONS, **config)
    manager = flask_login.LoginManager(app)
    manager.user_loader(lambda user_id: User(user_id) if user_id != "gone" else None)
    return app


def logged_in(app: Flask, user_id: str) -> FlaskClient:
    # flask-login keeps the user id in the session under "_user_id".
    return log_in(anonymous_client(app), _user_id=user_id, _fresh=True)


def test_flask_login_users_are_scoped_by_user_id_by_default(
    make_app: MakeApp, clean_db: str
) -> None:
    app = login_app(make_app)
    alice, bob = logged_in(app, "alice"), logged_in(app, "bob")
    a, b = post(alice), post(bob)
    assert a.headers["Idempotent-Replayed"] == b.headers["Idempotent-Replayed"] == "false"
    assert a.get_json()["row"] != b.get_json()["row"]
    assert post(alice).data == a.data and post(bob).data == b.data
    assert runs(app) == ["charges", "charges"]
    assert {bytes(k) for k, _ in records(clean_db)} == {
        digests.record_key("user:alice", "key-1"),
        digests.record_key("user:bob", "key-1"),
    }
    # The user comes first: a new Authorization value (a refreshed token) of the
    # same logged-in user replays.
    rotated = post(alice, headers={"Authorization": "Bearer refreshed"})
    assert rotated.headers["Idempotent-Replayed"] == "true"
    # Anonymous, or a session whose user is gone: no principal.
    assert post(anonymous_client(app)).get_json()["error"]["code"] == "missing_scope"
    assert post(logged_in(app, "gone")).get_json()["error"]["code"] == "missing_scope"
    # Without a user, an Authorization header still scopes as it always did.
    with_key = post(anonymous_client(app), headers={"Authorization": "Bearer sk_1"})
    assert with_key.status_code == 201


# --- the scope functions themselves -------------------------------------------------


def scope_of(func: Callable[[Any], str | None], **headers: str) -> str | None:
    app = Flask(__name__)
    with app.test_request_context(headers=headers):
        return func(request)


def test_default_scope_keeps_the_authorization_digest_of_deployed_records() -> None:
    expected = hashlib.sha256(b"Bearer sk_live_1").hexdigest()
    assert scope_of(default_scope, Authorization="Bearer sk_live_1") == expected
    assert scope_of(authorization_scope, Authorization="Bearer sk_live_1") == expected
    assert authorization_digest("Bearer sk_live_1") == expected
    assert scope_of(default_scope) is None
    assert scope_of(default_scope, Authorization="") is None
    assert scope_of(authorization_scope) is None
    assert scope_of(global_scope) == ""


def test_user_scope_prefixes_the_id_and_treats_none_and_empty_as_no_principal() -> None:
    assert scope_of(user_scope(lambda: 42)) == "user:42"
    assert scope_of(user_scope(lambda: "u_1")) == "user:u_1"
    assert scope_of(user_scope(lambda: None)) is None
    assert scope_of(user_scope(lambda: "")) is None


def test_resolve_scope_refuses_none_and_passes_strings_through() -> None:
    app = Flask(__name__)
    with app.test_request_context():
        assert keys.resolve_scope(lambda req: "tenant:1", request) == "tenant:1"
        assert keys.resolve_scope(global_scope, request) == ""
        with pytest.raises(ScopeUnavailable) as refused:
            keys.resolve_scope(default_scope, request)
    assert refused.value.code == 400
    assert refused.value.error_code == "missing_scope"
