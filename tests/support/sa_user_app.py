"""A user's own small Flask-SQLAlchemy app, as the docs' quickstart writes one.

Copied into a project folder of its own and run under gunicorn from a fresh
virtualenv holding only the wheel and its ``[sqlalchemy]`` extra
(``tests/tooling/test_install.py``). Its engine pool is small on purpose (two
connections against gunicorn's sixteen threads per worker), and its view sleeps
after ``commit()``, before the answer is stored: where a killed worker hurts.
"""

from __future__ import annotations

import os
import time

from flask import Flask, request
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from flask_idempotency import Idempotency


class Base(DeclarativeBase):
    pass


app = Flask(__name__)
app.config["SQLALCHEMY_DATABASE_URI"] = os.environ["APP_DATABASE_URI"]
app.config["SQLALCHEMY_ENGINE_OPTIONS"] = {"pool_size": 2, "max_overflow": 0, "pool_timeout": 10}
app.config["IDEMPOTENCY_SCOPE_FUNC"] = lambda request: "wheel-user"
app.config["IDEMPOTENCY_LEASE"] = 2
db = SQLAlchemy(app, model_class=Base)
idempotency = Idempotency(app, db=db)


class Transfer(db.Model):  # type: ignore[name-defined,misc]
    __tablename__ = "wheel_transfers"

    id: Mapped[int] = mapped_column(primary_key=True)
    key: Mapped[str]


@app.post("/transfers")
@idempotency.required
def transfer() -> tuple[dict[str, int], int]:
    row = Transfer(key=request.headers["Idempotency-Key"])
    db.session.add(row)
    db.session.commit()
    time.sleep(0.02)  # committed in the view, the answer not stored yet
    return {"id": row.id}, 201


@app.get("/health")
def health() -> str:
    return "ok"


if __name__ == "__main__":  # create the app's own table
    with app.app_context():
        db.create_all()
