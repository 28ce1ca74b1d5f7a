"""The doctor on trust boundaries (contract section 7, issue 37 item 10): a scope
resting on ``Authorization`` in an app with browser sessions, and expired rows
that nobody purges."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from flask import Flask
from flask_login import LoginManager  # type: ignore[import-untyped]

from flask_idempotency import Idempotency, default_scope, user_scope
from support.pg_query import query

from .doctoring import app_on, check, migrated


@contextmanager
def app_with_route(database_url: str, **config: Any) -> Iterator[Flask]:
    """An app with one decorated route, as the doctor finds routes."""
    app = Flask(__name__)
    app.config.update(IDEMPOTENCY_DATABASE_URL=database_url, SECRET_KEY="doctor-test-secret")
    app.config.update(config)
    idem = Idempotency(app)

    @app.post("/pay")
    @idem.required
    def pay() -> str:
        return "paid"

    try:
        yield app
    finally:
        app.extensions["idempotency"].close()


def test_a_scope_on_authorization_in_a_session_app_is_a_warning(clean_db: str) -> None:
    """A user logged in by flask-login is scoped by user, but one whose session has
    ended (or a route the app serves to anonymous browsers) falls back to the
    ``Authorization`` header: behind a gateway's shared credential, one scope."""
    with app_with_route(clean_db, IDEMPOTENCY_SCOPE_FUNC=default_scope) as app:
        LoginManager(app)
        found = check(app, "scope")
        assert found.status == "warn", found
        assert "Authorization" in found.detail and "flask-login" in found.detail
        assert found.fix is not None and "scope function" in found.fix
    # The same scope in an app without sessions, or a scope naming the user, is fine.
    with app_with_route(clean_db, IDEMPOTENCY_SCOPE_FUNC=default_scope) as app:
        assert check(app, "scope").status == "ok"
    with app_with_route(clean_db, IDEMPOTENCY_SCOPE_FUNC=user_scope(lambda: None)) as app:
        LoginManager(app)
        assert check(app, "scope").status == "ok"


def test_expired_rows_nobody_purges_are_a_warning_with_the_command(clean_db: str) -> None:
    with app_on(clean_db) as app:
        migrated(app)
        assert check(app, "purge").status == "ok"
        for age in ("1 minute", "3 days"):
            query(
                clean_db,
                "INSERT INTO idempotency_records (record_key, fingerprint, state, created_at,"
                " expires_at, completed_at, status_code, headers, body) VALUES (%s, %s,"
                " 'completed', now() - interval '4 days', now() - %s::interval, now(), 201,"
                " '[]', 'answer')",
                (uuid.uuid4().bytes * 2, b"f" * 32, age),
            )
        found = check(app, "purge")
        assert found.status == "warn", found
        assert (
            "2 expired record(s)" in found.detail and "3 d" in found.detail or "72" in found.detail
        )
        assert found.fix is not None and "flask idempotency purge" in found.fix
