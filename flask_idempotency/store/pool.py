"""The store's one pool: a SQLAlchemy engine's, lent a connection at a time.

Every connection the extension uses comes from a SQLAlchemy ``Engine``: the
application's (``Idempotency(app, db=db)`` or ``engine=``) or one the extension
builds from ``IDEMPOTENCY_DATABASE_URL``. SQLAlchemy's ``QueuePool`` does the
waiting, the sizing, the reset on return and the invalidation of broken
connections; nothing here re-implements any of it.

A request's connection is an ordinary ``engine.connect()`` whose driver
connection is put in autocommit mode (the driver's own ``autocommit``
attribute), so the extension's own statements (the claim, the completion with
its ``COMMIT``) are one round trip each, and given back as it came. Not
SQLAlchemy's ``isolation_level="AUTOCOMMIT"`` option: resetting that on return
makes psycopg2 send ``SET default_transaction_isolation`` every time, a round
trip per request that no deadline bounds. The request's ``db.session`` joins
that same ``Connection`` (``sqlalchemy_session.py``).

Fork safety is SQLAlchemy's documented recipe ("Using Connection Pools with
Multiprocessing or os.fork()"): each pooled connection remembers the process
that opened it, and a checkout in another process discards it instead of
sharing a socket with the parent. A process-id check needs no at-fork hook, so
it holds under uWSGI as under gunicorn.

The lease keeper renews on a connection of its own, from a copy of the
engine's pool (``Pool.recreate()``: the same creator and events) that only
the keeper uses, one renewal at a time, so it never takes one of the
application's connections and never waits behind requests.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

import psycopg2
import psycopg2.extensions
import sqlalchemy
import sqlalchemy.exc
from sqlalchemy import event
from sqlalchemy.engine import Connection as SAConnection
from sqlalchemy.engine import Engine
from sqlalchemy.pool import Pool

from ..observer import Observer
from . import driver
from .base import BreakerOpenError, StoreUnavailableError
from .driver import Driver, for_dialect
from .errors import is_unreachable, reason_of
from .schema import mismatch

#: A DBAPI connection (psycopg2's or psycopg 3's), as the store's statements use it.
Connection = Any

log = logging.getLogger("flask_idempotency.store")

#: Connection parameters added by default to an engine the extension builds (those
#: given in ``IDEMPOTENCY_DATABASE_OPTIONS`` override each): a peer that vanished is
#: noticed by TCP within seconds, even while a view's own long statement waits for
#: its answer. Keepalive probes start after 5 s of silence, every 5 s, 3 unanswered
#: probes close the connection; data left unacknowledged for 10 s closes it too
#: (``tcp_user_timeout``, libpq 12+).
TCP_DEFAULTS: dict[str, Any] = dict(
    keepalives=1, keepalives_idle=5, keepalives_interval=5, keepalives_count=3
)
if psycopg2.extensions.libpq_version() >= 120000:
    TCP_DEFAULTS["tcp_user_timeout"] = 10_000  # milliseconds

#: ``connection_record.info`` key of the process that opened a pooled connection.
_PID = "flask_idempotency.pid"


def build_engine(settings: Any) -> Engine:
    """The engine for ``IDEMPOTENCY_DATABASE_URL`` (``settings.Settings``): psycopg2,
    ``pool_size`` connections per process and no overflow. The DSN (a URL or
    ``key=value`` pairs, several hosts, ``target_session_attrs``...) is read by
    libpq's own parser (``psycopg2.extensions.parse_dsn``) into connection
    parameters, so it means exactly what it means to ``psycopg2.connect``."""
    parameters = {
        **psycopg2.extensions.parse_dsn(settings.database_url),
        "connect_timeout": max(1, round(settings.connect_timeout)),
        **TCP_DEFAULTS,
        **settings.connect_kwargs,
    }
    return sqlalchemy.create_engine(
        "postgresql+psycopg2://",
        connect_args=parameters,
        pool_size=settings.pool_size,
        max_overflow=0,
        pool_timeout=settings.pool_timeout,
    )


@dataclasses.dataclass(frozen=True)
class Checkout:
    """A request's terms for getting a connection: a connect it needs ends by
    ``until`` (monotonic clock), and none is made once ``abandoned()`` says so (the
    store's breaker opened while the request waited): a request never answers after
    several deadlines because it queued behind requests stuck on a frozen server."""

    until: float
    abandoned: Callable[[], bool]


#: The checkout this thread is making, if any (``_bound_connect`` reads it).
_CHECKOUT = threading.local()
#: The shortest connect timeout a driver honours, seconds: libpq 13 and later take 1
#: as 1, older ones (and psycopg 3, which keeps their rule) read it as 2.
MIN_CONNECT_TIMEOUT = 1 if psycopg2.extensions.libpq_version() >= 130000 else 2
#: Less than this left of a checkout's deadline: no connect is started (it could
#: only end after the deadline, as the timeout is whole seconds).
MIN_TIME_TO_CONNECT = 0.5
#: A checkout given up because the breaker opened while it waited.
ABANDONED = "PostgreSQL is not answering (store circuit breaker opened while waiting)"


def _bound_connect(dialect: Any, record: Any, cargs: Any, cparams: dict[str, Any]) -> None:
    """``do_connect``: a connect for one of the store's checkouts ends by the
    checkout's deadline (an application's engine may have no ``connect_timeout``,
    and behind a frozen server, whose kernel still accepts TCP, it would wait for
    ever); the application's own connects keep their parameters."""
    terms: Checkout | None = getattr(_CHECKOUT, "terms", None)
    if terms is None:
        return
    if terms.abandoned():
        raise BreakerOpenError(ABANDONED)
    left = terms.until - time.monotonic()
    if left < MIN_TIME_TO_CONNECT:
        raise StoreUnavailableError("no time left to connect before the deadline")
    floor = MIN_CONNECT_TIMEOUT if dialect.driver == "psycopg2" else 2
    limit = max(floor, round(left))  # whole seconds, within half a second of the deadline
    try:
        given = float(cparams.get("connect_timeout") or 0)
    except (TypeError, ValueError):
        given = 0
    if given <= 0 or given > limit:
        cparams["connect_timeout"] = limit


