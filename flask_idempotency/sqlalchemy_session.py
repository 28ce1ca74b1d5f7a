"""``db.session`` on the request's transaction: Flask-SQLAlchemy and SQLAlchemy.

The central promise is that a view's writes commit together with its stored
answer, or not at all. A Flask-SQLAlchemy view writes through ``db.session``,
which on its own opens a connection of its own and commits whenever the view
says so. With ``Idempotency(app, db=db)`` a claimed attempt instead *joins*
the session to the attempt's connection, the way SQLAlchemy 2.0 documents
joining a session to an external transaction
(``join_transaction_mode="create_savepoint"``):

* the attempt's connection comes from ``db``'s engine (``store/engine_pool.py``)
  and its transaction is the extension's, the one the answer commits in;
* the session's ``commit()`` releases a savepoint in that transaction and its
  ``rollback()`` rolls back to it, so ``rollback()`` discards what came since
  the last ``commit()`` and leaves the session usable;
* when the answer is stored, what the session holds is flushed and kept, then
  the one real ``COMMIT`` stores the answer with it; when the attempt is
  released (an exception, a 5xx, a ``400``...), a lease is lost, or the worker
  dies, nothing of it is kept.

Outside a claimed attempt (safe methods, undecorated routes, an optional route
called without a key) the session is not touched.

Routing is done by the session's ``get_bind``: the sessionmaker's class is
given a subclass (the one documented way to change a session's binds) whose
``get_bind`` returns the attempt's connection wherever the application's own
choice was the engine the extension joined; other binds (a second database)
are left alone, and are not part of the transaction.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import sys
from typing import TYPE_CHECKING, Any

from flask import Flask, has_app_context
from sqlalchemy.engine import Connection as SAConnection
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from .errors import StoreUnavailable
from .state import request_state
from .store.base import StoreUnavailableError
from .store.engine_pool import EnginePool
from .store.memory import MemoryRequest

if TYPE_CHECKING:
    from sqlalchemy.orm import scoped_session

    from .state import RequestState
    from .store.request import PostgresRequest

log = logging.getLogger("flask_idempotency.sqlalchemy")

#: ``Session.info`` key of the session's joined attempt (its :class:`Joined`).
JOINED = "flask_idempotency.joined"


#: The savepoint that marks "the view's last ``commit()``".
SAVEPOINT = "flask_idempotency_view"

#: The attempt joined to a connection, by its DBAPI connection (what a cursor
#: names) and by the pool's proxy of it (what SQLAlchemy hands the dialect's
#: ``do_begin``, ``do_commit`` and ``do_rollback``): one lookup either way.
_JOINED_BY_DBAPI: dict[Any, Joined] = {}


@dataclasses.dataclass
class Joined:
    """One attempt's session, joined to its connection.

    The view's ``commit()`` costs no statement: it only notes that the next
    stretch of work needs a savepoint to return to, which the session's next
    ``BEGIN`` sets (most views commit once and are done, and never pay for it).
    Its ``rollback()`` returns to that savepoint, or, when nothing was committed
    yet in a row-mode attempt, restarts the attempt's transaction (the claim is
    committed on its own there). A transaction-mode attempt's transaction holds
    the claim itself, so its first stretch always starts with a savepoint.

    What opens a stretch (the ``BEGIN``, the savepoint) is deferred to the
    stretch's first statement: with psycopg2, whose statements go to the server
    as text, it is sent in that statement's round trip; psycopg 3 binds
    parameters on the server, one statement per message, so there it goes just
    before, on its own.
    """

    session: Session
    connection: SAConnection
    tx: PostgresRequest
    #: The DBAPI connection and the pool's proxy of it (``_JOINED_BY_DBAPI``'s keys).
    raw: Any
    proxy: Any
    #: The session's statements can carry the deferred ones in their round trip.
    inline: bool = False
    #: A savepoint marks where the current stretch of work began.
    savepoint: bool = False
    #: The view committed: the next stretch needs a savepoint of its own.
    committed: bool = False
    #: The attempt is being settled: the session's commit or rollback ends its own
    #: bookkeeping only; the extension's COMMIT or ROLLBACK follows.
    settling: bool = False
    #: ``get_bind``'s answers by mapper, for the ORM's flush (``JoiningSession``).
    binds: dict[Any, Any] = dataclasses.field(default_factory=dict)

    def route(self, chosen: Any) -> Any:
        """The attempt's connection where the application chose the engine it joined;
        any other bind (a second database) as chosen."""
        return self.connection if chosen is self.connection.engine else chosen

    def open(self) -> None:
        """The session begins (its first statement, or the first after a
        ``commit()``)."""
        tx = self.tx
        if not tx.in_transaction:
            # The attempt's transaction opens with the session's first statement, as
            # the raw path's opens with the view's first connection() call.
            tx.defer("BEGIN")
            self.savepoint = self.committed = False
        elif self.committed or (not self.savepoint and not tx.holds_lease):
            tx.defer(f"SAVEPOINT {SAVEPOINT}")
            self.savepoint, self.committed = True, False

    def before_statement(self, statement: str | None) -> str | None:
        """The session sends ``statement`` (``None``: a batch, which cannot carry
        more): what was deferred goes with it, or just before it."""
        deferred = self.tx.take_deferred()
        if deferred is None:
            return statement
        if self.inline and statement is not None:
            return f"{deferred};\n{statement}"
        self._send(deferred)
        return statement

    def commit_point(self) -> None:
        if not self.settling:
            self.committed = True

    def rollback_point(self) -> None:
        if self.settling or self.tx.has_deferred:
            return  # (nothing was sent since this stretch began: nothing to discard)
        if self.savepoint:
            self._send(f"ROLLBACK TO SAVEPOINT {SAVEPOINT}")
        else:  # row mode, nothing committed yet: all of it goes
            self._send("ROLLBACK;\nBEGIN")

    def _send(self, sql: str, *, begin: bool = False) -> None:
        try:
            self.tx.execute_in_transaction(sql, begin=begin)
        except StoreUnavailableError as exc:
            # The attempt is over: the session's own rollback, which SQLAlchemy
            # attempts while it handles this error, must not try the connection again.
            self.settling = True
            raise StoreUnavailable() from exc


class SessionJoin:
    """Joins an application's scoped session to the claimed attempts of one app.

    The session works on the attempt's connection as its own: it begins, commits
    and rolls back as usual, and SQLAlchemy asks the dialect to commit or roll
    back the DBAPI connection. On a joined connection the dialect instead moves a
    savepoint (see :class:`Joined`): the view's ``commit()`` keeps what it wrote
    so far within the attempt's transaction, its ``rollback()`` discards what
    came since, and only the extension's completion commits. What is sent goes
    straight to the driver.
    """

    def __init__(self, engine: Engine, sessions: scoped_session[Any], pool: EnginePool) -> None:
        self.engine = engine
        self.sessions = sessions
        self.pool = pool
        #: psycopg2 sends a statement as text (parameters bound on the client), so
        #: the deferred ``BEGIN`` or savepoint can go in the same message.
        self.inline = engine.dialect.driver == "psycopg2"
        factory = sessions.session_factory
        if not getattr(factory.class_, "_idempotency_joins", False):
            factory.class_ = _joining(factory.class_)
        _divert_transactions(engine)

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

    def join(self, ctx: RequestState) -> None:
        """Make ``db.session`` work on ``ctx``'s transaction until the attempt ends."""
        tx = ctx.tx
        assert tx is not None and not isinstance(tx, MemoryRequest)  # (init_app refuses it)
        raw = tx.held_connection()
        connection, proxy = self.pool.sqlalchemy_connection(raw)
        session = self.sessions()
        if session.in_transaction():
            session.rollback()  # (detach() ended it before the claim; a safety net)
        joined = Joined(session, connection, tx, raw, proxy, self.inline)
        session.info[JOINED] = joined
        _JOINED_BY_DBAPI[raw] = _JOINED_BY_DBAPI[proxy] = joined
        ctx.session = joined

    def keep(self, ctx: RequestState) -> None:
        """The answer will be stored: flush what the session holds into the attempt's
        transaction, so the one ``COMMIT`` keeps it. Raises what the flush raises."""
        joined = ctx.session
        if isinstance(joined, Joined) and joined.session.in_transaction():
            joined.session.flush()
            joined.settling = True
            joined.session.commit()

    def discard(self, ctx: RequestState) -> None:
        """The attempt is released: end the session's transaction without keeping it
        (the extension's own rollback follows)."""
        joined = ctx.session
        if isinstance(joined, Joined):
            joined.settling = True
            if joined.session.in_transaction():
                try:
                    joined.session.rollback()
                except Exception as exc:  # the connection may be gone (an outage)
                    log.debug("idempotency: session rollback failed: %s", type(exc).__name__)

    def before_checkpoint(self, ctx: RequestState) -> None:
        """A recovery point commits the attempt's transaction and opens the next:
        keep the session's writes in it, and let the next use set a new savepoint."""
        joined = ctx.session
        if isinstance(joined, Joined):
            self.keep(ctx)
            joined.settling = False
            joined.savepoint = joined.committed = False

    def leave(self, ctx: RequestState) -> None:
        """Give the session back as it was; the attempt's transaction is over."""
        joined = ctx.session
        if not isinstance(joined, Joined):
            return
        ctx.session = None
        joined.settling = True
        session = joined.session
        if session.in_transaction():
            try:
                session.rollback()
            except Exception as exc:
                log.debug("idempotency: session rollback failed: %s", type(exc).__name__)
        session.info.pop(JOINED, None)
        _JOINED_BY_DBAPI.pop(joined.raw, None)
        _JOINED_BY_DBAPI.pop(joined.proxy, None)


