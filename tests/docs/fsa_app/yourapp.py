"""The small Flask-SQLAlchemy app that docs/testing.md's conftest is written for:
an app factory, Flask-Migrate, ``Idempotency(app, db=db)``, one charges route.
tests/docs copies it (and ``migrations/``) next to the page's snippets."""

from __future__ import annotations

import os
from typing import Any

from flask import Flask, request
from flask_migrate import Migrate
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy import String
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from flask_idempotency import Idempotency


class Base(DeclarativeBase):
    pass


db = SQLAlchemy(model_class=Base)
migrate = Migrate()
idempotency = Idempotency()


class Charge(db.Model):  # type: ignore[name-defined,misc]
    __tablename__ = "charges"
    id: Mapped[int] = mapped_column(primary_key=True)
    amount: Mapped[int]
    currency: Mapped[str] = mapped_column(String(3))


def create_app(config: dict[str, Any] | None = None) -> Flask:
    app = Flask(__name__)
    app.config["SQLALCHEMY_DATABASE_URI"] = os.environ.get("DATABASE_URL")
    app.config.update(config or {})
    db.init_app(app)
    migrate.init_app(app, db)
    idempotency.init_app(app, db=db)

    @app.post("/v1/charges")
    @idempotency.required
    def create_charge() -> tuple[dict[str, Any], int]:
        body = request.get_json()
        charge = Charge(amount=body["amount"], currency=body["currency"])
        db.session.add(charge)
        db.session.commit()  # kept only when the answer is stored
        return {"id": charge.id, "amount": charge.amount}, 201

    return app
