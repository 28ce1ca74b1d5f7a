"""The package's public names and its import cost.

The names below are what applications import; a change to them is a change of
the public API and must be made here on purpose (and in the changelog).
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys

import pytest

PUBLIC = {
    "flask_idempotency": [
        "Abandoned",
        "Idempotency",
        "IdempotencyError",
        "InvalidKey",
        "KeyReused",
        "LeaseLost",
        "MalformedBody",
        "MissingKey",
        "RequestInProgress",
        "ResponseTooLarge",
        "SchemaMissing",
        "SchemaOutdated",
        "ScopeUnavailable",
        "StoreUnavailable",
        "authorization_scope",
        "default_scope",
        "default_should_store",
        "global_scope",
        "user_scope",
    ],
    "flask_idempotency.celery": [
        "IdempotentTask",
        "TaskDeferred",
        "TaskKeyMissing",
        "TaskKeyReused",
        "TaskPublisher",
        "TaskWorkerLost",
    ],
    # The client half: requests and httpx names load on first use (the `client` extra).
    "flask_idempotency.client": [
        "AsyncIdempotentTransport",
        "CallEvent",
        "CallOutcome",
        "IdempotentAdapter",
        "IdempotentSession",
        "IdempotentTransport",
        "KeyReused",
        "RetryBudget",
        "RetryPolicy",
        "purpose_key",
    ],
    "flask_idempotency.events": [
        "ConsumerOutcome",
        "ConsumerWorker",
        "Delivery",
        "EmbeddedEvents",
        "Relay",
        "Subscription",
    ],
    # gunicorn.conf.py's one import: the hooks gunicorn reads by name.
    "flask_idempotency.gunicorn": ["child_exit", "on_exit", "on_starting", "post_worker_init"],
    "flask_idempotency.observability": [
        "Observer",
        "RequestEvent",
        "RequestOutcome",
        "Stage",
        "attach",
    ],
    "flask_idempotency.testing": ["IdempotencyDatabase", "assert_idempotent", "serve_app"],
}


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_public_names_are_pinned(module: str) -> None:
    imported = importlib.import_module(module)
    assert sorted(imported.__all__) == sorted(PUBLIC[module])
    for name in imported.__all__:
        getattr(imported, name)  # every listed name resolves


def test_the_client_loads_neither_http_library_until_asked() -> None:
    """The example app imports ``purpose_key`` without the ``client`` extra installed."""
    code = (
        "import json, sys; from flask_idempotency.client import purpose_key, RetryPolicy;"
        "print(json.dumps(sorted(m for m in sys.modules if m in ('requests', 'httpx'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout
    assert json.loads(out) == []


def test_importing_the_package_loads_no_cli_completer_or_broker_module() -> None:
    """A web worker imports the extension; the CLI, the completer, the relay, the
    consumer, the broker client and gunicorn's hooks load only when something uses them."""
    code = (
        "import json, sys, flask_idempotency;"
        "print(json.dumps(sorted(m for m in sys.modules"
        " if m.startswith(('flask_idempotency', 'kombu', 'amqp', 'click_')))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout
    loaded = set(json.loads(out))
    unwanted = {
        "flask_idempotency.cli",
        "flask_idempotency.completer",
        "flask_idempotency.events.amqp",
        "flask_idempotency.cli.relay",
        "flask_idempotency.events.consumer",
        "flask_idempotency.events.relay",
        "flask_idempotency.gunicorn",  # gunicorn.conf.py's, in the master
        "kombu",
        "amqp",
    }
    assert loaded & unwanted == set(), sorted(loaded & unwanted)
    assert "flask_idempotency.runtime" in loaded  # the sanity check: it did import
