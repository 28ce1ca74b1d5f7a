"""A small Flask-SQLAlchemy application for the tests of contract section 6.

``POST /transfers`` is the decorated view: it writes a ``Transfer`` through
``db.session``, commits, and then does what the JSON body's ``then`` says
(see :func:`create_app`'s ``transfers``), so one test per row of the contract
table can ask for the row's behaviour. ``label`` marks every row a request
writes, and the tests count rows by label in PostgreSQL.

The same behaviours are served, for comparison, by an undecorated route and an
``optional`` one. A ``User`` row is loaded through ``db.session`` before the
decorated view runs (an authentication decorator, or a ``before_request``), as
real applications do.

In-process: ``create_app(url)``. Under gunicorn: ``sa_app:create_app()`` reads
``SA_APP_DATABASE_URL`` (a ``postgresql+psycopg2://`` or
``postgresql+psycopg://`` URL), ``SA_APP_GATE_DIR`` (where gates live, below)
and ``SA_APP_IDEMPOTENCY_*`` / ``SA_APP_SQLALCHEMY_POOL_SIZE`` from the
environment.

What the view does after its commit comes from the ``X-Then`` header (else the
body's ``then``), and its final status from ``X-Status`` (201). Gates
(``X-Then: gate``, ``X-Gate: g``): the view writes its pid to
``<dir>/g.entered`` and waits (polling) until ``<dir>/g.open`` exists; a test
kills or stops the worker meanwhile, or opens the gate.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import psycopg2
import sqlalchemy as sa
from flask import Flask, Response, abort, g, jsonify, request
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy.dialects import postgresql
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from flask_idempotency import Idempotency

F = TypeVar("F", bound=Callable[..., Any])

#: A user every app start makes sure of: a second insert of it is a unique violation.
API_KEY_TAKEN = "sa-app-taken"
#: How long a view waits at a gate nobody opens before it gives up (and answers 500).
GATE_TIMEOUT = 30.0


class Base(DeclarativeBase):
    pass


db = SQLAlchemy(model_class=Base)


class Transfer(db.Model):  # type: ignore[name-defined,misc]
    __tablename__ = "sa_transfers"

    id: Mapped[int] = mapped_column(primary_key=True)
    label: Mapped[str] = mapped_column(sa.String(200), index=True)
    amount: Mapped[int]
    #: Which write of the request this is ("first", "discarded", "after_rollback"...).
    step: Mapped[str] = mapped_column(sa.String(40))


class User(db.Model):  # type: ignore[name-defined,misc]
    __tablename__ = "sa_users"

    id: Mapped[int] = mapped_column(primary_key=True)
    api_key: Mapped[str] = mapped_column(sa.String(100), unique=True)
    transfers_made: Mapped[int] = mapped_column(default=0)
    #: Set by a ``before_request`` that does not commit (``X-Touch-User``).
    touched_by: Mapped[str | None] = mapped_column(sa.String(200), default=None)


class Declined(Exception):
    """Raised by a view; the app's error handler renders it as a 402."""


def plain_dsn(url: str) -> str:
    """``postgresql+driver://...`` -> ``postgresql://...`` for psycopg2.connect."""
    scheme, rest = url.split("://", 1)
    return f"{scheme.split('+', 1)[0]}://{rest}"


def count_elsewhere(url: str, label: str) -> int:
    """Rows with ``label`` as another session sees them (committed rows only)."""
    conn = psycopg2.connect(plain_dsn(url), connect_timeout=5)
    try:
        with conn, conn.cursor() as cur:
            cur.execute("SELECT count(*) FROM sa_transfers WHERE label = %s", (label,))
            row = cur.fetchone()
            assert row is not None
            return int(row[0])
    finally:
        conn.close()


def _env_config() -> dict[str, Any]:
    config: dict[str, Any] = {}
    for name, value in os.environ.items():
        if name.startswith("SA_APP_IDEMPOTENCY_"):
            # A group of options (``..._DATABASE_OPTIONS``) is given as JSON.
            parsed = json.loads(value) if name.endswith("_OPTIONS") else value
            config[name.removeprefix("SA_APP_")] = parsed
    if "SA_APP_SQLALCHEMY_POOL_SIZE" in os.environ:
        size = int(os.environ["SA_APP_SQLALCHEMY_POOL_SIZE"])
        config["SQLALCHEMY_ENGINE_OPTIONS"] = {"pool_size": size, "max_overflow": 0}
    if os.environ.get("SA_APP_NO_PREPARE"):  # psycopg 3 behind PgBouncer
        options = config.setdefault("SQLALCHEMY_ENGINE_OPTIONS", {})
        options["connect_args"] = {"prepare_threshold": None}
    return config


