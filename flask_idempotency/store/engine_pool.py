"""The store's connections from a SQLAlchemy engine: one pool per process, not two.

With ``Idempotency(app, db=db)`` the extension opens no connection of its own:
each request checks one out of ``db``'s engine pool (``engine.raw_connection()``), the
same pool, the same DSN, the same connect arguments and events the
application configured. The store works on the DBAPI connection underneath
(psycopg2 or psycopg 3) in autocommit mode, as it does on its own pool, and
the request's ``db.session`` joins the very same connection
(``flask_idempotency.sqlalchemy``), so the view's writes and the stored
answer commit together. The SQLAlchemy ``Connection`` the session joins is made
only then, over the same pooled connection: a replay or a refused claim never
builds one.

A connection goes back to the engine as it came: ``autocommit`` restored, no
transaction open. One the watchdog cut or the server dropped is invalidated,
so the engine's pool replaces it instead of handing it to the next request.

The lease keeper renews on a connection of its own, from a pool made like the
engine's (``Pool.recreate()``: the same creator, connect arguments and pool
events) that holds only that one, so it never takes one of the application's
connections and never waits behind requests.

Requests take their connections within a count of the engine's capacity kept
here, so a request that has to wait, waits where
it can give up: at its claim's deadline, or at once when the store's circuit
breaker opens (``pool.Checkout``), never for the engine's ``pool_timeout``
behind requests stuck on a PostgreSQL that stopped answering.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import sqlalchemy
import sqlalchemy.exc
from sqlalchemy.engine import Connection as SAConnection
from sqlalchemy.engine import Engine

from . import driver
from .base import BreakerOpenError, StoreUnavailableError
from .driver import for_dialect
from .errors import connect_failure
from .pool import (
    ABANDONED,
    Checkout,
    Connection,
    Pool,
    Slots,
    connect_timeout,
    connect_within,
    wait_for_slot,
)

#: Seconds a request waits for one of the engine's connections when the engine's
#: pool does not say (its ``timeout()``), as SQLAlchemy's own default.
DEFAULT_WAIT = 30.0


class _Lent:
    """One connection out of the engine's pool: the pool's proxy, the SQLAlchemy
    connection made over it once a session joins, its own ``autocommit``."""

    __slots__ = ("fairy", "connection", "autocommit")

    def __init__(self, fairy: Any, autocommit: bool) -> None:
        self.fairy = fairy
        self.connection: SAConnection | None = None
        self.autocommit = autocommit

    def give_back(self, *, invalidate: bool) -> None:
        """Back to the engine's pool (through the SQLAlchemy connection if there is one)."""
        owner: Any = self.connection if self.connection is not None else self.fairy
        if invalidate:
            owner.invalidate()
        owner.close()


