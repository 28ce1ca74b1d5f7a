"""IdempotentTask with Flask-SQLAlchemy: the task's db.session writes commit
with its stored result, or not at all (in process, ``apply()``, no broker)."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from typing import Any

import psycopg2
import pytest
from celery import Celery
from flask import Flask
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from flask_idempotency import Idempotency
from flask_idempotency.celery import IdempotentTask


class Base(DeclarativeBase):
    pass


db = SQLAlchemy(model_class=Base)
idempotency = Idempotency()
celery_app = Celery("ct_sqlalchemy", broker="memory://")
celery_app.conf.update(task_store_eager_result=False)
runs: list[str] = []
#: Whether the task fails after its commit (a flag, not an argument: the retry is
#: the same call).
failing = {"on": False}


class Receipt(db.Model):  # type: ignore[name-defined,misc]
    __tablename__ = "ct_sqlalchemy_receipts"
    id: Mapped[int] = mapped_column(primary_key=True)
    label: Mapped[str]


@celery_app.task(base=IdempotentTask, name="cts.receipt", idempotency_key="label")  # type: ignore[untyped-decorator]
def write_receipt(label: str) -> dict[str, Any]:
    runs.append(label)
    db.session.add(Receipt(label=label))
    db.session.commit()  # on the task's transaction: kept only with its stored result
    if failing["on"]:
        raise RuntimeError("failed after its commit")
    return {"label": label, "runs": len(runs)}


@pytest.fixture
def app(clean_db: str) -> Iterator[Flask]:
    app = Flask(__name__)
    app.config.update(
        SQLALCHEMY_DATABASE_URI=clean_db.replace("postgresql://", "postgresql+psycopg2://", 1),
        IDEMPOTENCY_AUTO_MIGRATE=True,
    )
    db.init_app(app)
    idempotency.init_app(app, db=db)
    runs.clear()
    with app.app_context():
        db.create_all()
        yield app
        db.engine.dispose()
    app.extensions["idempotency"].close()


def receipts(url: str, label: str) -> int:
    conn = psycopg2.connect(url)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT count(*) FROM ct_sqlalchemy_receipts WHERE label = %s", (label,))
            row = cur.fetchone()
    finally:
        conn.close()
    assert row is not None
    return int(row[0])


def test_a_task_on_db_session_runs_once_and_its_failure_keeps_nothing(
    app: Flask, clean_db: str
) -> None:
    label = secrets.token_hex(4)
    failing["on"] = True
    with pytest.raises(RuntimeError):
        write_receipt.apply(kwargs={"label": label}).get()
    assert receipts(clean_db, label) == 0  # committed through db.session, then raised
    failing["on"] = False

    first = write_receipt.apply(kwargs={"label": label}).get()
    again = write_receipt.apply(kwargs={"label": label}).get()
    assert first == again == {"label": label, "runs": 2}
    assert receipts(clean_db, label) == 1