def _divert_transactions(engine: Engine) -> None:
    """On a joined connection, the dialect's commit and rollback move the view's
    savepoint instead of ending the attempt's transaction; on every other
    connection they are the dialect's own. The attempt's transaction itself opens
    with the session's first ``BEGIN`` (the dialect's ``do_begin``, which sends
    nothing of its own: the driver begins implicitly). Diverting the dialect rather
    than listening to the engine's events keeps SQLAlchemy's per-connection event
    dispatch off every connection of the engine. Its ``do_execute`` and kin send
    what the attempt deferred (``Joined.before_statement``) with the statement."""
    dialect = engine.dialect
    if getattr(dialect, "_idempotency_diverted", False):
        return
    begin, commit, rollback = dialect.do_begin, dialect.do_commit, dialect.do_rollback
    execute, execute_no_params = dialect.do_execute, dialect.do_execute_no_params
    executemany = dialect.do_executemany

    def do_execute(cursor: Any, statement: str, parameters: Any, context: Any = None) -> None:
        joined = _joined_to_cursor(cursor)
        if joined is not None:
            statement = joined.before_statement(statement) or statement
        execute(cursor, statement, parameters, context)

    def do_execute_no_params(cursor: Any, statement: str, context: Any = None) -> None:
        joined = _joined_to_cursor(cursor)
        if joined is not None:
            statement = joined.before_statement(statement) or statement
        execute_no_params(cursor, statement, context)

    def do_executemany(cursor: Any, statement: str, parameters: Any, context: Any = None) -> None:
        joined = _joined_to_cursor(cursor)
        if joined is not None:
            joined.before_statement(None)
        executemany(cursor, statement, parameters, context)

    def do_begin(dbapi_connection: Any) -> None:
        joined = _joined_to(dbapi_connection)
        if joined is None:
            begin(dbapi_connection)
        else:
            joined.open()

    def do_commit(dbapi_connection: Any) -> None:
        joined = _joined_to(dbapi_connection)
        if joined is None:
            commit(dbapi_connection)
        else:
            joined.commit_point()

    def do_rollback(dbapi_connection: Any) -> None:
        joined = _joined_to(dbapi_connection)
        if joined is None:
            rollback(dbapi_connection)
        else:
            joined.rollback_point()

    dialect.do_execute = do_execute  # type: ignore[method-assign]
    dialect.do_execute_no_params = do_execute_no_params  # type: ignore[method-assign]
    dialect.do_executemany = do_executemany  # type: ignore[method-assign]
    dialect.do_begin = do_begin  # type: ignore[method-assign]
    dialect.do_commit = do_commit  # type: ignore[method-assign]
    dialect.do_rollback = do_rollback  # type: ignore[method-assign]
    dialect._idempotency_diverted = True  # type: ignore[attr-defined]


