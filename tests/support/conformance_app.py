"""The fixture routes of the public anyonce conformance suite, behind the extension.

anyonce (github.com/sns45/anyonce, ``conformance/README.md``) describes the
fixture any implementation mounts so that its vectors can run: ``/echo``,
``/status/<code>``, ``/slow``, ``/large``, ``/counter`` and ``/reset``, every
POST counting one handler invocation. This is that fixture, written for
Flask; ``tests/core/test_conformance.py`` states the vectors' expectations.

Served by gunicorn (one worker: the counter is per process, as the suite
expects). ``CONFORMANCE_PROFILE`` picks the profile, ``CONFORMANCE_STORE_ALL``
stores every answer below 500 (the reference's choice, which the extension
can express through ``IDEMPOTENCY_SHOULD_STORE``).
"""

from __future__ import annotations

import os
import threading
import time

from flask import Flask, Response, jsonify, request

from flask_idempotency import Idempotency
from flask_idempotency.scopes import global_scope


def create_app() -> Flask:
    app = Flask(__name__)
    app.config.update(
        IDEMPOTENCY_DATABASE_URL=os.environ["DATABASE_URL"],
        IDEMPOTENCY_AUTO_MIGRATE=True,
        IDEMPOTENCY_PROFILE=os.environ.get("CONFORMANCE_PROFILE", "stripe"),
        # The suite's requests carry no credentials: one client, one explicit scope.
        IDEMPOTENCY_SCOPE_FUNC=global_scope,
    )
    if os.environ.get("CONFORMANCE_STORE_ALL"):
        app.config["IDEMPOTENCY_SHOULD_STORE"] = lambda status: status < 500
    idempotency = Idempotency(app)
    lock = threading.Lock()
    invocations = [0]

    def count() -> None:
        with lock:
            invocations[0] += 1

    @app.post("/echo")
    @idempotency.required
    def echo() -> Response:
        count()
        content_type = request.headers.get("Content-Type", "application/octet-stream")
        return Response(request.get_data(), 201, content_type=content_type)

    @app.post("/status/<int:code>")
    @idempotency.required
    def status(code: int) -> Response:
        count()
        return Response(f"status:{code}", code, content_type="text/plain")

    @app.post("/slow")
    @idempotency.required
    def slow() -> Response:
        count()
        ms = int(request.args.get("ms", "0"))
        time.sleep(ms / 1000)
        return Response(f"slept:{ms}", 200, content_type="text/plain")

    @app.post("/large")
    @idempotency.required
    def large() -> Response:
        count()
        size = int(request.args.get("bytes", "0"))
        return Response(b"x" * size, 200, content_type="application/octet-stream")

    @app.route("/counter", methods=["GET", "POST"])
    @idempotency.required
    def counter() -> Response:
        """Behind the layer: a key on a GET must be ignored."""
        with lock:
            return jsonify(count=invocations[0])

    @app.post("/reset")
    def reset() -> tuple[str, int]:
        with lock:
            invocations[0] = 0
        return "", 204

    return app
