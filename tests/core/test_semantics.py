"""One test per row of CONTRACT section 1, through Flask's test client, on real
PostgreSQL and (each test that does not look into PostgreSQL itself) on the
in-memory store too (``tests/core/conftest.py``)."""

from __future__ import annotations

import io
import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg2
import pytest
from flask import Flask
from werkzeug.test import TestResponse

from support.dead_store import make_unreachable

from .conftest import Records

MakeApp = Callable[..., Flask]

pytestmark = pytest.mark.each_store


def post(
    app: Flask,
    body: Any = None,
    *,
    key: str | None = "key-1",
    path: str = "/charges",
    method: str = "POST",
    headers: dict[str, str] | None = None,
    **kwargs: Any,
) -> TestResponse:
    all_headers = dict(headers or {})
    if key is not None:
        all_headers["Idempotency-Key"] = key
    client = app.test_client()
    return client.open(
        path, method=method, json=body if body is not None else {}, headers=all_headers, **kwargs
    )


def error_code(response: TestResponse) -> str:
    body = response.get_json()
    assert body["error"]["type"] == "idempotency_error"
    return str(body["error"]["code"])


def runs(app: Flask) -> list[str]:
    result: list[str] = app.extensions["runs"]
    return result


def sql(database_url: str, query: str, *params: Any) -> list[tuple[Any, ...]]:
    with psycopg2.connect(database_url) as conn, conn.cursor() as cur:
        cur.execute(query, params)
        rows = cur.fetchall() if cur.description else []
    conn.close()
    return rows


@contextmanager
def in_flight(app: Flask, body: dict[str, Any], **kwargs: Any) -> Iterator[list[TestResponse]]:
    """Run a request whose view pauses at ``body["gate"]`` until the block ends."""
    gates = app.extensions["gates"]
    result: list[TestResponse] = []
    thread = threading.Thread(target=lambda: result.append(post(app, body, **kwargs)))
    thread.start()
    assert gates.entered_event(body["gate"]).wait(10), "the first request never reached the view"
    try:
        yield result
    finally:
        gates.get(body["gate"]).set()
        thread.join(10)


def test_first_request_runs_once_and_is_marked_not_replayed(make_app: MakeApp) -> None:
    app = make_app()
    response = post(app, {"amount": 100})
    assert response.status_code == 201
    assert response.headers["Idempotent-Replayed"] == "false"
    assert runs(app) == ["charges"]


def test_retry_replays_status_body_and_headers_without_running(make_app: MakeApp) -> None:
    app = make_app()
    first = post(app, {"amount": 100})
    again = post(app, {"amount": 100})
    assert runs(app) == ["charges"]
    assert again.status_code == first.status_code == 201
    assert again.data == first.data
    assert again.headers["Idempotent-Replayed"] == "true"
    for name in ("Content-Type", "Location", "ETag", "X-Custom"):
        assert again.headers[name] == first.headers[name]
    assert "Set-Cookie" in first.headers
    assert "Set-Cookie" not in again.headers
    assert int(again.headers["Content-Length"]) == len(again.data)


def test_json_body_compares_canonically(make_app: MakeApp) -> None:
    app = make_app()
    post(app, {"a": 1, "b": [1, 2]})
    same = app.test_client().post(
        "/charges",
        data=b'{ "b" : [1,2],\n "a": 1 }',
        content_type="application/json",
        headers={"Idempotency-Key": "key-1"},
    )
    assert same.headers["Idempotent-Replayed"] == "true"
    assert runs(app) == ["charges"]


def test_integer_and_float_amounts_differ(make_app: MakeApp) -> None:
    app = make_app()
    post(app, {"amount": 1500})
    assert post(app, {"amount": 1500.0}).status_code == 422


@pytest.mark.parametrize(
    "change",
    [
        {"body": {"amount": 101}},
        {"method": "PUT"},
        {"path": "/other"},
        {"path": "/charges?x=1"},
    ],
)
def test_same_key_different_request_is_422(make_app: MakeApp, change: dict[str, Any]) -> None:
    app = make_app()
    post(app, {"amount": 100})
    kwargs = {"body": {"amount": 100}, **change}
    response = post(app, kwargs.pop("body"), **kwargs)
    assert response.status_code == 422
    assert error_code(response) == "key_reused"
    assert "Idempotent-Replayed" not in response.headers
    assert runs(app) == ["charges"]


