"""The example payments API (CONTRACT §2): flask-idempotency the way a payments team uses it.

``create_app()`` reads the environment; tests pass ``test_config`` to override
any key (``DATABASE_URL``, ``PROCESSOR_CLIENT`` for an in-process fake, any
``IDEMPOTENCY_*``). ``wsgi.py`` serves it with gunicorn.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from flask import Flask

from example_app import charges, observability, orders, receipts
from example_app.auth import api_key_scope
from example_app.config import apply_defaults, check_timeouts, config_from_env, secret_key
from example_app.embedded import embedded_database_url
from example_app.errors import register_error_handlers
from example_app.extensions import idempotency
from example_app.fulfilment import client_for
from example_app.processor_client import (
    HttpProcessorClient,
    InProcessProcessorClient,
    ProcessorClient,
    shared_processor,
)

__all__ = ["create_app", "idempotency"]


def create_app(
    test_config: Mapping[str, Any] | None = None, *, instance_path: str | None = None
) -> Flask:
    """Build the app; a bad configuration raises ``ValueError`` here, at start-up."""
    app = Flask(__name__, instance_path=instance_path, instance_relative_config=True)
    app.config.from_mapping(config_from_env(os.environ))
    app.config.from_mapping(receipts.config_from_env(os.environ))
    if test_config is not None:
        app.config.from_mapping(test_config)
    if not app.config.get("SECRET_KEY"):
        app.config["SECRET_KEY"] = secret_key(os.environ, app.instance_path)
    timeout = check_timeouts(app.config)
    apply_defaults(app.config, api_key_scope)
    receipts.apply_defaults(app.config)
    if app.config.get("IDEMPOTENCY_DATABASE_URL") is None:
        app.config["IDEMPOTENCY_DATABASE_URL"] = embedded_database_url(app.instance_path)

    app.extensions[charges.PROCESSOR_CLIENT_KEY] = _processor_client(app.config, timeout)
    app.extensions[orders.FULFILMENT_CLIENT_KEY] = app.config.get(
        "FULFILMENT_CLIENT"
    ) or client_for(app.config.get("FULFILMENT_URL"), timeout)
    idempotency.init_app(app)  # migrates (IDEMPOTENCY_AUTO_MIGRATE) under a lock
    register_error_handlers(app)
    app.register_blueprint(charges.bp)
    app.register_blueprint(orders.bp)  # POST /v1/orders: the phases example
    receipts.init_app(app)  # GET /v1/receipts (and the embedded path if EVENTS_EMBEDDED)
    observability.init_app(app)  # GET /metrics; OTLP traces if OTEL_EXPORTER_OTLP_* is set
    return app


def _processor_client(config: Mapping[str, Any], timeout: float) -> ProcessorClient:
    """``PROCESSOR_CLIENT`` if given; else HTTP to ``PROCESSOR_URL``; else the in-process fake."""
    client: ProcessorClient | None = config.get("PROCESSOR_CLIENT")
    if client is not None:
        return client
    url = config.get("PROCESSOR_URL")
    if url:
        return HttpProcessorClient(url, timeout)
    return InProcessProcessorClient(shared_processor(), timeout)
