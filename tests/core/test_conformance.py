"""The public anyonce conformance vectors, restated, against a real gunicorn.

anyonce (github.com/sns45/anyonce, ``conformance/vectors``) grades
implementations of draft-ietf-httpapi-idempotency-key-header-07 on two
tiers: ``core`` (what the draft states) and ``profile`` (its reference's
choices where the draft is silent). Each test below is one vector, named by
its id, with the vector's requests and expectations; the fixture routes are
``support/conformance_app.py``.

Every core vector runs in both of the extension's profiles. One check of one
core vector cannot hold in the default ``stripe`` profile by contract: the
missing-key ``400`` is ``application/json`` there (CONTRACT §1), not
``application/problem+json``; that check alone is made profile-dependent.
In the ``ietf`` profile every profile vector passes; ``4xx-replayed`` needs
the reference's choice of storing every answer below 500, which the
extension expresses through ``IDEMPOTENCY_SHOULD_STORE``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

from support.databases import truncate_public_tables
from support.gunicorn_server import GunicornServer
from support.http_client import HttpResponse, http_request
from support.waiting import wait_until

TEXT = {"Content-Type": "text/plain"}


class Target:
    """One fixture server and the vectors' way of talking to it."""

    def __init__(self, server: GunicornServer, profile: str) -> None:
        self.server = server
        self.profile = profile

    def reset(self) -> None:
        assert self.send("POST", "/reset").status == 204

    def send(
        self, method: str, path: str, key: str | None = None, body: str | None = None
    ) -> HttpResponse:
        headers = dict(TEXT)
        if key is not None:
            headers["Idempotency-Key"] = key
        return http_request(method, self.server.url + path, headers, body)

    def invocations(self) -> int:
        count: int = self.send("GET", "/counter").json()["count"]
        return count

    @property
    def replayed_header(self) -> str:
        return "Idempotency-Replayed" if self.profile == "ietf" else "Idempotent-Replayed"


def is_problem(response: HttpResponse) -> bool:
    return response.headers.get("Content-Type", "").startswith("application/problem+json")


@pytest.fixture(scope="module", params=["stripe", "ietf"])
def target(request: Any, database_url: str, tmp_path_factory: Any) -> Iterator[Target]:
    truncate_public_tables(database_url)
    env = {"DATABASE_URL": database_url, "CONFORMANCE_PROFILE": request.param}
    if request.param == "ietf":
        env["CONFORMANCE_STORE_ALL"] = "1"
    server = GunicornServer("support.conformance_app:create_app()", env=env, threads=4)
    try:
        server.start()
        yield Target(server, request.param)
    finally:
        server.stop()
        server.close()


@pytest.fixture
def fixture(target: Target) -> Target:
    target.reset()
    return target


# -- core ---------------------------------------------------------------------


def test_core_post_executes_once(fixture: Target) -> None:
    first = fixture.send("POST", "/echo", "k-post-once-1", "hello")
    assert (first.status, first.body) == (201, b"hello")
    assert fixture.invocations() == 1


def test_core_key_missing_required(fixture: Target) -> None:
    missing = fixture.send("POST", "/echo", None, "no key")
    assert missing.status == 400
    assert is_problem(missing) == (fixture.profile == "ietf")  # see the module's docstring
    assert fixture.invocations() == 0


def test_core_mismatch_422(fixture: Target) -> None:
    assert fixture.send("POST", "/echo", "k-mismatch-1", "payload-a").status == 201
    assert fixture.send("POST", "/echo", "k-mismatch-1", "payload-b").status == 422
    assert fixture.invocations() == 1


def test_core_mismatch_does_not_poison(fixture: Target) -> None:
    first = fixture.send("POST", "/echo", "k-poison-1", "payload-a")
    assert (first.status, first.body) == (201, b"payload-a")
    assert fixture.send("POST", "/echo", "k-poison-1", "payload-b").status == 422
    corrected = fixture.send("POST", "/echo", "k-poison-1", "payload-a")
    assert (corrected.status, corrected.body) == (201, first.body)
    assert fixture.invocations() == 1