def test_non_json_bodies_compare_as_bytes(make_app: MakeApp) -> None:
    app = make_app()
    client = app.test_client()
    headers = {"Idempotency-Key": "k", "Content-Type": "text/plain"}
    assert client.post("/plain", data=b"a b", headers=headers).status_code == 200
    assert client.post("/plain", data=b"a b", headers=headers).headers["Idempotent-Replayed"] == (
        "true"
    )
    assert client.post("/plain", data=b"a  b", headers=headers).status_code == 422


def test_duplicate_while_running_is_409_with_retry_after(make_app: MakeApp) -> None:
    app = make_app()
    with in_flight(app, {"gate": "g"}) as first:
        response = post(app, {"gate": "g"})
        assert response.status_code == 409
        assert error_code(response) == "in_progress"
        assert int(response.headers["Retry-After"]) >= 1
        assert "Idempotent-Replayed" not in response.headers
    assert first[0].status_code == 201
    assert runs(app) == ["charges"]


def test_different_request_while_running_is_422_not_409(make_app: MakeApp) -> None:
    app = make_app()
    with in_flight(app, {"gate": "g"}):
        response = post(app, {"gate": "other"})
        assert response.status_code == 422


def test_wait_mode_replays_the_first_answer(make_app: MakeApp) -> None:
    app = make_app()
    gates = app.extensions["gates"]
    result: list[TestResponse] = []
    with in_flight(app, {"gate": "w"}, path="/waiting"):
        waiter = threading.Thread(
            target=lambda: result.append(post(app, {"gate": "w"}, path="/waiting"))
        )
        waiter.start()
        gates.get("w").set()
        waiter.join(10)
    assert result[0].status_code == 201
    assert result[0].headers["Idempotent-Replayed"] == "true"
    assert runs(app) == ["waiting"]


@pytest.mark.parametrize("failure", [{"status": 500}, {"status": 503}, {"raise": True}])
def test_server_errors_store_nothing_and_a_retry_runs(
    make_app: MakeApp, records: Records, failure: dict[str, Any]
) -> None:
    app = make_app()
    response = post(app, failure)
    assert response.status_code >= 500
    assert records.count(app) == 0
    # The view's own writes were rolled back with the attempt (memory:// has none).
    assert records.kept_writes(app) in (0, None)
    assert post(app, failure).status_code >= 500
    assert runs(app) == ["charges", "charges"]


@pytest.mark.parametrize("status", [400, 401, 403, 404, 408, 409, 422, 425, 429])
def test_answers_that_mean_not_acted_on_are_not_stored(
    make_app: MakeApp, records: Records, status: int
) -> None:
    app = make_app()
    first = post(app, {"status": status})
    assert first.status_code == status
    assert first.headers["Idempotent-Replayed"] == "false"
    assert post(app, {"status": status}).headers["Idempotent-Replayed"] == "false"
    assert runs(app) == ["charges", "charges"]
    assert records.kept_writes(app) in (0, None)


@pytest.mark.parametrize("status", [200, 201, 202, 302, 402])
def test_final_answers_are_stored(make_app: MakeApp, status: int) -> None:
    app = make_app()
    assert post(app, {"status": status}).status_code == status
    replay = post(app, {"status": status})
    assert replay.status_code == status
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert runs(app) == ["charges"]


def test_http_exception_from_view_is_not_stored(make_app: MakeApp) -> None:
    app = make_app()
    assert post(app, {"abort": 404}).status_code == 404
    assert post(app, {"abort": 404}).status_code == 404
    assert runs(app) == ["charges", "charges"]


def test_which_statuses_are_stored_is_configurable(make_app: MakeApp) -> None:
    app = make_app(IDEMPOTENCY_SHOULD_STORE=lambda status: status < 600)
    post(app, {"status": 500})
    assert post(app, {"status": 500}).headers["Idempotent-Replayed"] == "true"


def test_missing_key_is_400(make_app: MakeApp) -> None:
    app = make_app()
    response = post(app, {}, key=None)
    assert response.status_code == 400
    assert error_code(response) == "missing_key"
    assert runs(app) == []


@pytest.mark.parametrize(
    "key", ["", " ", "a b", "x" * 256, "tab\there", "caf\u00e9", '""', '"a b"']
)
def test_invalid_key_is_400(make_app: MakeApp, key: str) -> None:
    app = make_app()
    response = post(app, {}, key=key)
    assert response.status_code == 400
    assert error_code(response) == "invalid_key"
    assert runs(app) == []


def test_quoted_structured_field_key_equals_bare_key(make_app: MakeApp) -> None:
    app = make_app()
    post(app, {}, key="abc")
    assert post(app, {}, key='"abc"').headers["Idempotent-Replayed"] == "true"
    assert post(app, {}, key="x" * 255).status_code == 201


