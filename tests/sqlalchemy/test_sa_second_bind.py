"""A second database (Flask-SQLAlchemy's ``__bind_key__``) is left alone by the join.

Only the engine given to ``Idempotency(app, db=db)`` joins the request's
transaction. A model bound to another engine keeps its own connection and its
own commits, as the docs say: its writes are not part of the stored answer's
transaction. The session holds one connection per engine for its transaction, so
these tests also hold each mapper to one connection every time it is asked.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from flask import Flask, jsonify, request
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy import String
from sqlalchemy.engine import Connection
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from flask_idempotency import Idempotency, global_scope
from support.pg_query import query


class Base(DeclarativeBase):
    pass


db = SQLAlchemy(model_class=Base)


class Payment(db.Model):  # type: ignore[name-defined,misc]
    __tablename__ = "second_bind_payments"
    id: Mapped[int] = mapped_column(primary_key=True)
    label: Mapped[str] = mapped_column(String)


class AuditEntry(db.Model):  # type: ignore[name-defined,misc]
    __tablename__ = "second_bind_audit"
    __bind_key__ = "audit"
    id: Mapped[int] = mapped_column(primary_key=True)
    label: Mapped[str] = mapped_column(String)


def _labels(dsn: str, table: str) -> list[str]:
    return [row[0] for row in query(dsn, f"SELECT label FROM {table} ORDER BY id")]


#: The connections the view's session used for each mapper, in order (the first test
#: reads them).
Routes = list[Any]


@pytest.fixture
def routes() -> Routes:
    return []


@pytest.fixture
def app(clean_db: str, routes: Routes) -> Iterator[Flask]:
    url = clean_db.replace("postgresql://", "postgresql+psycopg2://", 1)
    app = Flask(__name__)
    app.config.update(
        SQLALCHEMY_DATABASE_URI=url,
        SQLALCHEMY_BINDS={"audit": url},  # the same server, another engine and pool
        IDEMPOTENCY_SCOPE_FUNC=global_scope,
    )
    db.init_app(app)
    with app.app_context():
        db.create_all()
    idempotency = Idempotency(app, db=db)

    @app.post("/pay")
    @idempotency.required
    def pay() -> Any:
        label = request.get_json()["label"]
        session = db.session()
        # Asked in turn and twice each, as a flush of both models would.
        for mapper in (Payment.__mapper__, AuditEntry.__mapper__) * 2:
            routes.append(session.connection(bind_arguments={"mapper": mapper}))
        db.session.add(Payment(label=label))
        db.session.add(AuditEntry(label=label))
        db.session.commit()
        if request.get_json().get("then") == "raise":
            raise RuntimeError("after commit")
        return jsonify(label=label), 201

    try:
        yield app
    finally:
        app.extensions["idempotency"].close()
        with app.app_context():
            db.drop_all()
            for engine in db.engines.values():
                engine.dispose()


def _post(app: Flask, key: str, body: dict[str, str]) -> Any:
    return app.test_client().post("/pay", json=body, headers={"Idempotency-Key": key})


def test_each_mapper_is_routed_to_its_own_database_every_time(app: Flask, routes: Routes) -> None:
    assert _post(app, "k-routes", {"label": "routes"}).status_code == 201
    main, audit, main_again, audit_again = routes
    assert isinstance(main, Connection) and isinstance(audit, Connection)
    assert main_again is main and audit_again is audit
    with app.app_context():
        assert main.engine is db.engine, "the default engine's is the attempt's connection"
        assert audit.engine is db.engines["audit"], "the second database keeps its own"
    assert main is not audit


def test_a_second_database_commits_on_its_own_and_the_joined_one_with_the_answer(
    app: Flask, clean_db: str
) -> None:
    failed = _post(app, "k-raise", {"label": "raised", "then": "raise"})
    assert failed.status_code == 500
    assert _labels(clean_db, "second_bind_payments") == []
    assert _labels(clean_db, "second_bind_audit") == ["raised"], "not part of the transaction"

    assert _post(app, "k-ok", {"label": "kept"}).status_code == 201
    replay = _post(app, "k-ok", {"label": "kept"})
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert _labels(clean_db, "second_bind_payments") == ["kept"]
    assert _labels(clean_db, "second_bind_audit") == ["raised", "kept"]
