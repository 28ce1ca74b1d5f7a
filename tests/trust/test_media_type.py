"""The media type of ``Content-Type`` is part of the request (contract sections 1 and 7).

The same bytes sent as ``application/json`` and then as ``text/plain`` under one
key replayed the JSON answer: the fingerprint covered the method, the path and
the canonical body only. Now they are two requests (``422 key_reused``), while
parameters such as ``charset`` and the media type's case still do not matter.

Records written before the change (0.2.0's fingerprint: 32 bytes of SHA-256 over
``METHOD \\0 path \\0 body``, spelled out here from that release's
``fingerprint.py``) are compared the way they were written: a completed one
replays, and a dead holder's is taken over by the same request, in SQL.
"""

from __future__ import annotations

import hashlib
import json
import uuid

import psycopg2
import pytest
from flask import Flask

from flask_idempotency import fingerprint
from flask_idempotency.digests import record_key
from support.pg_query import query

from .conftest import MakeTrustApp
from .trust_app import one_scope

MODES = ["row", "transaction"]
BODY = b'{"amount":1500}'


def post(
    app: Flask, key: str, body: bytes, content_type: str | None
) -> tuple[int, dict[str, str], bytes]:
    headers = {"Idempotency-Key": key}
    if content_type is not None:
        headers["Content-Type"] = content_type
    answer = app.test_client().post("/read/data", data=body, headers=headers)
    return answer.status_code, dict(answer.headers), answer.get_data()


def attempts(database_url: str) -> int:
    """Runs of ``/read/data`` are not counted by the app: count completed records."""
    return int(query(database_url, "SELECT count(*) FROM idempotency_records")[0][0])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("first", "second"),
    [
        ("application/json", "text/plain"),
        ("text/plain", "application/json"),
        ("text/plain", "application/octet-stream"),
        ("application/json", "application/merge-patch+json"),
        (None, "text/plain"),
    ],
)
def test_the_same_bytes_under_another_media_type_are_another_request(
    make_trust_app: MakeTrustApp, mode: str, first: str | None, second: str
) -> None:
    app = make_trust_app(IDEMPOTENCY_CLAIM_MODE=mode)
    key = uuid.uuid4().hex
    status, headers, _ = post(app, key, BODY, first)
    assert (status, headers["Idempotent-Replayed"]) == (201, "false")
    status, headers, body = post(app, key, BODY, second)
    assert status == 422, body
    assert json.loads(body)["error"]["code"] == "key_reused"
    assert "Idempotent-Replayed" not in headers


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("first", "second"),
    [
        ("text/plain; charset=utf-8", "TEXT/Plain"),
        ("application/json", "Application/JSON; charset=UTF-8"),
        ("application/vnd.api+json", "application/vnd.api+json; ext=bulk"),
    ],
)
def test_parameters_and_case_of_the_media_type_do_not_matter(
    make_trust_app: MakeTrustApp, mode: str, first: str, second: str
) -> None:
    app = make_trust_app(IDEMPOTENCY_CLAIM_MODE=mode)
    key = uuid.uuid4().hex
    status, _, stored = post(app, key, BODY, first)
    assert status == 201
    status, headers, replayed = post(app, key, BODY, second)
    assert (status, headers["Idempotent-Replayed"], replayed) == (201, "true", stored)


def test_json_and_bodyless_requests_keep_the_fingerprint_of_0_2_0() -> None:
    """What workers of the previous release compare byte for byte during a rollout."""
    legacy = hashlib.sha256(b"POST\x00/read/data\x00" + BODY).digest()
    assert fingerprint.fingerprint("POST", "/read/data", b"", "application/json", BODY) == legacy
    bodyless = hashlib.sha256(b"POST\x00/read/data\x00").digest()
    assert fingerprint.fingerprint("POST", "/read/data", b"", "", b"") == bodyless
    # Text that is its own canonical JSON: a v0 record of it may be a JSON request's.
    text = fingerprint.fingerprint("POST", "/read/data", b"", "text/plain", BODY)
    assert text != legacy and len(text) == fingerprint.V1_SIZE
    assert fingerprint.written_before(text) is None
    assert not fingerprint.matches(legacy, text)
    # Any other text: a v0 record of it can only be 0.2.0's record of this request.
    prose = fingerprint.fingerprint("POST", "/read/data", b"", "text/plain", b"ship it")
    prose_legacy = hashlib.sha256(b"POST\x00/read/data\x00ship it").digest()
    assert fingerprint.matches(prose_legacy, prose)


