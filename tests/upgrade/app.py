"""The app that both releases serve during a rolling upgrade (``upgrade.app:create_app()``).

It uses only what 0.2.0 and this checkout both offer from outside:
``Idempotency(app)``, ``@idempotency.required``, ``idempotency.derived_key()``
and configuration keys. Nothing here may reach into the package's internals,
since the same file is imported by workers of the previous release (PYTHONPATH
pointing at a tree taken from git) and by workers of this checkout.

Environment (set by ``rollout.Stack``):

- ``UPGRADE_RELEASE``: ``previous`` or ``current``: which configuration spelling
  to use (``CONFIG``); the package itself is whichever one is on the path.
- ``UPGRADE_DATABASE_URL``, ``UPGRADE_CLAIM_MODE``, ``UPGRADE_REDIS_URL`` (optional).
- ``UPGRADE_GATE_DIR``: where a view told to wait (``{"gate": name}``) looks for
  the file ``name`` before it goes on, so a test holds a request in flight
  without sleeping.

Every run of the view is recorded in ``upgrade_runs`` on a connection of its own
(autocommit), so a test counts the runs of every process, kept or rolled back.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import psycopg2
from flask import Flask, Request, Response, jsonify, request

import flask_idempotency
from flask_idempotency import Idempotency

#: The table of view runs (the fixture creates it; the app only inserts).
RUNS_TABLE = """
CREATE TABLE IF NOT EXISTS upgrade_runs (
    id      bigserial PRIMARY KEY,
    key     text NOT NULL,
    release text NOT NULL,
    pid     integer NOT NULL
)
"""

#: The header naming the request's principal, percent-encoded UTF-8, so a test
#: can use any Unicode scope through HTTP (header values are Latin-1 on the wire).
SCOPE_HEADER = "X-Upgrade-Scope"

#: The purposes whose derived keys every answer carries (one of them non-ASCII).
PURPOSES = ("processor", "events", "rückbuchung")

#: How long a gated view waits for its gate before it gives up (a test that
#: forgot to open it then fails instead of hanging).
GATE_TIMEOUT = 30.0


def scope_from_header(req: Request) -> str | None:
    """The principal is whatever the client names: enough for a test app."""
    raw = req.headers.get(SCOPE_HEADER)
    return None if raw is None else unquote(raw, encoding="utf-8", errors="strict")


def _previous_config(env: Mapping[str, str]) -> dict[str, Any]:
    """0.2.0's spelling (it also reads the grouped keys used here)."""
    config: dict[str, Any] = {
        "IDEMPOTENCY_DATABASE_URL": env["UPGRADE_DATABASE_URL"],
        "IDEMPOTENCY_SCOPE_FUNC": scope_from_header,
        "IDEMPOTENCY_CLAIM_MODE": env.get("UPGRADE_CLAIM_MODE", "row"),
    }
    if env.get("UPGRADE_REDIS_URL"):
        config["IDEMPOTENCY_REDIS_URL"] = env["UPGRADE_REDIS_URL"]
    return config


def _current_config(env: Mapping[str, str]) -> dict[str, Any]:
    """This checkout's spelling: the same keys today. The cache needs a server
    secret from 0.3.0 on (contract section 7); 0.2.0 ignores ``SECRET_KEY``."""
    return _previous_config(env)


#: Configuration per release: where the spelling of a key changes, only the
#: ``current`` entry changes, and the previous release keeps its own.
CONFIG: dict[str, Callable[[Mapping[str, str]], dict[str, Any]]] = {
    "previous": _previous_config,
    "current": _current_config,
}


def create_app() -> Flask:
    env = os.environ
    release = env["UPGRADE_RELEASE"]
    dsn = env["UPGRADE_DATABASE_URL"]
    gates = Path(env["UPGRADE_GATE_DIR"])
    app = Flask(__name__)
    # The same secret on every worker of both releases, as a deployment has.
    app.config["SECRET_KEY"] = "upgrade-test-secret"
    app.config.update(CONFIG[release](env))
    idempotency = Idempotency(app)

    def record_run(key: str) -> None:
        conn = psycopg2.connect(dsn)
        conn.autocommit = True
        try:
            with conn.cursor() as cur:
                cur.execute(
                    "INSERT INTO upgrade_runs (key, release, pid) VALUES (%s, %s, %s)",
                    (key, release, os.getpid()),
                )
        finally:
            conn.close()

    @app.get("/release")
    def which_release() -> Response:
        """Which package this process imported: the tests check that each server
        runs the release it is meant to."""
        return jsonify(
            release=release,
            package=str(Path(flask_idempotency.__file__).resolve().parent),
            version=flask_idempotency.__version__,
        )

    @app.post("/charges")
    @idempotency.required
    def charges() -> Response:
        """The scripted view: the JSON body says what to do."""
        body = request.get_json()
        record_run(request.headers["Idempotency-Key"])
        gate = body.get("gate")
        if gate is not None:
            deadline = time.monotonic() + GATE_TIMEOUT
            while not (gates / gate).exists():
                if time.monotonic() > deadline:
                    return Response("gate never opened", 500)
                time.sleep(0.02)
        payload = {
            "amount": body.get("amount"),
            # Which release ran the view: a replay elsewhere carries it unchanged.
            "release": release,
            "pid": os.getpid(),
            "derived": {purpose: idempotency.derived_key(purpose) for purpose in PURPOSES},
        }
        response = jsonify(payload)
        response.status_code = int(body.get("status", 201))
        response.headers["Location"] = f"/charges/{os.getpid()}-{time.time_ns()}"
        response.headers["ETag"] = f'"{time.time_ns()}"'
        response.headers["X-Upgrade"] = "kept"
        return response

    @app.post("/notes")
    @idempotency.required
    def notes() -> Response:
        """A view of a body that is not JSON (compared as bytes, with its media type
        from 0.3.0 on): the bytes back, upper-cased, with the release that ran it."""
        record_run(request.headers["Idempotency-Key"])
        text = request.get_data().upper() + b" / " + release.encode()
        return Response(text, 201, {"Content-Type": "text/plain; charset=utf-8"})

    return app
