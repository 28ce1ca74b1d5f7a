"""A small Flask app exercising every behaviour of the extension, for the core tests.

Used in-process (Flask's test client) and behind gunicorn (``create_app`` reads
``DATABASE_URL`` and ``CORE_APP_*`` from the environment). Executions are
recorded twice: in memory (``app.extensions["runs"]``) for in-process tests,
and in ``core_executions`` through a separate autocommit connection, so a
multi-process server's executions can be counted even when the attempt is
later rolled back.

With ``memory://`` as the URL (the in-memory store) there is no database: the
executions are recorded in memory only, and the view's "business row" is a
number from a counter (no transaction to keep or roll it back).

The app keeps the extension's default scope function, so its clients send
credentials as a real API client would: ``app.test_client()`` sends
``CLIENT_AUTHORIZATION`` unless a request sets its own ``Authorization``
(gunicorn-served tests send it themselves). A test of a request without any
principal uses a plain ``flask.testing.FlaskClient``.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
from collections.abc import Mapping
from typing import Any

import psycopg2
from flask import Flask, Response, abort, jsonify, request
from flask.testing import FlaskClient

from flask_idempotency import Idempotency

TABLES = """
CREATE TABLE IF NOT EXISTS core_business_rows (
    id bigserial PRIMARY KEY, label text NOT NULL, created_at timestamptz DEFAULT now()
);
CREATE TABLE IF NOT EXISTS core_executions (
    id bigserial PRIMARY KEY, label text NOT NULL, pid integer NOT NULL
);
"""


#: The URL of the in-memory store (``flask_idempotency.store.memory``).
MEMORY_URL = "memory://"

#: The API key the core app's clients send by default.
CLIENT_AUTHORIZATION = "Bearer core-test-client"


class CredentialedClient(FlaskClient):
    """A test client that sends ``CLIENT_AUTHORIZATION`` unless told otherwise."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.environ_base["HTTP_AUTHORIZATION"] = CLIENT_AUTHORIZATION


class Gates:
    """Named events a test opens to let a paused view go on."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._gates: dict[str, threading.Event] = {}
        self.entered: dict[str, threading.Event] = {}

    def get(self, name: str) -> threading.Event:
        with self._lock:
            self.entered.setdefault(name, threading.Event())
            return self._gates.setdefault(name, threading.Event())

    def entered_event(self, name: str) -> threading.Event:
        with self._lock:
            return self.entered.setdefault(name, threading.Event())


def create_app(
    database_url: str | None = None,
    config: Mapping[str, Any] | None = None,
    *,
    engine: Any = None,
) -> Flask:
    """The core app on ``database_url``; with ``engine`` (a SQLAlchemy ``Engine`` on
    that database) the extension takes that engine's connections (``engine=``)."""
    app = Flask(__name__)
    dsn = database_url or os.environ["DATABASE_URL"]
    app.config.update(
        IDEMPOTENCY_DATABASE_URL=dsn,
        IDEMPOTENCY_AUTO_MIGRATE=True,
        SECRET_KEY="core-app-secret",  # the Redis cache is off without one
    )
    for name, value in os.environ.items():
        if name.startswith("CORE_APP_IDEMPOTENCY_"):
            # A group of options (``..._DATABASE_OPTIONS``) is given as JSON.
            parsed = json.loads(value) if name.endswith("_OPTIONS") else value
            app.config[name.removeprefix("CORE_APP_")] = parsed
    app.config.update(config or {})
    if engine is not None:
        del app.config["IDEMPOTENCY_DATABASE_URL"]
    in_memory = dsn == MEMORY_URL
    if not in_memory:
        with psycopg2.connect(dsn) as conn, conn.cursor() as cur:
            cur.execute("SELECT pg_advisory_xact_lock(4242)")
            cur.execute(TABLES)
        conn.close()
    row_ids = itertools.count(1)

    idempotency = Idempotency(app, engine=engine)
    app.test_client_class = CredentialedClient
    runs: list[str] = []
    gates = Gates()
    app.extensions["runs"] = runs
    app.extensions["gates"] = gates
    app.extensions["idem"] = idempotency

    def record_execution(label: str) -> None:
        runs.append(label)
        if in_memory:
            return
        with idempotency.transaction() as conn, conn.cursor() as cur:
            cur.execute(
                "INSERT INTO core_executions (label, pid) VALUES (%s, %s)", (label, os.getpid())
            )

    def run_view(label: str) -> Response:
        """The scripted view: the JSON body says what to do."""
        body = request.get_json(silent=True) or {}
        record_execution(label)
        if "gate" in body:
            gates.entered_event(body["gate"]).set()
            gates.get(body["gate"]).wait(timeout=30)
        if "sleep" in body:
            time.sleep(float(body["sleep"]))
        if body.get("raise"):
            raise RuntimeError("the view failed")
        if "abort" in body:
            abort(int(body["abort"]))
        if in_memory:
            row: Any = (next(row_ids),)
        else:
            with idempotency.connection().cursor() as cur:
                cur.execute(
                    "INSERT INTO core_business_rows (label) VALUES (%s) RETURNING id", (label,)
                )
                row = cur.fetchone()
                assert row is not None
        status = int(body.get("status", 201))
        payload = {"row": row[0], "label": label, "echo": body, "at": time.time()}
        if "big" in body:
            payload["big"] = "x" * int(body["big"])
        response = jsonify(payload)
        response.status_code = status
        response.headers["Location"] = f"/rows/{row[0]}"
        response.headers["ETag"] = f'"{row[0]}"'
        response.headers["X-Custom"] = "custom-value"
        response.set_cookie("session", "secret")
        return response

    @app.route("/charges", methods=["POST", "PUT"])
    @idempotency.required
    def charges() -> Response:
        return run_view("charges")

    @app.post("/other")
    @idempotency.required
    def other() -> Response:
        return run_view("other")

    @app.post("/optional")
    @idempotency.optional(ttl=3600)
    def optional() -> Response:
        return run_view("optional")

    @app.post("/plain")
    @idempotency.required
    def plain() -> Response:
        """A view that never touches the extension's connection."""
        record_execution("plain")
        return Response(request.get_data(), 200, {"Content-Type": "text/plain"})

    @app.post("/authenticated")
    def authenticated() -> Response:
        if request.headers.get("Authorization") != "Bearer good":
            return Response(json.dumps({"error": "unauthorized"}), 401)
        return guarded()

    @idempotency.required
    def guarded() -> Response:
        return run_view("authenticated")

    @app.post("/waiting")
    @idempotency.required(wait=5)
    def waiting() -> Response:
        return run_view("waiting")

    return app