class EnginePool(Pool):
    """Lends the DBAPI connections of ``engine``'s pool to the store."""

    def __init__(self, engine: Engine) -> None:
        if engine.dialect.name != "postgresql":
            raise ValueError(
                f"flask_idempotency needs PostgreSQL; db's engine is {engine.dialect.name}"
            )
        self.engine = engine
        self.driver = for_dialect(engine.dialect.driver)
        #: DBAPI connection -> what the engine lent with it.
        self._lent: dict[Any, _Lent] = {}
        self._lock = threading.Lock()
        self._renewal: Any = None
        #: The keeper's pool (``engine.pool.recreate()``), made on first use.
        self._keeper_pool: Any = None
        self._renewal_pid = -1
        self._renewal_lock = threading.Lock()
        self._slots_pid = -1
        self._slots: Slots | None = None
        #: The engine's pool says how many connections it holds idle (a
        #: ``QueuePool``'s ``checkedin()``; ``dispose()`` recreates the same class);
        #: a pool that does not say is taken to connect.
        self._counts_idle = callable(getattr(engine.pool, "checkedin", None))
        _bound_connects(engine.dialect)

    # -- request connections ---------------------------------------------------

    def _request_slots(self) -> Slots | None:
        """The count of connections requests may hold (this process's), or ``None``
        when the engine's pool has no fixed size."""
        if self._slots_pid != os.getpid():
            capacity = self.capacity()
            if getattr(self.engine.pool, "_max_overflow", 0) < 0:
                capacity = None  # no limit on the engine's side: none here either
            self._slots = Slots(capacity[0]) if capacity and capacity[0] > 0 else None
            self._slots_pid = os.getpid()
        return self._slots

    def _wait_for_slot(self, slots: Slots, checkout: Checkout | None) -> None:
        """Every slot is taken: wait for one as the engine's pool would (its
        ``timeout()``), within ``checkout``'s terms, or raise."""
        timeout = getattr(self.engine.pool, "timeout", None)
        wait = float(timeout()) if callable(timeout) else DEFAULT_WAIT
        observer = self.observer
        if observer is not None:
            observer.pool_waiting(1)
        try:
            taken = wait_for_slot(slots, wait, checkout)
        finally:
            if observer is not None:
                observer.pool_waiting(-1)
        if taken:
            return
        if checkout is not None and checkout.abandoned():
            raise BreakerOpenError(ABANDONED)
        if observer is not None:
            observer.pool_timeout()
        raise StoreUnavailableError("no free connection in db's pool")

    def getconn(self, checkout: Checkout | None = None) -> Connection:
        slots = self._slots if self._slots_pid == os.getpid() else self._request_slots()
        if slots is not None and not slots.acquire(blocking=False):
            self._wait_for_slot(slots, checkout)
        try:
            if checkout is None:
                return self._checkout(None)
            if checkout.abandoned():
                raise BreakerOpenError(ABANDONED)
            pool: Any = self.engine.pool
            if self._counts_idle and pool.checkedin() > 0:
                # The usual case, and the hot path: an idle connection, no connect. (If
                # another thread takes it first, this connect still ends by its timeout.)
                return self._checkout(checkout)
            # The engine's checkout will connect: in a thread the request can give up on.
            return connect_within(lambda: self._checkout(checkout), checkout, self._give_back)
        except BaseException:
            if slots is not None:
                slots.release()
            raise

    def _give_back(self, conn: Connection) -> None:
        """A checkout its request gave up on while it was made: back to the engine."""
        with self._lock:
            lent = self._lent.pop(conn)
        if self.observer is not None:
            self.observer.pool_checkin()
        try:
            conn.autocommit = lent.autocommit
            lent.give_back(invalidate=False)
        except driver.ERRORS:
            lent.give_back(invalidate=True)

    def _checkout(self, checkout: Checkout | None) -> Connection:
        """One of the engine's connections, lent to the store in autocommit mode; a
        connect it needs ends by ``checkout``'s deadline (``_bound_connects``)."""
        # The pool's proxy, not engine.connect(): a replay needs no SQLAlchemy
        # Connection, and the join makes one over this proxy when it needs it.
        _CONNECT_LIMIT.checkout = checkout
        try:
            fairy = self.engine.raw_connection()
        except sqlalchemy.exc.TimeoutError as exc:
            if self.observer is not None:
                self.observer.pool_timeout()
            raise StoreUnavailableError(f"no free connection in db's pool: {exc}") from exc
        except sqlalchemy.exc.DBAPIError as exc:
            cause = exc.orig or exc  # the driver's error, which the store classifies
            raise StoreUnavailableError(
                f"cannot connect to PostgreSQL: {connect_failure(cause)}"
            ) from cause
        except driver.ERRORS as exc:  # the pool's connect raises the driver's own
            raise StoreUnavailableError(
                f"cannot connect to PostgreSQL: {connect_failure(exc)}"
            ) from exc
        finally:
            _CONNECT_LIMIT.checkout = None
        raw: Any = fairy.driver_connection
        try:
            lent = _Lent(fairy, bool(raw.autocommit))
            raw.autocommit = True
        except driver.ERRORS as exc:
            fairy.invalidate()
            fairy.close()
            reason = type(exc).__name__
            raise StoreUnavailableError(f"unusable pooled connection: {reason}") from exc
        with self._lock:
            self._lent[raw] = lent
        if self.observer is not None:
            self.observer.pool_checkout()
        conn: Connection = raw
        return conn

    def sqlalchemy_connection(self, raw: Any) -> tuple[SAConnection, Any]:
        """The SQLAlchemy connection over a DBAPI connection this pool lent, made the
        first time it is asked for (as ``engine.connect()`` makes one, over the
        pool's proxy this pool already holds), and that proxy (what SQLAlchemy hands
        the dialect's ``do_begin``, ``do_commit`` and ``do_rollback``)."""
        with self._lock:
            lent = self._lent[raw]
        if lent.connection is None:
            lent.connection = SAConnection(self.engine, lent.fairy)
        return lent.connection, lent.fairy

    def putconn(self, conn: Connection, *, discard: bool = False) -> None:
        with self._lock:
            lent = self._lent.pop(conn)
            slots = self._slots if self._slots_pid == os.getpid() else None
        if slots is not None:
            slots.release()
        try:
            if not discard and not conn.closed:
                try:
                    if self.driver.in_transaction(conn):  # not idle: roll back first
                        with self.driver.cursor(conn) as cur:
                            cur.execute("ROLLBACK")
                    conn.autocommit = lent.autocommit
                except driver.ERRORS:
                    discard = True
            lent.give_back(invalidate=discard or bool(conn.closed))
        finally:
            if self.observer is not None:
                self.observer.pool_checkin()

    def discard_idle(self) -> None:
        """After an outage: the engine's idle connections are as dead as ours were."""
        self.engine.pool.dispose()

    def capacity(self) -> tuple[int, str] | None:
        size = getattr(self.engine.pool, "size", None)
        if not callable(size):
            return None
        overflow = getattr(self.engine.pool, "_max_overflow", 0)
        total = int(size()) + max(0, int(overflow))
        return total, "db's engine pool_size + max_overflow"

    # -- the lease keeper's connection -------------------------------------------

    def renewal_connection(self) -> Connection:
        with self._renewal_lock:
            if self._renewal_pid != os.getpid():
                # The parent's, after a fork: not ours to return.
                self._renewal = self._keeper_pool = None
                self._renewal_pid = os.getpid()
            if self._renewal is not None and self._renewal.driver_connection.closed:
                self._drop_renewal()
            if self._renewal is None:
                if self._keeper_pool is None:
                    self._keeper_pool = self.engine.pool.recreate()
                try:
                    fairy = self._keeper_pool.connect()
                except sqlalchemy.exc.DBAPIError as exc:
                    cause = exc.orig or exc
                    raise StoreUnavailableError(
                        f"cannot connect to PostgreSQL: {connect_failure(cause)}"
                    ) from cause
                except driver.ERRORS as exc:  # a pool's connect raises the driver's own
                    raise StoreUnavailableError(
                        f"cannot connect to PostgreSQL: {connect_failure(exc)}"
                    ) from exc
                raw: Any = fairy.driver_connection
                raw.autocommit = True
                self._renewal = fairy
            conn: Connection = self._renewal.driver_connection
            return conn

    def discard_renewal_connection(self) -> None:
        with self._renewal_lock:
            self._drop_renewal()

    def _drop_renewal(self) -> None:
        fairy, self._renewal = self._renewal, None
        if fairy is not None:
            fairy.invalidate()
            fairy.close()

    def close(self) -> None:
        """Close the keeper's connection and its pool; the engine itself is the app's."""
        with self._renewal_lock:
            fairy, self._renewal = self._renewal, None
            keeper_pool, self._keeper_pool = self._keeper_pool, None
            if self._renewal_pid != os.getpid():
                return  # the parent's, after a fork: not ours to close
            if fairy is not None:
                try:
                    if not fairy.driver_connection.closed:
                        fairy.driver_connection.autocommit = False
                    fairy.close()
                except driver.ERRORS:
                    fairy.invalidate()
            if keeper_pool is not None:
                keeper_pool.dispose()