def test_scopes_keep_records_apart(make_app: MakeApp) -> None:
    app = make_app()
    a = post(app, {"amount": 1}, headers={"Authorization": "Bearer tenant-a"})
    b = post(app, {"amount": 1}, headers={"Authorization": "Bearer tenant-b"})
    assert a.headers["Idempotent-Replayed"] == b.headers["Idempotent-Replayed"] == "false"
    assert a.get_json()["row"] != b.get_json()["row"]
    # Even a different request under the other tenant's key is no conflict.
    c = post(app, {"amount": 2}, headers={"Authorization": "Bearer tenant-c"})
    assert c.status_code == 201


def test_custom_scope_function(make_app: MakeApp) -> None:
    app = make_app(IDEMPOTENCY_SCOPE_FUNC=lambda request: request.headers.get("X-Tenant", ""))
    post(app, {}, headers={"X-Tenant": "a", "Authorization": "Bearer 1"})
    again = post(app, {}, headers={"X-Tenant": "a", "Authorization": "Bearer 2"})
    assert again.headers["Idempotent-Replayed"] == "true"


def test_authentication_runs_first_and_401_is_never_stored(make_app: MakeApp) -> None:
    app = make_app()
    denied = post(app, {}, path="/authenticated", key="")  # an invalid key, but auth is first
    assert denied.status_code == 401
    # With a valid key the 401 still comes before any claim (a claim released by the
    # 401 would leave no row, so count the claims themselves).
    denied = post(app, {}, path="/authenticated", key="k-auth")
    assert denied.status_code == 401
    metrics = app.extensions["idempotency"].metrics.snapshot()
    assert metrics["executed"] == metrics["released"] == 0
    ok = post(
        app, {}, path="/authenticated", key="k-auth", headers={"Authorization": "Bearer good"}
    )
    assert ok.status_code == 201
    assert runs(app) == ["authenticated"]


@pytest.mark.postgres_only
def test_postgres_unreachable_fails_closed(make_app: MakeApp) -> None:
    app = make_app(IDEMPOTENCY_AUTO_MIGRATE=False)
    make_unreachable(app)
    response = post(app, {})
    assert response.status_code == 503
    assert error_code(response) == "store_unavailable"
    assert int(response.headers["Retry-After"]) >= 1
    assert runs(app) == []


def test_expired_record_is_treated_as_absent(make_app: MakeApp, records: Records) -> None:
    app = make_app()
    post(app, {"amount": 1})
    records.expire(app)
    again = post(app, {"amount": 2})  # even a different request: the old record is gone
    assert again.status_code == 201
    assert again.headers["Idempotent-Replayed"] == "false"
    assert runs(app) == ["charges", "charges"]


def test_route_ttl_override_is_stored(make_app: MakeApp, database_url: str) -> None:
    """The route's TTL counts from the first request (a fast view's completion keeps
    the claim's expiry), and the answer is replayable at least 0.9 of it after."""
    app = make_app()
    post(app, {}, path="/optional")
    [(lives, after_completion)] = sql(
        database_url,
        "SELECT extract(epoch FROM expires_at - created_at),"
        " extract(epoch FROM expires_at - completed_at) FROM idempotency_records",
    )
    assert float(lives) == pytest.approx(3600)
    assert 0.9 * 3600 <= float(after_completion) <= 3600


def test_optional_route_runs_every_time_without_a_key(make_app: MakeApp) -> None:
    app = make_app()
    post(app, {}, path="/optional", key=None)
    post(app, {}, path="/optional", key=None)
    post(app, {}, path="/optional", key="k")
    post(app, {}, path="/optional", key="k")
    assert runs(app) == ["optional"] * 3


def test_business_rows_commit_with_the_completion(make_app: MakeApp, database_url: str) -> None:
    app = make_app()
    response = post(app, {})
    [(state, status)] = sql(database_url, "SELECT state, status_code FROM idempotency_records")
    assert (state, status) == ("completed", 201)
    rows = sql(database_url, "SELECT id FROM core_business_rows")
    assert rows == [(response.get_json()["row"],)]


def test_keys_are_not_stored_raw(make_app: MakeApp, database_url: str) -> None:
    app = make_app()
    post(app, {}, key="very-recognisable-key")
    [(record_key,)] = sql(database_url, "SELECT record_key FROM idempotency_records")
    assert b"very-recognisable-key" not in bytes(record_key)
    assert len(bytes(record_key)) == 32


