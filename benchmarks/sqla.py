"""The Flask-SQLAlchemy subjects: the same charge view, written on ``db.session``.

Most Flask applications on PostgreSQL write through Flask-SQLAlchemy, so the
extension's cost there is measured on that path, against that path's own
baseline (issue 24's "Performance"):

``sqla-bare``
    no idempotency: the charge added to ``db.session``, flushed (the
    ``INSERT ... RETURNING id``), ``db.session.commit()``. Three round trips
    (``BEGIN``, ``INSERT``, ``COMMIT``), as ``bare``'s.
``sqla-pg``
    the extension, ``Idempotency(app, db=db)`` and ``@idempotency.required``,
    the view unchanged. Its first request: the claim (its own asynchronous
    commit, row mode as ``pg``), ``BEGIN``, ``SAVEPOINT`` (the session joins the
    request's transaction, ``join_transaction_mode="create_savepoint"``),
    ``INSERT``, ``RELEASE SAVEPOINT`` (the view's ``commit()``), completion +
    ``COMMIT``.
``sqla-pg-txclaim``
    ``sqla-pg`` with ``IDEMPOTENCY_CLAIM_MODE = "transaction"``, the
    like-for-like of ``pg-txclaim``.
``sqla-handwritten``
    what a team would write by hand on ``db.session``, in one transaction:
    ``INSERT`` of the key's row ``ON CONFLICT DO NOTHING RETURNING``, the
    view's own work exactly as ``sqla-bare`` does it (its charge, its
    ``jsonify`` answer), an ``UPDATE`` storing that answer, one ``COMMIT``. The
    view is the baselines', so what it adds over ``sqla-bare`` is the layer
    alone: building its answer some cheaper way would count as the layer's
    saving. A concurrent
    duplicate's ``INSERT`` waits for the first's commit and then finds its row:
    a replay reads the stored row (``BEGIN``, the ``INSERT`` that does
    nothing, ``SELECT``, ``ROLLBACK``). No lease (there is no committed claim to
    lose), no expiry, no scopes: all of which would only add cost.

The view reads the charge's id after the flush, before ``commit()``: reading
it after would reload the row (``expire_on_commit``), a round trip more in
every subject that says nothing about idempotency.

The models are plain SQLAlchemy declarative classes (not ``db.Model``), so one
process can hold the apps of several subjects (``benchmarks.inprocess``), each
with its own ``SQLAlchemy`` instance, engine and pool. Flask-SQLAlchemy is a
benchmark-only dependency (``benchmarks/requirements-peers.txt``), imported
only when one of these subjects runs.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import psycopg2.extensions
from flask import Flask, Response, request
from sqlalchemy import String, text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from flask_idempotency import Idempotency, global_scope

from .charge import CHARGES_PATH, POOL_SIZE, application_name, created, read_charge

BARE = "sqla-bare"
EXTENSION = "sqla-pg"
EXTENSION_TXCLAIM = "sqla-pg-txclaim"
HANDWRITTEN = "sqla-handwritten"
SUBJECTS = (BARE, EXTENSION, EXTENSION_TXCLAIM, HANDWRITTEN)


class Base(DeclarativeBase):
    pass


class Charge(Base):
    """``bench_charges``, the table every subject writes (``benchmarks.app``)."""

    __tablename__ = "bench_charges"

    id: Mapped[int] = mapped_column(primary_key=True)
    amount: Mapped[int]
    currency: Mapped[str] = mapped_column(String)


KEYS_TABLE = """
CREATE TABLE IF NOT EXISTS bench_sqla_keys (
    key          text        PRIMARY KEY,
    fingerprint  bytea       NOT NULL,
    status       integer,    -- NULL only inside the first request's transaction
    body         text,
    created_at   timestamptz NOT NULL DEFAULT now()
)
"""
CLAIM = text(
    "INSERT INTO bench_sqla_keys (key, fingerprint) VALUES (:key, :fingerprint) "
    "ON CONFLICT (key) DO NOTHING RETURNING true"
)
LOOKUP = text("SELECT fingerprint, status, body FROM bench_sqla_keys WHERE key = :key")
COMPLETE = text("UPDATE bench_sqla_keys SET status = :status, body = :body WHERE key = :key")

KEY_HEADER = "Idempotency-Key"
REPLAYED_HEADER = "Idempotent-Replayed"


def create_table(conn: psycopg2.extensions.connection) -> None:
    with conn, conn.cursor() as cur:
        cur.execute(KEYS_TABLE)


def engine_config(subject: str, dsn: str) -> dict[str, Any]:
    """Flask-SQLAlchemy's configuration: psycopg2, as the raw subjects; a pool as
    large as theirs; sessions labelled for the CPU meter."""
    return {
        "SQLALCHEMY_DATABASE_URI": dsn.replace("postgresql://", "postgresql+psycopg2://", 1),
        "SQLALCHEMY_ENGINE_OPTIONS": {
            "pool_size": POOL_SIZE,
            "connect_args": {"application_name": application_name(subject)},
        },
    }


def register(subject: str, app: Flask, dsn: str, config: dict[str, Any] | None = None) -> None:
    """Add ``subject``'s ``POST /charges`` to ``app``; ``config`` overrides the
    extension's ``IDEMPOTENCY_*`` settings, and its ``BENCH_CONNECT_ARGS`` are
    added to the engine's (the round-trip test's counting connection)."""
    from flask_sqlalchemy import SQLAlchemy

    config = dict(config or {})
    engine = engine_config(subject, dsn)
    engine["SQLALCHEMY_ENGINE_OPTIONS"]["connect_args"].update(config.pop("BENCH_CONNECT_ARGS", {}))
    app.config.update(engine)
    db = SQLAlchemy(app)

    def add_charge(amount: int, currency: str) -> int:
        charge = Charge(amount=amount, currency=currency)
        db.session.add(charge)
        db.session.flush()
        return charge.id

    if subject == HANDWRITTEN:
        _handwritten(app, db, add_charge)
        return

    if subject == BARE:

        @app.post(CHARGES_PATH)
        def sqla_bare_charge() -> Response:
            amount, currency = read_charge()
            row_id = add_charge(amount, currency)
            db.session.commit()
            return created(row_id, amount, currency)

        return

    app.config["IDEMPOTENCY_SCOPE_FUNC"] = global_scope
    if subject == EXTENSION_TXCLAIM:
        app.config["IDEMPOTENCY_CLAIM_MODE"] = "transaction"
    app.config.update(config)
    idempotency = Idempotency(app, db=db)

    @app.post(CHARGES_PATH)
    @idempotency.required
    def sqla_charge() -> Response:
        amount, currency = read_charge()
        row_id = add_charge(amount, currency)
        db.session.commit()
        return created(row_id, amount, currency)


def _answer(status: int, body: str, replayed: bool) -> Response:
    response = Response(body, status=status, mimetype="application/json")
    response.headers[REPLAYED_HEADER] = "true" if replayed else "false"
    return response


def _problem(status: int, detail: str) -> Response:
    return Response(json.dumps({"detail": detail}), status=status, mimetype="application/json")


def _handwritten(app: Flask, db: Any, add_charge: Any) -> None:
    @app.post(CHARGES_PATH)
    def sqla_handwritten_charge() -> Response:
        key = request.headers.get(KEY_HEADER)
        if not key:
            return _problem(400, f"{KEY_HEADER} is required")
        fingerprint = hashlib.sha256(request.get_data()).digest()
        session = db.session
        # The claim: the key's row, in the business transaction. A duplicate in
        # flight waits here for the first one's COMMIT, then finds its row.
        if session.execute(CLAIM, {"key": key, "fingerprint": fingerprint}).first() is None:
            row = session.execute(LOOKUP, {"key": key}).first()
            session.rollback()
            if row is None:  # cannot happen within READ COMMITTED; said, not guessed
                return _problem(409, "a request with this key is in progress; retry")
            if bytes(row.fingerprint) != fingerprint:
                return _problem(422, "this key was used with a different request body")
            return _answer(row.status, row.body, replayed=True)
        # The view itself, as ``sqla-bare`` runs it; the layer stores its answer.
        amount, currency = read_charge()
        row_id = add_charge(amount, currency)
        response = created(row_id, amount, currency)
        session.execute(
            COMPLETE,
            {"status": response.status_code, "body": response.get_data(as_text=True), "key": key},
        )
        session.commit()
        response.headers[REPLAYED_HEADER] = "false"
        return response