#: The store's checkout this thread is making, if any: a connect it needs ends by
#: the checkout's deadline (``_bound_connects``); the app's own connects keep theirs.
_CONNECT_LIMIT = threading.local()


def _bound_connects(dialect: Any) -> None:
    """A connect for one of the store's checkouts ends by the checkout's deadline (an
    engine with no ``connect_timeout`` would wait for ever behind a frozen server:
    its kernel still accepts the TCP connection).

    The dialect's ``connect`` is wrapped, once, rather than a ``do_connect`` event
    listened to: any listener on the engine's dialect puts SQLAlchemy's event
    dispatch on every statement the application executes."""
    if getattr(dialect, "_idempotency_bound_connects", False):
        return
    connect = dialect.connect

    def bounded_connect(*cargs: Any, **cparams: Any) -> Any:
        checkout = getattr(_CONNECT_LIMIT, "checkout", None)
        seconds = connect_timeout(checkout, None) if checkout is not None else None
        if seconds is not None:
            try:
                given = float(cparams.get("connect_timeout") or 0)
            except (TypeError, ValueError):
                given = 0
            if given <= 0 or given > seconds:
                cparams["connect_timeout"] = seconds
        return connect(*cargs, **cparams)

    dialect.connect = bounded_connect
    dialect._idempotency_bound_connects = True
