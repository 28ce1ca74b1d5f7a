"""``assert_idempotent(atomicity_drill=True)`` tells an atomic view from a naive one.

The naive port of a view to Flask-SQLAlchemy (``db.session.commit()`` under
``@idempotency.required`` without giving the extension ``db``) replays fine but
commits its writes on a connection of its own: an attempt that fails after the
view returned keeps them, and the retry writes them again. The drill catches
it; the same view with ``Idempotency(app, db=db)`` passes.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from flask import Flask, request
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy import text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from flask_idempotency import Idempotency, global_scope
from flask_idempotency.testing import assert_idempotent
from flask_idempotency.testing.live_server import LiveServer


def make_app(database_url: str, *, integrated: bool) -> tuple[Flask, SQLAlchemy, str]:
    class Base(DeclarativeBase):
        pass

    db = SQLAlchemy(model_class=Base)
    table = f"drill_{uuid.uuid4().hex[:8]}"

    class Transfer(db.Model):  # type: ignore[name-defined,misc]
        __tablename__ = table
        id: Mapped[int] = mapped_column(primary_key=True)
        amount: Mapped[int]

    app = Flask(__name__)
    sa_url = database_url.replace("postgresql://", "postgresql+psycopg2://", 1)
    app.config.update(
        SQLALCHEMY_DATABASE_URI=sa_url,
        IDEMPOTENCY_SCOPE_FUNC=global_scope,
        IDEMPOTENCY_AUTO_MIGRATE=True,
        IDEMPOTENCY_TESTING_DRILLS=True,
    )
    if not integrated:
        app.config["IDEMPOTENCY_DATABASE_URL"] = database_url
    db.init_app(app)
    idempotency = Idempotency(app, db=db) if integrated else Idempotency(app)
    with app.app_context():
        db.create_all()

    @app.post("/transfers")
    @idempotency.required
    def create() -> tuple[dict[str, int], int]:
        transfer = Transfer(amount=int(request.get_json()["amount"]))
        db.session.add(transfer)
        db.session.commit()
        return {"id": transfer.id}, 201

    return app, db, table


@pytest.fixture
def served(clean_db: str) -> Iterator[dict[bool, tuple[LiveServer, SQLAlchemy, str, Flask]]]:
    made = {}
    servers = []
    for integrated in (False, True):
        app, db, table = make_app(clean_db, integrated=integrated)
        server = LiveServer(app).start()
        servers.append((server, app, db))
        made[integrated] = (server, db, table, app)
    yield made
    for server, app, db in servers:
        server.stop()
        app.extensions["idempotency"].close()
        with app.app_context():
            db.engine.dispose()


def rows(app: Flask, db: SQLAlchemy, table: str) -> int:
    with app.app_context():
        return int(db.session.execute(text(f"SELECT count(*) FROM {table}")).scalar_one())


def test_the_drill_fails_the_naive_port(
    served: dict[bool, tuple[LiveServer, SQLAlchemy, str, Flask]],
) -> None:
    server, db, table, app = served[False]
    with pytest.raises(AssertionError, match="kept once of its writes"):
        assert_idempotent(
            server.url + "/transfers",
            json={"amount": 5},
            duplicates=4,
            executions=lambda: rows(app, db, table),
            atomicity_drill=True,
        )


def test_the_drill_passes_the_integrated_view(
    served: dict[bool, tuple[LiveServer, SQLAlchemy, str, Flask]],
) -> None:
    server, db, table, app = served[True]
    report = assert_idempotent(
        server.url + "/transfers",
        json={"amount": 5},
        duplicates=4,
        executions=lambda: rows(app, db, table),
        atomicity_drill=True,
    )
    assert report.status == 201
    assert rows(app, db, table) == 2  # the burst's one, and the drill's retry's one


def test_the_drill_says_when_the_app_does_not_enable_it(
    served: dict[bool, tuple[LiveServer, SQLAlchemy, str, Flask]],
) -> None:
    server, db, table, app = served[True]
    app.extensions["idempotency"].settings = app.extensions["idempotency"].settings.__class__(
        **{**app.extensions["idempotency"].settings.__dict__, "testing_drills": False}
    )
    with pytest.raises(AssertionError, match="IDEMPOTENCY_TESTING_DRILLS"):
        assert_idempotent(
            server.url + "/transfers",
            json={"amount": 5},
            duplicates=2,
            executions=lambda: rows(app, db, table),
            atomicity_drill=True,
        )
