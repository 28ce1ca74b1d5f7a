"""``db.session`` on the request's transaction: Flask-SQLAlchemy and SQLAlchemy.

The central promise is that a view's writes commit together with its stored
answer, or not at all. A Flask-SQLAlchemy view writes through ``db.session``,
which on its own opens a connection of its own and commits whenever the view
says so. With ``Idempotency(app, db=db)`` a claimed attempt instead *joins*
the session to the attempt's connection, the way SQLAlchemy documents joining
a session into an external transaction (``join_transaction_mode=
"create_savepoint"``):

* the attempt's connection comes from ``db``'s engine (``store/pool.py``) and
  its transaction is the extension's, the one the answer commits in;
* each of the session's transactions is a savepoint in it: the view's
  ``commit()`` releases the savepoint, its ``rollback()`` rolls back to it, and
  the session stays usable;
* when the answer is stored, what the session holds is flushed and kept, then
  the one real ``COMMIT`` stores the answer with it; when the attempt is
  released (an exception, a 5xx, a ``400``...), a lease is lost, or the worker
  dies, nothing of it is kept.

How the session finds the connection, through documented APIs only: the
session's factory is configured with ``join_transaction_mode=
"create_savepoint"`` (``sessionmaker.configure``), and when a joined session
begins a transaction (``SessionEvents.after_transaction_create``) it is handed
the attempt's connection with ``Session.connection(bind_arguments={"bind":
...})``. A session keeps one connection per engine for its transaction, so every
later statement meant for that engine (Flask-SQLAlchemy's ``get_bind`` names
the engine) goes to the attempt's connection; a second database (a
``__bind_key__``) keeps its own engine and commits on its own.

Outside a claimed attempt (safe methods, undecorated routes, an optional route
called without a key) the session is not touched.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import sys
import weakref
from typing import TYPE_CHECKING, Any

from flask import Flask, has_app_context
from sqlalchemy import event
from sqlalchemy.engine import Connection as SAConnection
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, SessionTransaction, scoped_session

from .engine import current_attempt
from .errors import StoreUnavailable
from .store.base import StoreUnavailableError
from .store.pool import EnginePool

if TYPE_CHECKING:
    from sqlalchemy.engine import RootTransaction

    from .store.request import PostgresRequest

log = logging.getLogger("flask_idempotency.sqlalchemy")

#: ``Session.info`` key of the session's joined attempt (its :class:`Joined`).
JOINED = "flask_idempotency.joined"
#: The session factories whose sessions join attempts (``_hand_connection`` listens).
_LISTENED: weakref.WeakSet[Any] = weakref.WeakSet()


@dataclasses.dataclass
class Joined:
    """One attempt's session and the connection it works on."""

    session: Session
    connection: SAConnection
    #: The attempt's transaction as SQLAlchemy's connection knows it: the session
    #: sees a connection already in a transaction, so it only ever makes savepoints.
    outer: RootTransaction
    #: The attempt's handle: the server's transaction opens (``BEGIN``) when the
    #: session first begins one, so a view that never uses it pays nothing for it.
    handle: PostgresRequest

    def keep(self) -> None:
        """The answer will be stored, or a recovery point commits (and the session's
        next transaction is a new savepoint): flush what the session holds into the
        attempt's transaction, so its ``COMMIT`` keeps it. Raises what the flush
        raises."""
        if self.session.in_transaction():
            self.session.commit()

    def discard(self) -> None:
        """End the session's transaction without keeping it (the attempt is
        released: the extension's own rollback follows; or it has ended)."""
        if self.session.in_transaction():
            try:
                self.session.rollback()
            except Exception as exc:  # the connection may be gone (an outage)
                log.debug("idempotency: session rollback failed: %s", type(exc).__name__)

    def leave(self) -> None:
        """Give the session back as it was; the attempt's transaction is over."""
        self.discard()
        self.session.info.pop(JOINED, None)
        if self.outer.is_active:
            # The extension's COMMIT or ROLLBACK ended the server's transaction; under
            # autocommit mode, ending SQLAlchemy's view of it sends nothing more.
            try:
                self.outer.rollback()
            except Exception as exc:  # the connection may be gone (an outage)
                log.debug("idempotency: ending the joined transaction: %s", type(exc).__name__)