def _write_0_2_0_record(database_url: str, key: str, body: bytes, *, completed: bool) -> None:
    """A record as 0.2.0 left it for ``POST /read/data`` with ``body`` under ``key``:
    completed (an answer to replay), or a dead holder's (its lease over)."""
    legacy = hashlib.sha256(b"POST\x00/read/data\x00" + body).digest()
    conn = psycopg2.connect(database_url)
    with conn, conn.cursor() as cur:
        if completed:
            cur.execute(
                """INSERT INTO idempotency_records
                   (record_key, fingerprint, state, created_at, expires_at, completed_at,
                    status_code, headers, body)
                   VALUES (%s, %s, 'completed', now(), now() + interval '1 hour', now(),
                           201, %s::jsonb, %s)""",
                (
                    record_key(one_scope(None), key),
                    legacy,
                    json.dumps([["Content-Type", "text/plain"], ["X-Written-By", "0.2.0"]]),
                    b"stored by 0.2.0",
                ),
            )
        else:
            cur.execute(
                """INSERT INTO idempotency_records
                   (record_key, fingerprint, state, lock_token, lease_expires_at, created_at,
                    expires_at)
                   VALUES (%s, %s, 'processing', 42, now() - interval '1 second', now(),
                           now() + interval '1 hour')""",
                (record_key(one_scope(None), key), legacy),
            )
    conn.close()


@pytest.mark.parametrize("mode", MODES)
def test_a_text_record_written_by_0_2_0_replays(make_trust_app: MakeTrustApp, mode: str) -> None:
    app = make_trust_app(IDEMPOTENCY_CLAIM_MODE=mode)
    key = uuid.uuid4().hex
    _write_0_2_0_record(app.config["IDEMPOTENCY_DATABASE_URL"], key, b"ship it", completed=True)
    status, headers, body = post(app, key, b"ship it", "text/plain; charset=utf-8")
    assert (status, body, headers["X-Written-By"]) == (201, b"stored by 0.2.0", "0.2.0")
    assert headers["Idempotent-Replayed"] == "true"
    # Another body under the key is still another request.
    assert post(app, key, b"ship it twice", "text/plain")[0] == 422


def test_a_dead_0_2_0_holder_of_the_same_text_request_is_taken_over(
    make_trust_app: MakeTrustApp,
) -> None:
    """The claim compares the dead holder's fingerprint in SQL, the way it was written:
    the same request takes over (and the view runs), another one is a 422."""
    app = make_trust_app(IDEMPOTENCY_CLAIM_MODE="row")
    dsn = app.config["IDEMPOTENCY_DATABASE_URL"]
    key = uuid.uuid4().hex
    _write_0_2_0_record(dsn, key, b"ship it", completed=False)
    assert post(app, key, b"ship it twice", "text/plain")[0] == 422
    status, headers, body = post(app, key, b"ship it", "text/plain")
    assert (status, headers["Idempotent-Replayed"]) == (201, "false"), body
    assert json.loads(body)["size"] == len(b"ship it")
    rows = query(dsn, "SELECT state, takeovers, length(fingerprint) FROM idempotency_records")
    assert rows == [("completed", 1, fingerprint.V1_SIZE)]
    status, headers, replayed = post(app, key, b"ship it", "text/plain")
    assert (status, headers["Idempotent-Replayed"], replayed) == (201, "true", body)
