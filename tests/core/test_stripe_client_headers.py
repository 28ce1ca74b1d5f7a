"""What Stripe's SDKs read, in the default (``stripe``) profile (issue 39).

Stripe echoes a request's ``Idempotency-Key`` on its answers, and its SDKs retry
every ``409`` and ``5xx`` unless the answer says ``Stripe-Should-Retry: false``.
So, in the ``stripe`` profile: every answer to a keyed request once its scope and
body are read (first answer, replay, the extension's own errors) carries the key back,
and the extension's errors that the same request sent again cannot change (its
``400``s, ``422``, the final ``500``s) say ``Stripe-Should-Retry: false``. The
``ietf`` profile sends neither. Neither header is stored: a replay stays the
stored answer plus the profile's documented headers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest
from flask import Flask, Response, request
from werkzeug.test import TestResponse

from flask_idempotency import Idempotency, global_scope

SHOULD_RETRY = "Stripe-Should-Retry"
MakeApp = Callable[..., Flask]


@pytest.fixture
def make_app() -> Iterator[MakeApp]:
    apps: list[Flask] = []

    def make(profile: str = "stripe", **config: object) -> Flask:
        app = Flask(__name__)
        app.config.update(
            IDEMPOTENCY_DATABASE_URL="memory://",
            IDEMPOTENCY_SCOPE_FUNC=global_scope,
            IDEMPOTENCY_PROFILE=profile,
            **config,
        )
        idempotency = Idempotency(app)
        entered, release = threading.Event(), threading.Event()
        app.extensions["gate"] = (entered, release)

        @app.post("/charges")
        @idempotency.required
        def charges() -> Response:
            body = request.get_json()
            if body.get("gate"):
                entered.set()
                release.wait(10)
            headers = {"Location": "/charges/1", "X-Echo": body.get("echo", "")}
            return Response('{"id": 1}', 201, headers, content_type="application/json")

        @app.post("/invalid")
        @idempotency.required
        def invalid() -> Response:
            return Response('{"error": "validation"}', 400, content_type="application/json")

        apps.append(app)
        return app

    yield make
    for app in apps:
        app.extensions["idempotency"].close()


def post(app: Flask, key: str | None, **body: object) -> TestResponse:
    headers = {} if key is None else {"Idempotency-Key": key}
    return app.test_client().post("/charges", json=body, headers=headers)


def answer_only(answer: TestResponse) -> list[tuple[str, str]]:
    """The answer's headers but the profile's own (the marker, the echoed key)."""
    ours = ("idempotency-key", "idempotent-replayed")
    return [(name, value) for name, value in answer.headers if name.lower() not in ours]


def test_first_answers_and_replays_echo_the_key_as_sent(make_app: MakeApp) -> None:
    app = make_app()
    first = post(app, "charge-1")
    replay = post(app, "charge-1")
    quoted = post(app, '"charge-1"')  # the Structured-Field form is the same key
    assert (first.status_code, first.headers["Idempotent-Replayed"]) == (201, "false")
    assert (replay.status_code, replay.headers["Idempotent-Replayed"]) == (201, "true")
    assert first.headers["Idempotency-Key"] == replay.headers["Idempotency-Key"] == "charge-1"
    assert quoted.headers["Idempotency-Key"] == '"charge-1"'
    assert quoted.headers["Idempotent-Replayed"] == "true"
    # Stored answers carry no Stripe-Should-Retry; the key is the request's, not stored.
    for answer in (first, replay, quoted):
        assert SHOULD_RETRY not in answer.headers
        assert answer.headers.getlist("Idempotency-Key") == [
            answer.request.headers["Idempotency-Key"]
        ]
    # Beside the documented headers, a replay is the stored answer as it was.
    assert answer_only(replay) == answer_only(first)


def test_a_configured_key_header_is_echoed_under_its_own_name(make_app: MakeApp) -> None:
    app = make_app(IDEMPOTENCY_KEY_HEADER="X-Request-Key")
    answer = app.test_client().post("/charges", json={}, headers={"X-Request-Key": "abc"})
    assert answer.status_code == 201 and answer.headers["X-Request-Key"] == "abc"
    assert "Idempotency-Key" not in answer.headers


@pytest.mark.parametrize(
    ("key", "code"), [(None, "missing_key"), ("a,b", "invalid_key"), ("", "invalid_key")]
)
def test_a_bad_key_is_final(make_app: MakeApp, key: str | None, code: str) -> None:
    answer = post(make_app(), key)
    assert (answer.status_code, answer.get_json()["error"]["code"]) == (400, code)
    assert answer.headers[SHOULD_RETRY] == "false"
    assert "Idempotency-Key" not in answer.headers  # no valid key to echo


def test_a_reused_key_is_final_and_echoes_the_key(make_app: MakeApp) -> None:
    app = make_app()
    assert post(app, "reused", amount=1).status_code == 201
    answer = post(app, "reused", amount=2)
    assert (answer.status_code, answer.get_json()["error"]["code"]) == (422, "key_reused")
    assert answer.headers[SHOULD_RETRY] == "false"
    assert answer.headers["Idempotency-Key"] == "reused"


def test_in_progress_stays_retryable(make_app: MakeApp) -> None:
    """A 409 a retry can change: no Stripe-Should-Retry, so the SDK retries it."""
    app = make_app()
    entered, release = app.extensions["gate"]
    first: list[TestResponse] = []
    runner = threading.Thread(target=lambda: first.append(post(app, "busy", gate=True)))
    runner.start()
    try:
        assert entered.wait(10)
        answer = post(app, "busy", gate=True)
    finally:
        release.set()
        runner.join(10)
    assert (answer.status_code, answer.get_json()["error"]["code"]) == (409, "in_progress")
    assert answer.headers["Retry-After"] == "1"
    assert SHOULD_RETRY not in answer.headers
    assert answer.headers["Idempotency-Key"] == "busy"
    assert first[0].status_code == 201


def test_an_unstorable_answer_is_final(make_app: MakeApp) -> None:
    answer = post(make_app(), "nul", echo="a\x00b")
    assert (answer.status_code, answer.get_json()["error"]["code"]) == (
        500,
        "response_not_storable",
    )
    assert answer.headers[SHOULD_RETRY] == "false"
    assert "Retry-After" not in answer.headers


def test_the_views_own_answers_are_left_alone(make_app: MakeApp) -> None:
    """A view's 400 is the application's to qualify: only the key is echoed."""
    app = make_app()
    answer = app.test_client().post("/invalid", json={}, headers={"Idempotency-Key": "v-1"})
    assert answer.status_code == 400 and SHOULD_RETRY not in answer.headers
    assert answer.headers["Idempotency-Key"] == "v-1"


def test_the_ietf_profile_sends_neither(make_app: MakeApp) -> None:
    app = make_app("ietf")
    first, replay = post(app, "i-1"), post(app, "i-1")
    reused = post(app, "i-1", amount=2)
    missing = post(app, None)
    assert [a.status_code for a in (first, replay, reused, missing)] == [201, 201, 422, 400]
    for answer in (first, replay, reused, missing):
        assert "Idempotency-Key" not in answer.headers
        assert SHOULD_RETRY not in answer.headers


def test_exposed_headers_name_the_key_and_should_retry(make_app: MakeApp) -> None:
    app = make_app(IDEMPOTENCY_EXPOSE_HEADERS=True)
    exposed = post(app, "cors-1").headers["Access-Control-Expose-Headers"]
    names = {name.strip() for name in exposed.split(",")}
    assert {"Idempotent-Replayed", "Idempotency-Key", SHOULD_RETRY, "Retry-After"} <= names
