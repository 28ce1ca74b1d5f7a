"""``Idempotency(app, engine=engine)``: the application's own SQLAlchemy engine, whose
pool is the one pool.

Its connections come back exactly as they were lent: out of ``AUTOCOMMIT``, no
transaction open (one left in autocommit mode makes the application's next
``rollback()`` undo nothing). The lease keeper renews on a connection of its own,
never one of the engine's: an application that sizes its pool for itself can
take every connection of it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import sqlalchemy
from flask import Flask
from sqlalchemy.engine import Engine

from support import core_app
from support.records import wait_for_renewal

MakeApp = Callable[..., Flask]


@pytest.fixture
def engine(clean_db: str) -> Iterator[Engine]:
    url = clean_db.replace("postgresql://", "postgresql+psycopg2://", 1)
    engine = sqlalchemy.create_engine(url, pool_size=4, max_overflow=0, pool_timeout=2)
    yield engine
    engine.dispose()


@pytest.fixture
def make_lent_app(clean_db: str, engine: Engine) -> Iterator[MakeApp]:
    apps: list[Flask] = []

    def make(**config: Any) -> Flask:
        app = core_app.create_app(clean_db, config, engine=engine)
        apps.append(app)
        return app

    yield make
    for app in apps:
        app.extensions["idempotency"].close()


def post(app: Flask, key: str, body: dict[str, Any] | None = None) -> Any:
    return app.test_client().post("/charges", json=body or {}, headers={"Idempotency-Key": key})


def test_connections_go_back_as_they_were_lent(make_lent_app: MakeApp, engine: Engine) -> None:
    app = make_lent_app()
    for key in ("a", "b", "c"):
        assert post(app, key).status_code == 201
        assert post(app, key).headers["Idempotent-Replayed"] == "true"
    assert engine.pool.checkedout() == 0  # type: ignore[attr-defined]
    # Every connection the engine hands the application now is as it would be
    # without the extension: a transaction of its own that rollback() undoes.
    with engine.connect() as connection:
        raw = connection.connection.driver_connection
        assert raw is not None and raw.autocommit is False
        connection.exec_driver_sql("CREATE TEMP TABLE lent (n int)")
        connection.exec_driver_sql("INSERT INTO lent VALUES (1)")
        connection.rollback()
        assert (
            connection.exec_driver_sql(
                "SELECT count(*) FROM pg_tables WHERE tablename = 'lent'"
            ).scalar()
            == 0
        )


def test_the_application_can_take_every_connection_of_its_engine(
    make_lent_app: MakeApp, engine: Engine, clean_db: str
) -> None:
    """The keeper holds a connection of its own: not one of the engine's four."""
    app = make_lent_app(
        IDEMPOTENCY_LEASE=1.0,
        IDEMPOTENCY_LEASE_RENEW_INTERVAL=0.2,
        IDEMPOTENCY_FINGERPRINT_FUNC=lambda request: b"same request",
    )
    answers: list[Any] = []
    holder = threading.Thread(target=lambda: answers.append(post(app, "k", {"gate": "g"})))
    holder.start()
    gates = app.extensions["gates"]
    try:
        assert gates.entered_event("g").wait(10)
        wait_for_renewal(clean_db)  # the keeper has its connection, and has used it
        assert engine.pool.checkedout() == 1  # type: ignore[attr-defined]  # the request's
        duplicate = post(app, "k")
        assert duplicate.status_code == 409
        assert duplicate.get_json()["error"]["code"] == "in_progress"
    finally:
        gates.get("g").set()
        holder.join(10)
    assert answers[0].status_code == 201

    # The application takes all four connections of its engine at once.
    taken = [engine.connect() for _ in range(4)]
    for connection in taken:
        connection.close()

    # Two concurrent first requests, each holding two of the four connections (its
    # own, and the test app's record of the run on a second), with the keeper
    # renewing meanwhile: both are served, the keeper took none of the four.
    with ThreadPoolExecutor(2) as pool:
        statuses = list(pool.map(lambda n: post(app, f"concurrent-{n}").status_code, range(2)))
    assert statuses == [201] * 2


def test_the_pool_capacity_is_said_only_when_known(make_lent_app: MakeApp, clean_db: str) -> None:
    """SQLAlchemy's pools do not say their max_overflow: with engine= the capacity is
    unknown (no warning built on a guess); with Flask-SQLAlchemy it is read from
    SQLALCHEMY_ENGINE_OPTIONS (SQLAlchemy's default overflow when unset)."""
    from flask_sqlalchemy import SQLAlchemy

    from flask_idempotency import Idempotency

    lent = make_lent_app()
    assert lent.extensions["idempotency"].store.pool.capacity() is None

    url = clean_db.replace("postgresql://", "postgresql+psycopg2://", 1)
    for options, expected in (({"pool_size": 3, "max_overflow": 7}, 10), ({"pool_size": 3}, 13)):
        app = Flask(__name__)
        app.config.update(SQLALCHEMY_DATABASE_URI=url, SQLALCHEMY_ENGINE_OPTIONS=options)
        db = SQLAlchemy(app)
        Idempotency(app, db=db)
        try:
            capacity = app.extensions["idempotency"].store.pool.capacity()
            assert capacity == (expected, "the engine's pool_size + max_overflow")
        finally:
            app.extensions["idempotency"].close()
            with app.app_context():
                db.engine.dispose()