def test_oversized_response_kept_and_stored_without_its_body(
    make_app: MakeApp, database_url: str
) -> None:
    """The default: a charge the view made is recorded; a retry learns it happened."""
    app = make_app(IDEMPOTENCY_MAX_STORED_BODY=1000)
    first = post(app, {"big": 5000})
    assert first.status_code == 201 and len(first.data) > 5000
    assert sql(database_url, "SELECT count(*) FROM core_business_rows") == [(1,)]
    retry = post(app, {"big": 5000})
    assert (retry.status_code, retry.data) == (201, b"")
    assert retry.headers["Idempotent-Replayed"] == "true"
    assert retry.headers["Idempotency-Body-Omitted"] == "true"
    assert retry.headers["Location"] == first.headers["Location"]
    assert runs(app) == ["charges"]


def test_oversized_response_is_rolled_back_not_half_stored_when_rejected(
    make_app: MakeApp, database_url: str
) -> None:
    app = make_app(IDEMPOTENCY_MAX_STORED_BODY=1000, IDEMPOTENCY_OVERSIZE="reject")
    response = post(app, {"big": 5000})
    assert response.status_code == 500
    assert json.loads(response.data)["error"]["code"] == "response_too_large"
    assert sql(database_url, "SELECT count(*) FROM core_business_rows") == [(0,)]
    assert sql(database_url, "SELECT count(*) FROM idempotency_records") == [(0,)]


def test_an_oversized_answer_that_is_not_kept_passes_through_under_reject(
    make_app: MakeApp, database_url: str
) -> None:
    """A 5xx is released whatever its size: the view's own answer reaches the client
    (not ``response_too_large``) and a retry runs again."""
    app = make_app(IDEMPOTENCY_MAX_STORED_BODY=1000, IDEMPOTENCY_OVERSIZE="reject")
    for _ in range(2):
        response = post(app, {"big": 5000, "status": 503})
        assert response.status_code == 503 and len(response.data) > 5000
    assert sql(database_url, "SELECT count(*) FROM idempotency_records") == [(0,)]
    assert runs(app) == ["charges", "charges"]


def test_app_error_handlers_still_apply(make_app: MakeApp) -> None:
    from flask_idempotency import MissingKey

    app = make_app()
    app.register_error_handler(MissingKey, lambda e: ({"custom": True}, 400))
    response = post(app, {}, key=None)
    assert response.get_json() == {"custom": True}


def test_init_app_twice_is_an_error(make_app: MakeApp) -> None:
    app = make_app()
    with pytest.raises(RuntimeError, match="already"):
        app.extensions["idem"].init_app(app)


def test_chunked_body_over_the_limit_is_413_not_truncated(make_app: MakeApp) -> None:
    app = make_app()
    app.config["MAX_CONTENT_LENGTH"] = 100
    body = b'{"pad": "' + b"x" * 200 + b'"}'
    response = app.test_client().post(
        "/charges",
        input_stream=io.BytesIO(body),
        headers={
            "Idempotency-Key": "k",
            "Content-Type": "application/json",
            "Transfer-Encoding": "chunked",
        },
        environ_overrides={"wsgi.input_terminated": True},  # as gunicorn sets it
    )
    assert response.status_code == 413
    assert runs(app) == []


def test_unreadable_body_is_400_malformed_body(make_app: MakeApp) -> None:
    class BrokenStream(io.BytesIO):
        def read(self, *args: Any) -> bytes:
            raise OSError("the client's chunked framing is broken")

        def readinto(self, *args: Any) -> int:
            raise OSError("the client's chunked framing is broken")

    app = make_app()
    response = app.test_client().post(
        "/charges",
        input_stream=BrokenStream(b"0123456789"),
        headers={"Idempotency-Key": "k", "Content-Type": "application/json"},
        content_length=10,
    )
    assert response.status_code == 400
    assert response.get_json()["error"]["code"] == "malformed_body"
    assert runs(app) == []


def test_a_replay_takes_no_row_lock(make_app: MakeApp, database_url: str) -> None:
    """Replays and 409s only read: a hot key's duplicates never queue on its row."""
    app = make_app()
    post(app, {"amount": 1})
    locker = psycopg2.connect(database_url)
    try:
        with locker.cursor() as cur:
            cur.execute("SELECT 1 FROM idempotency_records FOR UPDATE")
            outcome: list[TestResponse] = []
            thread = threading.Thread(target=lambda: outcome.append(post(app, {"amount": 1})))
            thread.start()
            thread.join(5)
            assert not thread.is_alive(), "the replay waited for the row lock"
            assert outcome[0].headers["Idempotent-Replayed"] == "true"
    finally:
        locker.rollback()
        locker.close()