def _remember_pid(dbapi_connection: Any, connection_record: Any) -> None:
    connection_record.info[_PID] = os.getpid()


def _refuse_other_pid(dbapi_connection: Any, connection_record: Any, proxy: Any) -> None:
    pid = os.getpid()
    opened_by = connection_record.info.get(_PID, pid)
    if opened_by != pid:
        # Not closed: closing would end the parent's session on the shared socket.
        connection_record.dbapi_connection = proxy.dbapi_connection = None
        raise sqlalchemy.exc.DisconnectionError(
            f"connection opened by process {opened_by}, checked out in {pid}"
        )


def _unavailable(exc: BaseException) -> NoReturn:
    """Raise a checkout's failure as the store's error, with the driver's own error
    (which the breaker classifies) as its cause."""
    if isinstance(exc, sqlalchemy.exc.TimeoutError):
        raise StoreUnavailableError(f"no free database connection in the pool: {exc}") from exc
    cause = getattr(exc, "orig", None) or exc
    raise StoreUnavailableError(f"cannot connect to PostgreSQL: {reason_of(cause)}") from cause


class EnginePool:
    """Lends ``engine``'s connections to the store, in autocommit mode."""

    #: Told about checkouts and timeouts once the app is observed
    #: (``observability.attach``); ``None`` costs one attribute read per call.
    observer: Observer | None = None

    def __init__(
        self, engine: Engine, *, owned: bool = False, max_overflow: int | None = None
    ) -> None:
        #: How the engine's DBAPI connections take the store's statements.
        self.driver: Driver = for_dialect(engine.dialect)
        self.engine = engine
        #: The extension built the engine (and disposes of it on ``close()``).
        self.owned = owned
        #: The engine's ``max_overflow`` when known (SQLAlchemy's pools do not say
        #: it): none for the extension's own engine; Flask-SQLAlchemy's from its
        #: config; unknown for an engine given with ``engine=``.
        self._max_overflow = 0 if owned else max_overflow
        #: DBAPI connection -> the SQLAlchemy connection it was lent with.
        self._lent: dict[Any, SAConnection] = {}
        self._lock = threading.Lock()
        #: The lease keeper's pool, and the process that made it.
        self._keeper: tuple[int, Pool] | None = None
        self._warned_wait = False
        # Once per engine: SQLAlchemy's documented fork recipe (a connection opened by
        # another process is discarded at checkout, never used), and the bound on a
        # connect for one of the store's checkouts (``_bound_connect``).
        if not event.contains(engine, "checkout", _refuse_other_pid):
            event.listen(engine, "connect", _remember_pid)
            event.listen(engine, "checkout", _refuse_other_pid)
            event.listen(engine, "do_connect", _bound_connect)

    # -- request connections ---------------------------------------------------

    def getconn(self, terms: Checkout | None = None) -> Connection:
        """One of the engine's connections, in autocommit mode, within ``terms``;
        ``StoreUnavailableError`` when none comes free within the pool's timeout or
        the connect fails, ``BreakerOpenError`` when the breaker opened meanwhile."""
        observer = self.observer
        waiting = self._must_wait() and observer is not None
        if waiting:
            observer.pool_waiting(1)  # type: ignore[union-attr]
        _CHECKOUT.terms = terms
        try:
            connection = self.engine.connect()
        except sqlalchemy.exc.TimeoutError as exc:
            if self.observer is not None:
                self.observer.pool_timeout()
            _unavailable(exc)
        except (sqlalchemy.exc.DBAPIError, *driver.ERRORS) as exc:  # type: ignore[misc]
            _unavailable(exc)
        finally:
            _CHECKOUT.terms = None
            if waiting:
                observer.pool_waiting(-1)  # type: ignore[union-attr]
        if terms is not None and terms.abandoned():
            connection.close()
            raise BreakerOpenError(ABANDONED)
        try:
            raw: Any = connection.connection.driver_connection
            raw.autocommit = True  # (False again before it goes back: putconn)
        except (sqlalchemy.exc.DBAPIError, *driver.ERRORS) as exc:  # type: ignore[misc]
            connection.invalidate()
            connection.close()
            raise StoreUnavailableError(
                f"unusable pooled connection: {type(exc).__name__}"
            ) from exc
        with self._lock:
            self._lent[raw] = connection
        if self.observer is not None:
            self.observer.pool_checkout()
        return raw

    def _must_wait(self) -> bool:
        """Whether a checkout now waits for one of the pool's connections (every one
        it may open is lent), which says the pool is smaller than the worker's
        threads: warned about once per process. ``False`` when the pool's capacity
        is unknown (an engine given with ``engine=``)."""
        capacity = self.capacity()
        pool: Any = self.engine.pool
        if capacity is None or pool.checkedin() > 0 or pool.checkedout() < capacity[0]:
            return False
        if not self._warned_wait:
            self._warned_wait = True
            log.warning(
                "idempotency: a request waited for a database connection: all %d of %s "
                "are in use. Each in-flight idempotent request holds one until it "
                "completes; size the pool to at least the worker's threads (requests "
                "answer 503 after its pool_timeout). Logged once per process.",
                *capacity,
            )
        return True

    def sqlalchemy_connection(self, raw: Connection) -> SAConnection:
        """The SQLAlchemy connection ``raw`` was lent with (what a session joins)."""
        with self._lock:
            return self._lent[raw]

    def putconn(self, conn: Connection, *, discard: bool = False) -> None:
        """Back to the engine out of autocommit mode, as it was lent; invalidated
        (SQLAlchemy replaces it) if it broke or still has a transaction open: closing
        it rolls that back on the server, where a ``ROLLBACK`` sent here could wait
        on a server that stopped answering, with no deadline."""
        with self._lock:
            connection = self._lent.pop(conn)
        try:
            # In a transaction (or a failed one), not idle: read as both drivers spell it.
            discard = discard or bool(conn.closed) or bool(conn.info.transaction_status)
            if not discard:
                conn.autocommit = False
        except driver.ERRORS:
            discard = True
        try:
            if discard:
                connection.invalidate()
            connection.close()
        except (sqlalchemy.exc.DBAPIError, *driver.ERRORS) as exc:  # type: ignore[misc]
            log.debug("idempotency: connection not returned cleanly: %s", type(exc).__name__)
        finally:
            if self.observer is not None:
                self.observer.pool_checkin()

    @contextmanager
    def connection(self, *, discard: bool = False) -> Iterator[Connection]:
        """A connection for the block, given back after it (closed with ``discard``).
        A driver error in the block is a ``StoreUnavailableError`` (the connection,
        and its idle peers when PostgreSQL looks unreachable, discarded), or for a
        missing table or function the ``SchemaMismatchError`` that names the
        command to run."""
        conn = self.getconn()
        unreachable = False
        try:
            yield conn
        except driver.ERRORS as exc:
            unreachable = is_unreachable(exc, conn)
            discard = discard or unreachable
            reason = f"{type(exc).__name__}: {exc}".strip()
            raise mismatch(exc) or StoreUnavailableError(reason) from exc
        finally:
            self.putconn(conn, discard=discard)
            if unreachable:
                self.discard_idle()

    def discard_idle(self) -> None:
        """After an outage the idle connections are as dead as the one that failed:
        the engine starts a new pool (``Engine.dispose(close=False)``), so later
        checkouts connect afresh, and the old one's idle connections are closed now
        (``Pool.dispose()``) when none of its connections is lent. While some are,
        requests may be waiting on it for the ones given back, and closing those
        would leave them waiting out the pool's timeout: it is then left to them,
        its connections closed as it is garbage-collected."""
        old: Any = self.engine.pool
        self.engine.dispose(close=False)
        if callable(getattr(old, "checkedout", None)) and old.checkedout() == 0:
            old.dispose()

    def capacity(self) -> tuple[int, str] | None:
        """How many requests can hold a connection at once, and the setting that
        decides it; ``None`` when that is not known (a pool of no fixed size, or an
        engine given with ``engine=``, whose ``max_overflow`` SQLAlchemy does not say)."""
        size = getattr(self.engine.pool, "size", None)
        if not callable(size) or self._max_overflow is None:
            return None
        if self.owned:
            return int(size()), 'IDEMPOTENCY_DATABASE_OPTIONS["pool_size"]'
        return int(size()) + self._max_overflow, "the engine's pool_size + max_overflow"

    @contextmanager
    def renewal(self) -> Iterator[Connection]:
        """The lease keeper's autocommit connection, outside the request pool: from a
        copy of the engine's pool (``Pool.recreate()``: the same creator and events)
        that only the keeper uses, so it never takes one of the application's
        connections and never waits behind requests. Invalidated after a failure."""
        with self._lock:
            if self._keeper is None or self._keeper[0] != os.getpid():
                # None yet, or the parent's after a fork: forgotten, not closed.
                self._keeper = (os.getpid(), self.engine.pool.recreate())
            pool = self._keeper[1]
        try:
            proxy = pool.connect()
        except (sqlalchemy.exc.DBAPIError, *driver.ERRORS) as exc:  # type: ignore[misc]
            _unavailable(exc)
        raw: Any = proxy.driver_connection
        try:
            raw.autocommit = True
            yield raw
            raw.autocommit = False
        except BaseException:
            proxy.invalidate()
            raise
        finally:
            proxy.close()

    def close(self) -> None:
        """Close the keeper's pool; the engine too when the extension built it (an
        application's engine is the application's)."""
        with self._lock:
            keeper, self._keeper = self._keeper, None
        if keeper is not None and keeper[0] == os.getpid():
            keeper[1].dispose()
        if self.owned:
            self.engine.dispose()
