"""A user's own app on an installed flask-idempotency: what tests/tooling/test_install.py runs.

Written as someone who did ``pip install flask-idempotency`` would write it: it
imports only Flask and the installed package (nothing from this repository's
tests or example app), so it runs inside a fresh virtualenv holding the wheel.

Configuration comes from the environment: ``IDEMPOTENCY_DATABASE_URL``
(required) and ``IDEMPOTENCY_REDIS_URL`` (optional, needs the ``[redis]``
extra). Create the tables first with
``flask --app path/to/smoke_app.py idempotency migrate``.

``python smoke_app.py`` drives the app with Flask's test client and prints one
JSON report on stdout; the test asserts on it, so a failure shows every answer:

- a first charge, its retry, and the same key with another body;
- a duplicate sent from another thread while the first one is still in the
  view (held on an event, so the 409 is deterministic), then its replay.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import threading
import uuid
from collections.abc import Callable
from importlib import metadata, util
from typing import Any, TypeVar

from flask import Flask, Response, jsonify, request
from flask.testing import FlaskClient

import flask_idempotency
from flask_idempotency import Idempotency

F = TypeVar("F", bound=Callable[..., Any])

TOKEN = "sk_smoke_test"
#: Seconds to wait for the held request to reach the view (or for anything else).
PATIENCE = 30.0

idempotency = Idempotency()


class Gate:
    """Holds a charge that asked for it (``"hold": true``) inside the view until released."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.views_run = 0
        self._lock = threading.Lock()

    def count(self) -> None:
        with self._lock:
            self.views_run += 1


gate = Gate()


def require_api_key(view: F) -> F:
    """The app's own authentication, before the idempotency check (a 401 is never stored)."""

    @functools.wraps(view)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return jsonify(error={"code": "missing_api_key"}), 401
        return view(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def create_app() -> Flask:
    app = Flask(__name__)
    app.config["IDEMPOTENCY_DATABASE_URL"] = os.environ["IDEMPOTENCY_DATABASE_URL"]
    app.config["SECRET_KEY"] = "smoke-app-secret"  # the Redis cache is off without one
    redis_url = os.environ.get("IDEMPOTENCY_REDIS_URL")
    if redis_url:
        app.config["IDEMPOTENCY_REDIS_URL"] = redis_url
    idempotency.init_app(app)

    @app.post("/v1/charges")
    @require_api_key
    @idempotency.required
    def create_charge() -> tuple[Response, int]:
        gate.count()
        body = request.get_json()
        if body.get("hold"):
            gate.entered.set()
            if not gate.release.wait(PATIENCE):
                raise RuntimeError("the held charge was never released")
        # The request's own transaction: a real app writes its rows here, and
        # they commit together with the stored answer.
        with idempotency.connection().cursor() as cur:
            cur.execute("SELECT txid_current()")
            row = cur.fetchone()
        charge = {
            "id": f"ch_{uuid.uuid4().hex}",
            "amount": body["amount"],
            "currency": body["currency"],
            "txid": row[0] if row else None,
        }
        return jsonify(charge), 201

    return app


def answer(response: Any) -> dict[str, Any]:
    """What the test needs of one answer."""
    data: bytes = response.get_data()
    payload = response.get_json(silent=True)
    error = payload.get("error") if isinstance(payload, dict) else None
    return {
        "status": response.status_code,
        "replayed": response.headers.get("Idempotent-Replayed"),
        "retry_after": response.headers.get("Retry-After"),
        "content_type": response.headers.get("Content-Type"),
        "body": data.decode("utf-8", "replace"),
        "code": error.get("code") if isinstance(error, dict) else None,
    }


def post(client: FlaskClient, key: str, body: dict[str, Any]) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {TOKEN}", "Idempotency-Key": key}
    return answer(client.post("/v1/charges", json=body, headers=headers))


def drive(app: Flask) -> dict[str, Any]:
    """Every step of the scenario, in order; keys are unique to this run."""
    run = uuid.uuid4().hex[:12]
    client = app.test_client()
    charge = {"amount": 1500, "currency": "usd"}
    report: dict[str, Any] = {
        "first": post(client, f"smoke-{run}-1", charge),
        "retry": post(client, f"smoke-{run}-1", charge),
        "other_body": post(client, f"smoke-{run}-1", {**charge, "amount": 2500}),
    }

    held_key = f"smoke-{run}-2"
    held_body = {**charge, "hold": True}
    held: dict[str, Any] = {}

    def send_held() -> None:
        held.update(post(app.test_client(), held_key, held_body))

    thread = threading.Thread(target=send_held, name="smoke-held-charge")
    thread.start()
    try:
        if not gate.entered.wait(PATIENCE):
            raise RuntimeError("the held charge never reached the view")
        report["duplicate_in_flight"] = post(client, held_key, held_body)
    finally:
        gate.release.set()
        thread.join(PATIENCE)
    report["held"] = held
    report["held_retry"] = post(client, held_key, held_body)
    report["views_run"] = gate.views_run
    return report


def main() -> int:
    app = create_app()
    try:
        report = drive(app)
    finally:
        app.extensions["idempotency"].close()
    report["installed"] = {
        "module": flask_idempotency.__file__,
        "version": metadata.version("flask-idempotency"),
        "__version__": flask_idempotency.__version__,
        "python": sys.version.split()[0],
        "redis": util.find_spec("redis") is not None,
        "typing_extensions": util.find_spec("typing_extensions") is not None,
    }
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