def create_app(database_url: str | None = None, config: Mapping[str, Any] | None = None) -> Flask:
    url = database_url or os.environ["SA_APP_DATABASE_URL"]
    app = Flask(__name__)
    app.config.update(
        SQLALCHEMY_DATABASE_URI=url,
        IDEMPOTENCY_AUTO_MIGRATE=True,
        SA_GATE_DIR=os.environ.get("SA_APP_GATE_DIR"),
    )
    app.config.update(_env_config())
    app.config.update(config or {})
    db.init_app(app)
    with app.app_context(), db.engine.begin() as conn:
        # Two gunicorn workers start at once: one creates the tables, the other waits.
        conn.execute(sa.text("SELECT pg_advisory_xact_lock(4343)"))
        Base.metadata.create_all(conn)
        taken = postgresql.insert(User).values(api_key=API_KEY_TAKEN, transfers_made=0)
        conn.execute(taken.on_conflict_do_nothing())
    idempotency = Idempotency(app, db=db)
    app.extensions["sa_idempotency"] = idempotency

    def load_user() -> User | None:
        header = request.headers.get("Authorization", "")
        token = header.removeprefix("Bearer ").strip()
        return db.session.execute(sa.select(User).where(User.api_key == token)).scalar_one_or_none()

    @app.before_request
    def preload_user() -> None:
        if request.headers.get("X-Load-User") == "before_request":
            g.user = load_user()
            if g.user is not None and request.headers.get("X-Touch-User"):
                g.user.touched_by = request.headers["X-Touch-User"]  # not committed here

    def authenticated(view: F) -> F:
        """Loads the caller's ``User`` through ``db.session`` before the view (and
        before the claim, when it wraps ``@idempotency.required``)."""

        @functools.wraps(view)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if "user" not in g:
                g.user = load_user()
            return view(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    @app.errorhandler(Declined)
    def declined(exc: Declined) -> tuple[Response, int]:
        return jsonify(error="declined"), 402

    def gate(name: str) -> None:
        gate_dir = app.config["SA_GATE_DIR"]
        assert gate_dir, "SA_GATE_DIR is not configured"
        entered = Path(gate_dir, f"{name}.entered")
        entered.write_text(str(os.getpid()))
        opened = Path(gate_dir, f"{name}.open")
        deadline = time.monotonic() + GATE_TIMEOUT
        while not opened.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"gate {name} was never opened")
            time.sleep(0.01)

    def run_transfer() -> Any:
        """Write a transfer, commit, then do what ``then`` says."""
        body = request.get_json()
        label, amount = body["label"], int(body.get("amount", 100))
        # The header first: it is outside the fingerprint, so a retry of the same
        # request may behave otherwise (a transient failure, a gate passed).
        then = request.headers.get("X-Then") or body.get("then", "ok")
        user: User | None = g.get("user")
        transfer = Transfer(label=label, amount=amount, step="first")
        db.session.add(transfer)
        if user is not None:
            user.transfers_made += 1
        db.session.commit()
        payload: dict[str, Any] = {"id": transfer.id, "label": label}
        if user is not None:
            payload["transfers_made"] = user.transfers_made
        if then == "twice":
            db.session.add(Transfer(label=label, amount=amount, step="second"))
            db.session.commit()
        elif then == "rollback":
            db.session.add(Transfer(label=label, amount=amount, step="discarded"))
            db.session.flush()  # sent to PostgreSQL, then rolled back
            db.session.rollback()
            db.session.add(Transfer(label=label, amount=amount, step="after_rollback"))
            db.session.commit()
        elif then == "read":
            own = db.session.scalar(
                sa.select(sa.func.count()).select_from(Transfer).where(Transfer.label == label)
            )
            loaded = db.session.get(Transfer, transfer.id)
            payload["seen_by_session"] = own
            payload["loaded_amount"] = loaded.amount if loaded is not None else None
            payload["seen_elsewhere"] = count_elsewhere(url, label)
        elif then == "conflict":
            # A unique violation caught and rolled back (get-or-create): the session
            # rolls back to its last commit and goes on.
            db.session.add(User(api_key=g.user.api_key if user is not None else API_KEY_TAKEN))
            try:
                db.session.commit()
            except sa.exc.IntegrityError:
                db.session.rollback()
            db.session.add(Transfer(label=label, amount=amount, step="after_rollback"))
            db.session.commit()
        elif then == "nested":
            # Get-or-create with the session's own nested transactions (savepoints of
            # SQLAlchemy's inside the request's transaction): a collision undoes that
            # insert alone; a nested block that succeeds is kept with the rest.
            try:
                with db.session.begin_nested():
                    db.session.add(User(api_key=API_KEY_TAKEN))
            except sa.exc.IntegrityError:
                pass
            with db.session.begin_nested():
                db.session.add(Transfer(label=label, amount=amount, step="nested"))
            db.session.add(Transfer(label=label, amount=amount, step="after_nested"))
            db.session.commit()
        elif then == "empty_rollback":
            # The session begins and rolls back with nothing sent in between (the
            # stretch's savepoint was never needed), then writes and commits.
            db.session.connection()
            db.session.rollback()
            db.session.add(Transfer(label=label, amount=amount, step="after_rollback"))
            db.session.commit()
        elif then == "raw":
            # The session begins a new stretch, then the view writes through the
            # extension's own connection: one transaction, kept with the answer.
            db.session.connection()
            with idempotency.connection().cursor() as cur:
                cur.execute(
                    "INSERT INTO sa_transfers (label, amount, step) VALUES (%s, %s, 'raw')",
                    (label, amount),
                )
            db.session.add(Transfer(label=label, amount=amount, step="second"))
            db.session.commit()
        elif then == "unflushed":
            # Added, never committed nor flushed by the view: kept with the answer.
            db.session.add(Transfer(label=label, amount=amount, step="unflushed"))
        elif then == "flush_fails":
            # Never committed by the view; its flush fails as the answer is stored.
            db.session.add(User(api_key=API_KEY_TAKEN))
        elif then in ("removed", "closed"):
            # The view ends its session (remove() or close()) and writes again.
            if then == "removed":
                db.session.remove()
            else:
                db.session.close()
            db.session.add(Transfer(label=label, amount=amount, step="after_remove"))
            db.session.commit()
        elif then == "lost_connection":
            # The request's connection dies under the view (its backend ends).
            db.session.execute(sa.text("SELECT pg_terminate_backend(pg_backend_pid())"))
        elif then == "raise":
            raise RuntimeError("the view failed after its commit")
        elif then == "declined":
            raise Declined()
        elif then == "abort503":
            abort(503)
        elif then == "gate":
            gate(request.headers["X-Gate"])
        elif then == "sleep":
            time.sleep(float(body.get("seconds", 0.2)))
        elif then != "ok":
            status = int(then)  # "500", "400", "409": answered after the commit
            return jsonify(payload), status
        response = jsonify(payload)
        response.status_code = int(request.headers.get("X-Status", 201))
        return response

    @app.post("/transfers")
    @authenticated
    @idempotency.required
    def transfers() -> Any:
        return run_transfer()

    @app.post("/optional-transfers")
    @idempotency.optional
    def optional_transfers() -> Any:
        return run_transfer()

    @app.post("/plain-transfers")
    def plain_transfers() -> Any:
        return run_transfer()

    @app.route("/safe-transfers", methods=["GET", "POST"])
    @idempotency.required
    def safe_transfers() -> Any:
        """On GET (a safe method: the key is ignored) writes and commits anyway."""
        label = request.args["label"]
        db.session.add(Transfer(label=label, amount=1, step="get"))
        db.session.commit()
        return {"seen_elsewhere": count_elsewhere(url, label)}

    @app.get("/transfers/<label>")
    def transfer_rows(label: str) -> Any:
        rows = db.session.scalars(sa.select(Transfer).where(Transfer.label == label)).all()
        return {"steps": sorted(t.step for t in rows)}

    @app.get("/debug/config")
    def debug_config() -> Any:  # what the gunicorn-served app was started with
        return json.loads(json.dumps({"url": db.engine.url.drivername}))

    return app
