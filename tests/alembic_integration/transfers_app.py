"""A small Flask-SQLAlchemy + Flask-Migrate application using the extension, run by
tests/alembic_integration through real ``flask db ...`` and ``flask idempotency ...`` subprocesses.

Read from the environment: ``TRANSFERS_DATABASE_URL`` (an SQLAlchemy URL, which
picks the dialect; the extension uses the same engine through ``db=db``);
``TRANSFERS_MEMO=1`` adds a column to the model, the change autogenerate must
detect.

The application's own ``include_object`` keeps ``legacy_ledger`` out of
autogenerate: the extension's filter must leave that hook working.
"""

from __future__ import annotations

import os
from typing import Any

from flask import Flask
from flask_migrate import Migrate
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy import Integer, String
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from flask_idempotency import Idempotency


class Base(DeclarativeBase):
    pass


db = SQLAlchemy(model_class=Base)


class Transfer(db.Model):  # type: ignore[name-defined,misc]
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    amount: Mapped[int] = mapped_column(Integer)
    if os.environ.get("TRANSFERS_MEMO") == "1":
        memo: Mapped[str | None] = mapped_column(String(200))


def include_object(
    obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any
) -> bool:
    return not (type_ == "table" and name == "legacy_ledger")


def create_app() -> Flask:
    app = Flask(__name__)
    app.config["SQLALCHEMY_DATABASE_URI"] = os.environ["TRANSFERS_DATABASE_URL"]
    db.init_app(app)
    Migrate(app, db, include_object=include_object)
    Idempotency(app, db=db)
    return app
