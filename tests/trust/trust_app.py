"""An app for the trust-boundary tests, in-process and under gunicorn.

Each body-reading view is served twice, decorated (``/read/<api>``) and not
(``/plain/read/<api>``), so a test compares what the view sees, and what the
worker's memory does, with and without the extension. ``/echo`` answers with a
header taken from the JSON body, as a view echoing a client's value would, and
writes a business row first, to show that an answer the store cannot hold
leaves nothing behind. ``/cors`` sits behind an ``after_request`` CORS layer
set up after the extension, which (like flask-cors) leaves a response that
already carries ``Access-Control-Allow-Origin`` alone.

Under gunicorn, ``create_app()`` reads ``DATABASE_URL``.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Mapping
from typing import IO, Any

import psycopg2
from flask import Flask, Response, jsonify, request

from flask_idempotency import Idempotency

TABLES = """
CREATE TABLE IF NOT EXISTS trust_rows (id bigserial PRIMARY KEY, label text NOT NULL);
CREATE TABLE IF NOT EXISTS trust_attempts (id bigserial PRIMARY KEY, label text NOT NULL);
"""
#: The browser origins the CORS layer allows.
ALLOWED_ORIGINS = ("https://one.example", "https://two.example")
#: Bytes read at a time by the views that stream, as an upload handler would.
CHUNK = 64 * 1024


def one_scope(request: Any) -> str:
    """Every test client is one principal: scoping is not what these tests are about."""
    return "trust-tests"


def digest_of(chunks: Iterable[bytes]) -> dict[str, Any]:
    h = hashlib.sha256()
    size = 0
    for chunk in chunks:
        h.update(chunk)
        size += len(chunk)
    return {"size": size, "sha256": h.hexdigest()}


def chunks_of(stream: IO[bytes]) -> Iterable[bytes]:
    while chunk := stream.read(CHUNK):
        yield chunk


def read_with(api: str) -> dict[str, Any]:
    """What the view sees of the body through one API."""
    if api == "stream":
        return digest_of(chunks_of(request.stream))
    if api == "data":
        return digest_of([request.get_data()])
    if api == "json":
        return {"json": request.get_json()}
    if api == "form":
        return {"form": request.form.to_dict()}
    if api == "files":
        found = {name: digest_of(chunks_of(f.stream)) for name, f in request.files.items()}
        return {"files": found, "form": request.form.to_dict()}
    raise ValueError(api)


def create_app(database_url: str | None = None, config: Mapping[str, Any] | None = None) -> Flask:
    app = Flask(__name__)
    dsn = database_url or os.environ["DATABASE_URL"]
    app.config.update(
        IDEMPOTENCY_DATABASE_URL=dsn,
        IDEMPOTENCY_AUTO_MIGRATE=True,
        IDEMPOTENCY_SCOPE_FUNC=one_scope,
    )
    app.config.update(config or {})
    with psycopg2.connect(dsn) as conn, conn.cursor() as cur:
        cur.execute("SELECT pg_advisory_xact_lock(4243)")
        cur.execute(TABLES)
    conn.close()
    idempotency = Idempotency(app)
    app.extensions["idem"] = idempotency

    def attempted(label: str) -> None:
        """Counted on a connection of its own: kept even when the attempt is not."""
        with psycopg2.connect(dsn) as attempt_conn, attempt_conn.cursor() as cur:
            cur.execute("INSERT INTO trust_attempts (label) VALUES (%s)", (label,))
        attempt_conn.close()

    @app.post("/read/<api>")
    @idempotency.required
    def read_decorated(api: str) -> tuple[Response, int]:
        return jsonify(read_with(api)), 201

    @app.post("/plain/read/<api>")
    def read_plain(api: str) -> tuple[Response, int]:
        return jsonify(read_with(api)), 201

    @app.post("/echo")
    @idempotency.required
    def echo() -> Response:
        """Answers with ``X-Echo`` from the body, after writing a business row."""
        attempted("echo")
        with idempotency.connection().cursor() as cur:
            cur.execute("INSERT INTO trust_rows (label) VALUES ('echo') RETURNING id")
            row = cur.fetchone()
        assert row is not None
        response = jsonify({"row": row[0]})
        response.status_code = 201
        response.headers["X-Echo"] = request.get_json()["echo"]
        return response

    @app.post("/cors")
    @idempotency.required
    def cors() -> Response:
        attempted("cors")
        response = jsonify({"charged": True})
        response.status_code = 201
        response.headers["X-Request-Id"] = request.headers.get("X-Request-Id", "")
        response.set_cookie("session", "secret")
        return response

    @app.after_request
    def cors_layer(response: Response) -> Response:
        """A CORS layer registered after the extension, so it runs before the
        extension's own ``after_request``, as flask-cors does when set up later."""
        origin = request.headers.get("Origin")
        if origin not in ALLOWED_ORIGINS or "Access-Control-Allow-Origin" in response.headers:
            return response  # flask-cors: "CORS have been already evaluated, skipping"
        response.headers["Access-Control-Allow-Origin"] = origin
        response.headers["Access-Control-Allow-Credentials"] = "true"
        response.headers.add("Vary", "Origin")
        return response

    return app
