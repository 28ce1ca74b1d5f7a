"""db.session with recovery points (``phase()``), the outbox (``emit()``) and
``recover=``: the session's writes follow the same transaction as the rest.

Each test builds its own small Flask-SQLAlchemy app on both dialects and
counts rows through a connection of its own.
"""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from flask import Flask, request
from flask_sqlalchemy import SQLAlchemy
from sa_harness import query, sa_url
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from flask_idempotency import Abandoned, Idempotency, digests, global_scope
from flask_idempotency.completer import Recoverer, RecoveryOutcome
from flask_idempotency.recovery import capture, recoverable_routes

DIALECTS = ("psycopg2", "psycopg")


def build(url: str) -> tuple[Flask, SQLAlchemy, Idempotency, str]:
    class Base(DeclarativeBase):
        pass

    db = SQLAlchemy(model_class=Base)
    table = f"sa_steps_{uuid.uuid4().hex[:8]}"

    class Step(db.Model):  # type: ignore[name-defined,misc]
        __tablename__ = table
        id: Mapped[int] = mapped_column(primary_key=True)
        label: Mapped[str]
        step: Mapped[str]

    app = Flask(__name__)
    app.config.update(
        SQLALCHEMY_DATABASE_URI=url,
        IDEMPOTENCY_SCOPE_FUNC=global_scope,
        IDEMPOTENCY_AUTO_MIGRATE=True,
    )
    db.init_app(app)
    idempotency = Idempotency(app, db=db)
    with app.app_context():
        db.create_all()

    def write(label: str, step: str) -> None:
        db.session.add(Step(label=label, step=step))
        db.session.commit()

    @app.post("/orders")
    @idempotency.required
    def order() -> tuple[dict[str, Any], int]:
        label = request.get_json()["label"]

        def reserve() -> dict[str, bool]:
            write(label, "reserve")
            return {"reserved": True}

        assert idempotency.phase("reserve", reserve) == {"reserved": True}
        if request.headers.get("X-Fail") == "after-phase":
            raise RuntimeError("the charge failed after the reservation")
        write(label, "charge")
        idempotency.emit("order.done", {"label": label})
        if request.headers.get("X-Fail") == "after-emit":
            raise RuntimeError("failed after emitting")
        return {"label": label}, 201

    def recover_charge(attempt: Abandoned) -> tuple[dict[str, Any], int]:
        label = request.get_json()["label"]
        write(label, "recovered")
        idempotency.emit("order.recovered", {"label": label})
        return {"label": label, "recovered": True}, 201

    @app.post("/charges")
    @idempotency.required(recover=recover_charge)
    def charge() -> tuple[dict[str, Any], int]:
        raise AssertionError("the recovery test never runs the view")

    return app, db, idempotency, table


@pytest.fixture(params=DIALECTS)
def made(request: pytest.FixtureRequest, database_url: str) -> Iterator[tuple[Flask, str, str]]:
    url = sa_url(database_url, str(request.param))
    app, db, _, table = build(url)
    yield app, table, database_url
    app.extensions["idempotency"].close()
    with app.app_context():
        db.engine.dispose()


def steps(database_url: str, table: str, label: str) -> list[str]:
    found = query(database_url, f"SELECT step FROM {table} WHERE label = %s ORDER BY id", (label,))
    return [row[0] for row in found]


def events(database_url: str, label: str) -> list[str]:
    found = query(
        database_url,
        "SELECT event_type FROM idempotency_outbox WHERE payload->>'label' = %s ORDER BY seq",
        (label,),
    )
    return [row[0] for row in found]


def test_a_phase_keeps_the_session_writes_it_committed_and_the_retry_resumes(
    made: tuple[Flask, str, str],
) -> None:
    app, table, database_url = made
    client = app.test_client()
    label = secrets.token_hex(4)
    headers = {"Idempotency-Key": f"order-{label}"}
    failed = client.post(
        "/orders", json={"label": label}, headers={**headers, "X-Fail": "after-phase"}
    )
    assert failed.status_code == 500
    # The recovery point committed the reservation; nothing after it was kept.
    assert steps(database_url, table, label) == ["reserve"]
    assert events(database_url, label) == []

    retry = client.post("/orders", json={"label": label}, headers=headers)
    assert retry.status_code == 201, retry.get_data(as_text=True)
    assert steps(database_url, table, label) == ["reserve", "charge"]  # reserve not redone
    assert events(database_url, label) == ["order.done"]

    replay = client.post("/orders", json={"label": label}, headers=headers)
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert steps(database_url, table, label) == ["reserve", "charge"]
    assert events(database_url, label) == ["order.done"]


def test_an_event_emitted_beside_session_writes_goes_with_them(
    made: tuple[Flask, str, str],
) -> None:
    app, table, database_url = made
    client = app.test_client()
    label = secrets.token_hex(4)
    failed = client.post(
        "/orders",
        json={"label": label},
        headers={"Idempotency-Key": f"emit-{label}", "X-Fail": "after-emit"},
    )
    assert failed.status_code == 500
    assert steps(database_url, table, label) == ["reserve"]  # the phase's, committed
    assert events(database_url, label) == []  # the event went with the charge row


def test_recover_writes_through_the_session_with_the_recovered_answer(
    made: tuple[Flask, str, str],
) -> None:
    """An attempt whose holder died (a processing record, lease over, never
    retried) is finished by ``flask idempotency recover``: the recover= function's
    session writes and event commit with the recovered answer."""
    app, table, database_url = made
    label = secrets.token_hex(4)
    state = app.extensions["idempotency"]
    with app.test_request_context(
        "/charges", method="POST", json={"label": label}, headers={"Idempotency-Key": label}
    ):
        from flask import request as current

        options = recoverable_routes(app)["charge"]
        record_key = digests.record_key(global_scope(current), label)
        fingerprint = state.options_for(options).fingerprint_func(current)
        tx = state.store.begin()
        claimed = tx.claim(
            record_key, fingerprint, lease=30, ttl=3600, recovery=capture(options, current)
        )
        assert claimed.__class__.__name__ == "Claimed"
        tx.close()  # the holder "dies": its claim stays, processing
    query(
        database_url,
        "UPDATE idempotency_records SET lease_expires_at = now() - interval '5 minutes' "
        "WHERE record_key = %s",
        (record_key,),
    )

    outcomes = Recoverer(app, older_than=0).run_pass()
    assert outcomes[RecoveryOutcome.RECOVERED] >= 1
    assert steps(database_url, table, label) == ["recovered"]
    assert events(database_url, label) == ["order.recovered"]

    replay = app.test_client().post(
        "/charges", json={"label": label}, headers={"Idempotency-Key": label}
    )
    assert replay.status_code == 201
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert replay.get_json() == {"label": label, "recovered": True}
