"""Plain SQLAlchemy, no Flask-SQLAlchemy: ``Idempotency(app, engine=engine,
session=scoped_session)``, the documented equivalent of ``db=db``, on both dialects.

The same rules as ``test_sa_session.py`` for the application's own scoped
session: inside a claimed request its writes are kept exactly when the answer
is stored; outside one it commits for real.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from flask import Flask, request
from sa_app import Base, Transfer, count_elsewhere
from sa_harness import *  # noqa: F403  (the fixtures, used by name)
from sa_harness import API_KEY, new_label, rows
from sqlalchemy.orm import Session, scoped_session, sessionmaker
from werkzeug.test import TestResponse

from flask_idempotency import Idempotency


@pytest.fixture
def plain_app(dialect_url: str) -> Iterator[Flask]:
    engine = sa.create_engine(dialect_url, pool_size=2, max_overflow=2)
    # Its own tables: on a fresh database (an xdist worker's) no sa_app ran before it.
    with engine.begin() as conn:
        conn.execute(sa.text("SELECT pg_advisory_xact_lock(4343)"))
        Base.metadata.create_all(conn)
    sessions: scoped_session[Session] = scoped_session(sessionmaker(bind=engine))
    app = Flask(__name__)
    app.config["IDEMPOTENCY_AUTO_MIGRATE"] = True
    idempotency = Idempotency(app, engine=engine, session=sessions)

    @app.teardown_appcontext
    def remove_session(exc: BaseException | None) -> None:
        sessions.remove()

    def transfer() -> tuple[dict[str, object], int]:
        label = request.get_json()["label"]
        then = request.headers.get("X-Then", "ok")
        sessions.add(Transfer(label=label, amount=1, step="first"))
        sessions.commit()
        if then == "rollback":
            sessions.add(Transfer(label=label, amount=1, step="discarded"))
            sessions.flush()
            sessions.rollback()
            sessions.add(Transfer(label=label, amount=1, step="after_rollback"))
            sessions.commit()
        elif then == "raise":
            raise RuntimeError("the view failed after its commit")
        seen = count_elsewhere(dialect_url, label)
        return {"label": label, "seen_elsewhere": seen}, int(request.headers.get("X-Status", 201))

    app.post("/transfers", endpoint="claimed")(idempotency.required(transfer))
    app.post("/plain-transfers", endpoint="plain")(transfer)
    try:
        yield app
    finally:
        app.extensions["idempotency"].close()
        engine.dispose()


def post(app: Flask, label: str, path: str = "/transfers", **headers: str) -> TestResponse:
    sent = {"Authorization": f"Bearer {API_KEY}", "Idempotency-Key": label}
    sent |= {name.replace("_", "-"): value for name, value in headers.items()}
    return app.test_client().post(path, json={"label": label}, headers=sent)


def test_stored_answer_keeps_the_writes_and_replays(plain_app: Flask, dialect_url: str) -> None:
    label = new_label("plain-sa")
    first = post(plain_app, label)
    assert first.status_code == 201, first.get_data(as_text=True)
    assert first.get_json()["seen_elsewhere"] == 0  # committed, but only with the answer
    assert rows(dialect_url, label) == ["first"]
    assert post(plain_app, label).headers["Idempotent-Replayed"] == "true"
    assert rows(dialect_url, label) == ["first"]


@pytest.mark.parametrize("failure", [{"X_Then": "raise"}, {"X_Status": "500"}, {"X_Status": "400"}])
def test_failure_after_commit_keeps_nothing_and_the_retry_runs_once(
    plain_app: Flask, dialect_url: str, failure: dict[str, str]
) -> None:
    label = new_label("plain-sa-failed")
    assert post(plain_app, label, **failure).status_code in (400, 500)
    assert rows(dialect_url, label) == []
    retry = post(plain_app, label)
    assert retry.status_code == 201 and retry.headers["Idempotent-Replayed"] == "false"
    assert rows(dialect_url, label) == ["first"]


def test_rollback_discards_since_the_last_commit(plain_app: Flask, dialect_url: str) -> None:
    label = new_label("plain-sa-rollback")
    assert post(plain_app, label, X_Then="rollback").status_code == 201
    assert rows(dialect_url, label) == ["after_rollback", "first"]


def test_unclaimed_route_commits_on_its_own(plain_app: Flask, dialect_url: str) -> None:
    label = new_label("plain-sa-unclaimed")
    answer = post(plain_app, label, "/plain-transfers", X_Then="raise")
    assert answer.status_code == 500
    assert rows(dialect_url, label) == ["first"]
    label = new_label("plain-sa-unclaimed")
    assert post(plain_app, label, "/plain-transfers").get_json()["seen_elsewhere"] == 1


def test_a_session_without_its_engine_is_refused_at_init_app() -> None:
    """``session=`` joins the view's writes to the engine's transaction, so it comes
    with ``engine=``; alone it is refused by name, not left to fail later."""
    app = Flask("session_only")
    app.config["IDEMPOTENCY_DATABASE_URL"] = "postgresql://unused@127.0.0.1:9/x"
    session = scoped_session(sessionmaker())
    with pytest.raises(TypeError, match="engine= must be a sqlalchemy.engine.Engine"):
        Idempotency(app, session=session)