def _joined_to_cursor(cursor: Any) -> Joined | None:
    """The attempt joined to the connection of a cursor SQLAlchemy executes on."""
    if not _JOINED_BY_DBAPI:
        return None
    return _JOINED_BY_DBAPI.get(cursor.connection)


def _joined_to(dbapi_connection: Any) -> Joined | None:
    """The attempt joined to a connection SQLAlchemy hands its dialect (the pool's
    proxy of the driver's connection, or the driver's connection itself)."""
    if not _JOINED_BY_DBAPI:
        return None
    return _JOINED_BY_DBAPI.get(dbapi_connection)


def from_app(
    app: Flask, db: Any, engine: Engine | None, session: Any
) -> tuple[EnginePool, SessionJoin | None]:
    """The pool and the session join for ``init_app(app, db=db)`` (Flask-SQLAlchemy)
    or ``init_app(app, engine=engine, session=scoped_session)`` (plain SQLAlchemy)."""
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
    if not isinstance(engine, Engine):
        raise TypeError("engine= must be a sqlalchemy.engine.Engine")
    if "alembic" in sys.modules:
        # A migration run (Flask-Migrate, or Alembic's env.py importing the app):
        # autogenerate must not propose dropping the extension's tables. A web
        # worker, which never imports Alembic, does not pay for it.
        importlib.import_module("flask_idempotency.alembic")
    pool = EnginePool(engine)
    if session is None:
        return pool, None
    if not hasattr(session, "session_factory") or not hasattr(session, "registry"):
        raise TypeError("session= must be a sqlalchemy.orm.scoped_session")
    return pool, SessionJoin(engine, session, pool)


