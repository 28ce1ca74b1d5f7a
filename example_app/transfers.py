"""The smallest Flask-SQLAlchemy application with the extension: money transfers.

Run it on your own database (the extension's tables and the model's are
created at start)::

    DATABASE_URL=postgresql+psycopg2://localhost/payments flask --app example_app.transfers run

A transfer is written through ``db.session`` and committed by the view, as any
Flask-SQLAlchemy view does. Because the extension was given ``db``, that
commit happens in the request's transaction: the transfer row is kept exactly
when the answer is stored, so a retry under the same key gets the same answer
and never a second transfer, whatever failed in between.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from flask import Flask, request
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from flask_idempotency import Idempotency, authorization_scope


class Base(DeclarativeBase):
    pass


db = SQLAlchemy(model_class=Base)
idempotency = Idempotency()


class Transfer(db.Model):  # type: ignore[name-defined,misc]
    id: Mapped[int] = mapped_column(primary_key=True)
    source: Mapped[str]
    destination: Mapped[str]
    amount: Mapped[int]


def create_app(config: Mapping[str, Any] | None = None) -> Flask:
    app = Flask(__name__)
    app.config.update(
        SQLALCHEMY_DATABASE_URI=os.environ.get("DATABASE_URL", "postgresql://localhost/payments"),
        # Each API key's keys are its own: the scope is the Authorization header.
        IDEMPOTENCY_SCOPE_FUNC=authorization_scope,
        IDEMPOTENCY_AUTO_MIGRATE=True,
    )
    app.config.update(config or {})
    db.init_app(app)
    idempotency.init_app(app, db=db)
    with app.app_context():
        db.create_all()

    @app.post("/transfers")
    @idempotency.required
    def create_transfer() -> tuple[dict[str, Any], int]:
        body = request.get_json(force=True)
        amount = body.get("amount")
        if not isinstance(amount, int) or isinstance(amount, bool) or amount <= 0:
            return {"error": "amount must be a positive integer"}, 400  # not stored
        transfer = Transfer(source=body["from"], destination=body["to"], amount=amount)
        db.session.add(transfer)
        db.session.commit()
        return {"id": transfer.id, "amount": transfer.amount}, 201

    @app.get("/transfers/<int:transfer_id>")
    def show_transfer(transfer_id: int) -> tuple[dict[str, Any], int]:
        transfer = db.session.get(Transfer, transfer_id)
        if transfer is None:
            return {"error": "not found"}, 404
        return {"id": transfer.id, "amount": transfer.amount}, 200

    return app
