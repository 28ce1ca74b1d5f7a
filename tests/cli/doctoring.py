"""Helpers of the doctor's tests: an app, and its diagnosis by check name."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from flask import Flask

from flask_idempotency import Idempotency, global_scope
from flask_idempotency.cli.doctor import diagnose
from flask_idempotency.cli.doctor.base import Check, Options


def make_app(database_url: str, **config: Any) -> Flask:
    app = Flask(__name__)
    app.config.update(
        IDEMPOTENCY_DATABASE_URL=database_url,
        IDEMPOTENCY_SCOPE_FUNC=global_scope,
        SECRET_KEY="doctor-test-secret",  # the Redis cache is off (a FAIL) without one
    )
    app.config.update(config)
    Idempotency(app)
    return app


@contextmanager
def app_on(database_url: str, **config: Any) -> Iterator[Flask]:
    app = make_app(database_url, **config)
    try:
        yield app
    finally:
        app.extensions["idempotency"].close()


def checks(app: Flask, **options: Any) -> dict[str, Check]:
    """The diagnosis of ``app`` by check name (``options``: the doctor's :class:`Options`)."""
    with app.app_context():
        found = diagnose(app.extensions["idempotency"], app, Options(**options))
    return {check.name: check for check in found}


def check(app: Flask, name: str, **options: Any) -> Check:
    return checks(app, **options)[name]


def doctor(app: Flask, *args: str) -> tuple[int, str]:
    result = app.test_cli_runner().invoke(args=["idempotency", "doctor", *args])
    return result.exit_code, result.output


def migrated(app: Flask) -> Flask:
    state = app.extensions["idempotency"]
    state.store.migrate(state.settings.migration_dirs)
    return app