def _joined_elsewhere(engine: Any) -> bool:
    """Whether the current attempt joined another session to ``engine``'s database."""
    if not has_app_context():
        return False
    ctx = request_state()
    joined = ctx.session if ctx is not None else None
    return isinstance(joined, Joined) and joined.connection.engine is engine


def _joining(base: type[Session]) -> type[Session]:
    """``base`` with a ``get_bind`` that routes a joined attempt to its connection."""

    class JoiningSession(base):  # type: ignore[valid-type,misc]
        _idempotency_joins = True

        def get_bind(self, mapper: Any = None, clause: Any = None, **kwargs: Any) -> Any:
            joined: Joined | None = self.info.get(JOINED)
            if joined is not None:
                if clause is None and not kwargs:
                    # The ORM's flush asks this for each statement, the same question
                    # each time; a mapper's database does not change within an attempt.
                    bind = joined.binds.get(mapper)
                    if bind is None:
                        bind = joined.binds[mapper] = joined.route(super().get_bind(mapper))
                    return bind
                return joined.route(super().get_bind(mapper=mapper, clause=clause, **kwargs))
            chosen = super().get_bind(mapper=mapper, clause=clause, **kwargs)
            if _joined_elsewhere(chosen):
                raise RuntimeError(
                    "a second session on the idempotent request's database (after "
                    "db.session.remove() in the view?): its writes would not commit with "
                    "the stored answer. Keep using db.session; don't remove it in the view."
                )
            return chosen

    JoiningSession.__name__ = base.__name__
    JoiningSession.__qualname__ = base.__qualname__
    return JoiningSession
