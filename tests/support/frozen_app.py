"""The app of the frozen-PostgreSQL test: one idempotent route and nothing else.

Its view runs no SQL of its own (a statement of the application's on a frozen
server would hang for as long as the freeze, whatever the extension does), so
every wait the test measures is the extension's. Each execution names itself
with a fresh id in the body: a key executed twice would show two ids.

Configured from the environment (gunicorn starts it): ``DATABASE_URL``,
``FROZEN_APP_STATEMENT_TIMEOUT``, ``FROZEN_APP_POOL_SIZE``,
``FROZEN_APP_CLAIM_MODE``, ``FROZEN_APP_BREAKER_COOLDOWN``, and
``FROZEN_APP_ENGINE=1`` for an ``Idempotency(app, db=db)`` app on a SQLAlchemy
engine.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from typing import Any

from flask import Flask, Response, g, jsonify

from flask_idempotency import Idempotency


def _options() -> dict[str, Any]:
    options: dict[str, Any] = {
        "statement_timeout": float(os.environ.get("FROZEN_APP_STATEMENT_TIMEOUT", "1")),
        "pool_size": int(os.environ.get("FROZEN_APP_POOL_SIZE", "10")),
    }
    cooldown = os.environ.get("FROZEN_APP_BREAKER_COOLDOWN")
    if cooldown:
        options["breaker_cooldown"] = float(cooldown)
    return options


def create_app() -> Flask:
    # The store's INFO lines too (the breaker's closing), on gunicorn's stderr.
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("flask_idempotency.store").setLevel(logging.INFO)
    app = Flask(__name__)
    dsn = os.environ["DATABASE_URL"]
    options = _options()
    app.config.update(
        IDEMPOTENCY_AUTO_MIGRATE=True,
        # Short: a claim whose completion was cut by the freeze frees its key soon after.
        IDEMPOTENCY_LEASE=3,
        IDEMPOTENCY_CLAIM_MODE=os.environ.get("FROZEN_APP_CLAIM_MODE", "row"),
    )
    if os.environ.get("FROZEN_APP_ENGINE") == "1":
        from flask_sqlalchemy import SQLAlchemy

        pool_size = options.pop("pool_size")
        app.config["SQLALCHEMY_DATABASE_URI"] = dsn
        app.config["SQLALCHEMY_ENGINE_OPTIONS"] = {"pool_size": pool_size, "max_overflow": 0}
        app.config["IDEMPOTENCY_DATABASE_OPTIONS"] = options
        db = SQLAlchemy(app)
        idempotency = Idempotency(app, db=db)
    else:
        app.config["IDEMPOTENCY_DATABASE_URL"] = dsn
        app.config["IDEMPOTENCY_DATABASE_OPTIONS"] = options
        idempotency = Idempotency(app)

    @app.before_request
    def start_clock() -> None:
        g.frozen_app_started = time.monotonic()

    @app.after_request
    def report_time(response: Response) -> Response:
        """How long the app itself took (the rest of a client's wait is queueing)."""
        started = g.get("frozen_app_started")
        if started is not None:
            response.headers["X-App-Seconds"] = f"{time.monotonic() - started:.3f}"
        return response

    @app.get("/healthz")
    def healthz() -> str:
        return "ok"

    @app.post("/work")
    @idempotency.required
    def work() -> Response:
        response = jsonify(execution=uuid.uuid4().hex, pid=os.getpid())
        response.status_code = 201
        return response

    return app
