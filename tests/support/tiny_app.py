"""A tiny Flask app for testing GunicornServer, independent of the project.

The support code must be testable before (and without) the example app, and
a failure here should point at the harness, not at the payments code.
"""

from __future__ import annotations

import os
import threading

from flask import Flask, Response, jsonify, request


def create_app() -> Flask:
    """The app factory gunicorn calls: ``support.tiny_app:create_app()``."""
    app = Flask(__name__)

    @app.get("/healthz")
    def healthz() -> str:
        return "ok"

    @app.get("/whoami")
    def whoami() -> Response:
        """Which process, thread and client connection served the request."""
        return jsonify(
            pid=os.getpid(),
            thread=threading.get_ident(),
            remote_port=request.environ.get("REMOTE_PORT"),
            env=os.environ.get("TINY_APP_MARKER"),
        )

    @app.post("/echo")
    def echo() -> Response:
        """The request body back, byte for byte, with its content type."""
        return Response(
            request.get_data(),
            status=200,
            content_type=request.content_type or "application/octet-stream",
            headers={"X-Echo-Length": str(request.content_length or 0)},
        )

    return app
