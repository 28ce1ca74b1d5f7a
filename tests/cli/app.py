"""The CLI tests' app: one payment route that declares ``recover=``, one scope.

Its recovery finds that nothing happened (it returns ``None``), so ``recover``
releases every abandoned record: enough to count progress without a processor.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flask import Flask, current_app, jsonify

from flask_idempotency import Idempotency, global_scope
from flask_idempotency.recovery import Abandoned


def nothing_happened(attempt: Abandoned) -> None:
    """The processor never saw it: release. ``CLI_TEST_ON_RECOVER`` (a callable, if
    configured) runs first: a test stops the command from there."""
    hook = current_app.config.get("CLI_TEST_ON_RECOVER")
    if hook is not None:
        hook()
    return None


def create_app(database_url: str, config: Mapping[str, Any] | None = None) -> Flask:
    app = Flask(__name__)
    app.config.update(
        IDEMPOTENCY_DATABASE_URL=database_url,
        IDEMPOTENCY_AUTO_MIGRATE=True,
        IDEMPOTENCY_SCOPE_FUNC=global_scope,
    )
    app.config.update(config or {})
    idempotency = Idempotency(app)

    @app.post("/pay")
    @idempotency.required(recover=nothing_happened)
    def pay() -> Any:
        return jsonify(paid=True), 201

    return app