class SessionJoin:
    """Joins an application's scoped session to the claimed attempts of one app."""

    def __init__(self, sessions: scoped_session[Any], pool: EnginePool) -> None:
        self.sessions = sessions
        self.pool = pool
        factory = sessions.session_factory
        factory.configure(join_transaction_mode="create_savepoint")
        # Once per session factory, however many apps share it (Flask-SQLAlchemy's one
        # db.session). Not event.contains(): SQLAlchemy keys its registry by the id()
        # of the factory's class, so a new factory whose class reuses a collected
        # one's id (an app per test) reads as listened to, and its sessions would
        # never join (their commits real ones).
        if factory not in _LISTENED:
            event.listen(sessions, "after_transaction_create", _hand_connection)
            _LISTENED.add(factory)

    def detach(self) -> None:
        """Before a claim: end the transaction the session began before it (an
        authentication decorator's query), so its connection is back in the
        engine's pool before the claim takes one. Otherwise every request would hold
        two of the pool's connections at once, and a waiting duplicate one while it
        waits: under load, requests each holding one and waiting for a second empty
        the pool until its timeout (503s). What the session loaded stays usable and
        reloads on the attempt's connection. Changes it holds that were never
        committed are refused (``RuntimeError``) rather than silently dropped."""
        if not self.sessions.registry.has():
            return
        session = self.sessions()
        if session.in_transaction() and session.info.get(JOINED) is None:
            if session.new or session.deleted or session.dirty:
                # Rolling back would drop them without a word; committing them would
                # put them outside the request's transaction. Neither is right.
                raise RuntimeError(
                    "db.session has changes made before the idempotent view and not "
                    "committed (in a before_request or an authentication decorator?): "
                    "they cannot join the request's transaction. Commit them before "
                    "the view, or make them inside it."
                )
            session.rollback()

    def join(self, handle: PostgresRequest) -> Joined:
        """Make ``db.session`` work on the attempt's transaction until it ends: the
        session's next transaction opens the attempt's (``BEGIN``) if it is not
        open yet, and begins with a savepoint in it."""
        try:
            raw = handle.held()  # (the claim's connection: nothing is sent)
        except StoreUnavailableError as exc:
            raise StoreUnavailable() from exc
        connection = self.pool.sqlalchemy_connection(raw)
        session = self.sessions()
        if session.in_transaction():
            session.rollback()  # (detach() ended it before the claim; a safety net)
        # In autocommit mode this sends nothing: SQLAlchemy's view of the attempt's
        # transaction, which the server opens with the session's first one.
        outer = connection.begin()
        joined = Joined(session, connection, outer, handle)
        session.info[JOINED] = joined
        return joined


def _hand_connection(session: Session, transaction: SessionTransaction) -> None:
    """A joined session begins a transaction: it works on the attempt's connection
    (in a savepoint of its own, ``create_savepoint``)."""
    if transaction.parent is not None:
        return  # (a nested transaction works on its parent's connection)
    joined: Joined | None = session.info.get(JOINED)
    if joined is not None:
        try:
            joined.handle.connection()  # the attempt's transaction, opened if it is not yet
        except StoreUnavailableError as exc:
            raise StoreUnavailable() from exc
        session.connection(bind_arguments={"bind": joined.connection})
        return
    attempt = current_attempt() if has_app_context() else None
    current = attempt.session if attempt is not None else None
    if isinstance(current, Joined) and current.session is not session:
        raise RuntimeError(
            "a second session on the idempotent request's database (after "
            "db.session.remove() in the view?): its writes would not commit with "
            "the stored answer. Keep using db.session; don't remove it in the view."
        )


#: SQLAlchemy's default ``max_overflow`` of a ``QueuePool``.
DEFAULT_MAX_OVERFLOW = 10


def from_app(
    app: Flask, db: Any, engine: Engine | None, session: Any
) -> tuple[Engine, scoped_session[Any] | None, int | None]:
    """The engine, the scoped session and the engine's ``max_overflow`` (when the
    app's config says it: Flask-SQLAlchemy's) for ``init_app(app, db=db)`` or
    ``init_app(app, engine=engine, session=scoped_session)`` (plain SQLAlchemy;
    ``session`` may be left out)."""
    max_overflow: int | None = None
    if db is not None:
        if engine is not None or session is not None:
            raise ValueError("give db=, or engine= and session=, not both")
        if "sqlalchemy" not in app.extensions:
            raise RuntimeError(
                "db is not initialised on this app: call db.init_app(app) (or build "
                "SQLAlchemy(app)) before Idempotency(app, db=db)"
            )
        with app.app_context():
            engine = db.engine
        session = db.session
        options = app.config.get("SQLALCHEMY_ENGINE_OPTIONS") or {}
        max_overflow = int(options.get("max_overflow", DEFAULT_MAX_OVERFLOW))
    if not isinstance(engine, Engine):
        raise TypeError("engine= must be a sqlalchemy.engine.Engine")
    if "alembic" in sys.modules:
        # A migration run (Flask-Migrate, or Alembic's env.py importing the app):
        # autogenerate must not propose dropping the extension's tables. A web
        # worker, which never imports Alembic, does not pay for it.
        importlib.import_module("flask_idempotency.alembic")
    if session is not None and not isinstance(session, scoped_session):
        raise TypeError("session= must be a sqlalchemy.orm.scoped_session")
    return engine, session, max_overflow
