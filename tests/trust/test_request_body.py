"""A decorated view sees the whole body through every API, exactly as without the
extension; the fingerprint is computed as the body streams by, with the same bytes
as before; a JSON body, held whole to compare it canonically, is bounded."""

from __future__ import annotations

import hashlib
import io
import json
import os
from typing import Any

import pytest
from flask import Flask, request
from werkzeug.datastructures import FileStorage
from werkzeug.test import TestResponse, encode_multipart

from flask_idempotency.fingerprint import fingerprint
from flask_idempotency.request_body import MAX_JSON_BODY
from support.pg_query import query

from .conftest import MakeTrustApp

#: The finding's size: 100 kB, read by the view as 0 bytes through request.stream.
SIZE = 100_000
PAYLOAD = os.urandom(SIZE)
DOCUMENT = {"items": [{"n": i, "name": f"item {i}"} for i in range(4000)]}


#: Each kind of body, as bytes and Content-Type; the multipart one with a fixed
#: boundary, so that a retry sends the same bytes.
BODIES = {
    "bytes": (PAYLOAD, "application/octet-stream"),
    "json": (json.dumps(DOCUMENT).encode(), "application/json"),
    "files": (
        encode_multipart(
            {"upload": FileStorage(io.BytesIO(PAYLOAD), "payload.bin"), "note": "kept"}, "b0"
        )[1],
        "multipart/form-data; boundary=b0",
    ),
}


def send(app: Flask, path: str, api_body: str, key: str | None, *, chunked: bool = False) -> Any:
    """POST one of the bodies by kind (``bytes``, ``json``, ``form``, ``files``)."""
    headers = {"Idempotency-Key": key} if key else {}
    client = app.test_client()
    if api_body == "form":
        return client.post(path, data={"field": "x" * SIZE, "note": "kept"}, headers=headers)
    body, content_type = BODIES[api_body]
    if chunked:  # no Content-Length: the server marks the input as terminated
        return client.post(
            path,
            input_stream=io.BytesIO(body),
            content_type=content_type,
            headers=headers,
            environ_overrides={"wsgi.input_terminated": True},
        )
    return client.post(path, data=body, content_type=content_type, headers=headers)


def digest(data: bytes) -> dict[str, Any]:
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def expected(api: str, body: str) -> dict[str, Any]:
    """What a view reading ``body`` through ``api`` sees, by the body's own bytes."""
    if api in ("stream", "data"):
        return digest(BODIES[body][0])
    if api == "json":
        return {"json": DOCUMENT}
    if api == "form":
        return {"form": {"field": "x" * SIZE, "note": "kept"}}
    return {"files": {"upload": digest(PAYLOAD)}, "form": {"note": "kept"}}


CASES = [
    ("stream", "bytes"),
    ("stream", "json"),
    ("data", "bytes"),
    ("data", "json"),
    ("json", "json"),
    ("form", "form"),
    ("files", "files"),
]


@pytest.mark.parametrize(("api", "body"), CASES)
def test_the_view_reads_the_whole_body_through_every_api(
    make_trust_app: MakeTrustApp, api: str, body: str
) -> None:
    app = make_trust_app()
    plain = send(app, f"/plain/read/{api}", body, None)
    decorated = send(app, f"/read/{api}", body, "body-1")
    assert plain.status_code == decorated.status_code == 201
    assert decorated.headers["Idempotent-Replayed"] == "false"
    assert decorated.get_json() == plain.get_json()
    assert decorated.get_json() == expected(api, body)
    replay = send(app, f"/read/{api}", body, "body-1")
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert replay.get_data() == decorated.get_data()


@pytest.mark.parametrize("body", ["bytes", "json"])
def test_a_chunked_body_reaches_the_view_whole(make_trust_app: MakeTrustApp, body: str) -> None:
    app = make_trust_app()
    plain = send(app, "/plain/read/stream", body, None, chunked=True)
    decorated = send(app, "/read/stream", body, "chunked-1", chunked=True)
    assert decorated.status_code == 201
    assert decorated.get_json() == plain.get_json()
    assert decorated.get_json() == expected("stream", body)