def test_core_sf_string_quoted_key(fixture: Target) -> None:
    first = fixture.send("POST", "/echo", '"quoted-key-1"', "quoted")
    assert (first.status, first.body) == (201, b"quoted")
    retry = fixture.send("POST", "/echo", '"quoted-key-1"', "quoted")
    assert (retry.status, retry.body) == (201, first.body)
    assert fixture.invocations() == 1


def test_core_get_ignored(fixture: Target) -> None:
    before = fixture.send("GET", "/counter", "k-get-1")
    assert (before.status, before.json()) == (200, {"count": 0})
    assert fixture.send("POST", "/echo", "k-get-2", "x").status == 201
    after = fixture.send("GET", "/counter", "k-get-1")
    assert (after.status, after.json()) == (200, {"count": 1})


def test_core_concurrent_409(fixture: Target) -> None:
    answers: dict[str, HttpResponse] = {}

    def original() -> None:
        answers["original"] = fixture.send("POST", "/slow?ms=1500", "k-concurrent-1", "slow")

    thread = threading.Thread(target=original)
    thread.start()
    wait_until(lambda: fixture.invocations() == 1, 10, "the original to be in its view")
    answers["duplicate"] = fixture.send("POST", "/slow?ms=1500", "k-concurrent-1", "slow")
    thread.join(10)
    assert (answers["original"].status, answers["original"].body) == (200, b"slept:1500")
    assert answers["duplicate"].status == 409
    assert fixture.invocations() == 1


# -- profile (the reference's choices; asserted in the ietf profile) -----------


def test_profile_replayed_header(fixture: Target) -> None:
    first = fixture.send("POST", "/echo", "k-replayed-1", "r")
    assert first.status == 201
    retry = fixture.send("POST", "/echo", "k-replayed-1", "r")
    assert (retry.status, retry.body) == (201, first.body)
    assert retry.headers.get(fixture.replayed_header) == "true"
    if fixture.profile == "ietf":
        assert first.headers.get("Idempotency-Replayed") is None
    else:  # Stripe marks first answers too
        assert first.headers.get("Idempotent-Replayed") == "false"


def test_profile_problem_content_type(fixture: Target) -> None:
    missing = fixture.send("POST", "/echo", None, "no key")
    assert fixture.send("POST", "/echo", "k-ctype-1", "payload-a").status == 201
    changed = fixture.send("POST", "/echo", "k-ctype-1", "payload-b")
    assert (missing.status, changed.status) == (400, 422)
    if fixture.profile == "ietf":
        assert is_problem(missing) and is_problem(changed)
        problem = changed.json()
        assert problem["status"] == 422 and problem["code"] == "key_reused"
        assert problem["type"].endswith("key_reused") and problem["title"] and problem["detail"]
    else:
        assert changed.json()["error"]["code"] == "key_reused"


def test_profile_omitted_body_replay(fixture: Target) -> None:
    size = 1024 * 1024 + 1  # one byte over the default stored-body cap
    first = fixture.send("POST", f"/large?bytes={size}", "k-omitted-1", "l")
    assert (first.status, len(first.body)) == (200, size)
    assert fixture.invocations() == 1
    retry = fixture.send("POST", f"/large?bytes={size}", "k-omitted-1", "l")
    assert (retry.status, retry.body) == (200, b"")
    assert retry.headers.get(fixture.replayed_header) == "true"
    assert retry.headers.get("Idempotency-Body-Omitted") == "true"
    assert fixture.invocations() == 1


def test_profile_4xx_replayed(fixture: Target) -> None:
    first = fixture.send("POST", "/status/404", "k-4xx-1", "s")
    assert (first.status, first.body) == (404, b"status:404")
    retry = fixture.send("POST", "/status/404", "k-4xx-1", "s")
    if fixture.profile == "ietf":  # stores every answer below 500, as the reference
        assert (retry.status, retry.body) == (404, first.body)
        assert retry.headers.get("Idempotency-Replayed") == "true"
        assert fixture.invocations() == 1
    else:  # the default: a 404 means "not acted on", so a retry runs again
        assert retry.headers.get("Idempotent-Replayed") == "false"
        assert fixture.invocations() == 2
