"""A small app that emits events from every kind of transaction, for the events tests.

``POST /things`` (required key), ``POST /maybe`` (optional key) and ``POST /tx``
(``idempotency.transaction()``) write a row and emit ``thing.created``; the JSON
body steers the answer: ``{"status": 201}``, ``{"raise": true}``,
``{"steal": true}`` (another holder takes the record over before the
completion, so it is fenced), ``{"events": 2}``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import psycopg2
from flask import Flask, jsonify, request

from flask_idempotency import Idempotency

TABLES = """
CREATE TABLE IF NOT EXISTS ev_things (id bigserial PRIMARY KEY, label text NOT NULL);
CREATE TABLE IF NOT EXISTS ev_handled (
    id bigserial PRIMARY KEY, consumer text NOT NULL, message_id text NOT NULL, pid integer
);
"""

idempotency = Idempotency()


def create_app(database_url: str, config: Mapping[str, Any] | None = None) -> Flask:
    app = Flask(__name__)
    app.config.update(
        IDEMPOTENCY_DATABASE_URL=database_url,
        IDEMPOTENCY_AUTO_MIGRATE=True,
        IDEMPOTENCY_SCOPE_FUNC=lambda req: "tenant",
        IDEMPOTENCY_DATABASE_OPTIONS={"pool_size": 4},
    )
    app.config.update(config or {})
    conn = psycopg2.connect(database_url)
    try:
        with conn, conn.cursor() as cur:
            cur.execute(TABLES)
    finally:
        conn.close()
    idempotency.init_app(app)

    def work(conn: Any) -> Any:
        body = request.get_json(silent=True) or {}
        with conn.cursor() as cur:
            cur.execute("INSERT INTO ev_things (label) VALUES (%s)", (str(body.get("label")),))
        ids = [
            idempotency.emit("thing.created", {"label": body.get("label"), "n": n})
            for n in range(int(body.get("events", 1)))
        ]
        if body.get("bad_payload"):
            idempotency.emit("thing.created", {"not json": {1, 2}})
        if body.get("raise"):
            raise RuntimeError("the view failed after emitting")
        if body.get("steal"):
            _steal(database_url)
        return jsonify({"events": ids}), int(body.get("status", 201))

    @app.post("/things")
    @idempotency.required
    def things() -> Any:
        return work(idempotency.connection())

    @app.post("/maybe")
    @idempotency.optional
    def maybe() -> Any:
        return work(idempotency.connection())

    @app.post("/tx")
    def tx() -> Any:
        with idempotency.transaction() as conn:
            return work(conn)

    return app


def _steal(database_url: str) -> None:
    """Another holder takes every processing record over (as after a lapsed lease)."""
    conn = psycopg2.connect(database_url)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            cur.execute(
                "UPDATE idempotency_records SET lock_token = lock_token + 1"
                " WHERE state = 'processing'"
            )
    finally:
        conn.close()