def test_the_stored_fingerprint_is_the_one_computed_from_the_whole_body(
    make_trust_app: MakeTrustApp, clean_db: str
) -> None:
    """Records written while the body streamed by compare with those of 0.2.x, which
    hashed it whole: a retry spanning the upgrade replays."""
    app = make_trust_app()
    raw = json.dumps(DOCUMENT, indent=2).encode()
    assert send(app, "/read/stream", "bytes", "fp-bytes").status_code == 201
    response = app.test_client().post(
        "/read/data?x=1",
        data=raw,
        content_type="application/json",
        headers={"Idempotency-Key": "fp-json"},
    )
    assert response.status_code == 201
    stored = {bytes(fp) for (fp,) in query(clean_db, "SELECT fingerprint FROM idempotency_records")}
    assert stored == {
        fingerprint("POST", "/read/stream", b"", "application/octet-stream", PAYLOAD),
        fingerprint("POST", "/read/data", b"x=1", "application/json", raw),
    }


def test_a_body_the_app_read_before_the_view_is_still_fingerprinted(
    make_trust_app: MakeTrustApp,
) -> None:
    """A ``before_request`` that read the body (an auth layer checking a signature)
    left nothing in the stream: the fingerprint uses what Werkzeug cached."""
    app = make_trust_app()

    @app.before_request
    def verify_signature() -> None:
        hashlib.sha256(request.get_data()).hexdigest()

    first = send(app, "/read/data", "bytes", "early-1")
    assert first.status_code == 201
    assert first.get_json()["size"] == SIZE
    assert send(app, "/read/data", "bytes", "early-1").headers["Idempotent-Replayed"] == "true"
    changed = app.test_client().post(
        "/read/data",
        data=PAYLOAD[:-1],
        content_type="application/octet-stream",
        headers={"Idempotency-Key": "early-1"},
    )
    assert changed.status_code == 422


def post_json(app: Flask, body: bytes, key: str, *, chunked: bool = False) -> TestResponse:
    environ: dict[str, Any] = {"wsgi.input_terminated": True} if chunked else {}
    kwargs: dict[str, Any] = {"input_stream": io.BytesIO(body)} if chunked else {"data": body}
    return app.test_client().post(
        "/read/data",
        content_type="application/json",
        headers={"Idempotency-Key": key},
        environ_overrides=environ,
        **kwargs,
    )


def big_json(size: int) -> bytes:
    """A JSON document of exactly ``size`` bytes."""
    return b'{"pad":"' + b"x" * (size - 10) + b'"}'


@pytest.mark.parametrize("chunked", [False, True], ids=["declared", "chunked"])
def test_a_json_body_over_its_bound_is_413(make_trust_app: MakeTrustApp, chunked: bool) -> None:
    """Held whole to compare after parsing, a JSON body is bounded: by
    ``MAX_CONTENT_LENGTH``, else :data:`MAX_JSON_BODY`; nothing is claimed."""
    app = make_trust_app()
    assert post_json(app, big_json(MAX_JSON_BODY), "json-at", chunked=chunked).status_code == 201
    over = post_json(app, big_json(MAX_JSON_BODY + 1), "json-over", chunked=chunked)
    assert over.status_code == 413
    assert post_json(app, big_json(1000), "json-over", chunked=chunked).status_code == 201


def test_max_content_length_sets_the_json_bound(make_trust_app: MakeTrustApp) -> None:
    app = make_trust_app(MAX_CONTENT_LENGTH=MAX_JSON_BODY + 1024)
    assert post_json(app, big_json(MAX_JSON_BODY + 1000), "json-big").status_code == 201


def test_a_non_json_body_is_not_bounded_by_the_json_bound(make_trust_app: MakeTrustApp) -> None:
    app = make_trust_app()
    body = b"y" * (MAX_JSON_BODY + 1)
    response = app.test_client().post(
        "/read/stream",
        data=body,
        content_type="application/octet-stream",
        headers={"Idempotency-Key": "bytes-big"},
    )
    assert response.status_code == 201
    assert response.get_json()["size"] == len(body)


@pytest.mark.parametrize("content_type", ["application/octet-stream", "application/json"])
def test_a_body_of_exactly_max_content_length_is_read(
    make_trust_app: MakeTrustApp, content_type: str
) -> None:
    """Read to its declared length and no further: one more read of a stream whose
    limit is MAX_CONTENT_LENGTH is Werkzeug's 413 (under gunicorn, which marks its
    input as terminated)."""
    app = make_trust_app(MAX_CONTENT_LENGTH=1000)
    body = big_json(1000)
    response = app.test_client().post(
        "/read/stream",
        data=body,
        content_type=content_type,
        headers={"Idempotency-Key": "at-limit"},
        environ_overrides={"wsgi.input_terminated": True},
    )
    assert response.status_code == 201
    assert response.get_json() == digest(body)
