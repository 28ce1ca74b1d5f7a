"""A small blocking, fork-aware psycopg2 connection pool.

psycopg2's own pools raise at once when exhausted and know nothing of fork;
under gunicorn a connection inherited from the master must never be used by a
worker (two processes on one socket corrupt the protocol). This pool waits up
to a timeout for a free connection, notices a fork by PID and starts afresh,
and drops connections that come back broken.

Each pool also gives the lease keeper a connection of its own
(``renewal_connection()``), never one of the request slots: renewals must go on
while every slot is held by a slow view, or leases would lapse under live
requests and a duplicate on another worker would take their keys over.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import psycopg2
import psycopg2.extensions
import psycopg2.pool

from ..observer import Observer
from . import driver
from .base import BreakerOpenError, StoreUnavailableError
from .driver import PSYCOPG2, Driver
from .errors import connect_failure, is_unreachable

Connection = psycopg2.extensions.connection

log = logging.getLogger("flask_idempotency.store")

#: Connection parameters added by default (those given in
#: ``IDEMPOTENCY_DATABASE_OPTIONS`` override each): a peer that vanished is
#: noticed by TCP within seconds, even while a view's own long statement waits
#: for its answer. Keepalive probes start after 5 s of silence, every 5 s, 3
#: unanswered probes close the connection; data left unacknowledged for 10 s
#: closes it too (``tcp_user_timeout``, libpq 12+).
TCP_DEFAULTS: dict[str, Any] = {
    "keepalives": 1,
    "keepalives_idle": 5,
    "keepalives_interval": 5,
    "keepalives_count": 3,
}
if psycopg2.extensions.libpq_version() >= 120000:
    TCP_DEFAULTS["tcp_user_timeout"] = 10_000  # milliseconds


#: How often a request waiting for a connection looks whether it should give up.
WAIT_SLICE = 0.05


@dataclasses.dataclass(frozen=True)
class Checkout:
    """A request's terms for getting a connection: no later than ``until`` (on the
    monotonic clock; ``None``: the pool's own timeout), and not at all once
    ``abandoned()`` says so (the store's circuit breaker opened meanwhile), so a
    request never answers after several deadlines because it queued behind
    requests stuck on a server that stopped answering."""

    until: float | None
    abandoned: Callable[[], bool]

    def remaining(self) -> float | None:
        return None if self.until is None else self.until - time.monotonic()


#: libpq's shortest connect timeout, seconds: it reads 1 as 2.
MIN_CONNECT_TIMEOUT = 2

#: A pool gave up on a checkout because the breaker opened.
ABANDONED = "PostgreSQL is not answering (store circuit breaker opened while waiting)"


class NoAnswerError(StoreUnavailableError):
    """A connect had no answer before the checkout's deadline (the store's breaker
    counts it as PostgreSQL not answering)."""


def connect_timeout(checkout: Checkout | None, configured: Any) -> int | None:
    """libpq's connect timeout for a checkout, seconds: ``configured`` cut to what is
    left of the checkout's time (whole seconds, at least libpq's 2); ``None`` when
    there is nothing to cut (keep ``configured``). It only bounds how long a connect
    the request gave up on goes on in the background (``connect_within``)."""
    remaining = checkout.remaining() if checkout is not None else None
    if remaining is None:
        return None
    if remaining <= 0:
        raise StoreUnavailableError("no time left to connect before the deadline")
    try:
        limit = float(configured) if configured is not None else math.inf
    except (TypeError, ValueError):
        limit = math.inf
    if limit <= 0:  # 0: libpq waits for ever
        limit = math.inf
    return max(MIN_CONNECT_TIMEOUT, math.ceil(min(limit, remaining)))


T = TypeVar("T")


def connect_within(
    connect: Callable[[], T], checkout: Checkout | None, discard: Callable[[T], None]
) -> T:
    """``connect()``, which the request can give up on: at the checkout's deadline
    (``NoAnswerError``) or when the breaker opens (``StoreUnavailableError``).

    A blocking connect cannot be interrupted, and behind a frozen server (its
    kernel still accepts the TCP connection) it waits out libpq's whole connect
    timeout, at least 2 s, whatever is left of the request's deadline. So it runs
    in a thread of its own; a request that gives up answers at once, and a
    connection that arrives after that is handed to ``discard``.
    """
    if checkout is None:
        return connect()
    outcome: list[Any] = []
    lock = threading.Lock()
    done = threading.Event()
    gave_up = False

    def run() -> None:
        try:
            outcome.append((True, connect()))
        except BaseException as exc:  # handed to the request, or dropped with it
            outcome.append((False, exc))
        with lock:
            done.set()
            late = gave_up
        ok, value = outcome[0]
        if late and ok:
            discard(value)

    threading.Thread(target=run, name="idempotency-connect", daemon=True).start()
    while not done.wait(WAIT_SLICE):
        remaining = checkout.remaining()
        abandoned = checkout.abandoned()
        if abandoned or (remaining is not None and remaining <= 0):
            with lock:
                if not done.is_set():
                    gave_up = True
                    if abandoned:
                        raise BreakerOpenError(ABANDONED)
                    raise NoAnswerError("no answer to the connect before the deadline")
    ok, value = outcome[0]
    if not ok:
        raise value
    connection: T = value
    return connection


class Slots:
    """A count of connections requests may hold: ``threading.BoundedSemaphore``'s
    ``acquire`` and ``release``, with the uncontended take and give-back one C lock
    each (the standard library's is Python over a ``Condition``: every request
    pays for it twice). A waiter waits on a condition of that same lock."""

    __slots__ = ("_lock", "_freed", "_free", "_capacity", "_waiters")

    def __init__(self, capacity: int) -> None:
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)
        self._free = self._capacity = capacity
        self._waiters = 0

    def acquire(self, blocking: bool = True, timeout: float | None = None) -> bool:
        with self._lock:
            if self._free > 0:
                self._free -= 1
                return True
            if not blocking:
                return False
            end = None if timeout is None else time.monotonic() + timeout
            self._waiters += 1
            try:
                while self._free <= 0:
                    left = None if end is None else end - time.monotonic()
                    if left is not None and left <= 0:
                        return False
                    self._freed.wait(left)
            finally:
                self._waiters -= 1
            self._free -= 1
            return True

    def release(self) -> None:
        with self._lock:
            if self._free >= self._capacity:
                raise ValueError("a connection slot was given back more often than taken")
            self._free += 1
            if self._waiters:
                self._freed.notify()


def wait_for_slot(slots: Slots, timeout: float, checkout: Checkout | None) -> bool:
    """Take one of ``slots`` within ``timeout`` seconds (less if ``checkout`` ends
    sooner); False if none came free or the checkout was abandoned meanwhile."""
    if checkout is None:
        return slots.acquire(timeout=timeout)
    remaining = checkout.remaining()
    end = time.monotonic() + (timeout if remaining is None else min(timeout, remaining))
    while True:
        left = end - time.monotonic()
        if left <= 0 or checkout.abandoned():
            return False
        if slots.acquire(timeout=min(left, WAIT_SLICE)):
            return True


class Pool:
    """What both pools share: a connection borrowed for a ``with`` block."""

    #: Told about checkouts, waits and timeouts once the app is observed
    #: (``observability.attach``); ``None`` costs one attribute read per call.
    observer: Observer | None = None
    #: The DBAPI driver of the connections this pool lends.
    driver: Driver = PSYCOPG2

    def getconn(self, checkout: Checkout | None = None) -> Connection:
        """A connection, waiting (if the pool waits at all) within ``checkout``'s terms."""
        raise NotImplementedError

    def putconn(self, conn: Connection, *, discard: bool = False) -> None:
        raise NotImplementedError

    def discard_idle(self) -> None:
        """Close the idle connections (after an outage they are as dead as ours was)."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def renewal_connection(self) -> Connection:
        """The lease keeper's own autocommit connection, outside the request slots;
        the same one on every call until ``discard_renewal_connection()``."""
        raise NotImplementedError

    def discard_renewal_connection(self) -> None:
        """Drop the keeper's connection after it failed; the next call makes another."""
        raise NotImplementedError

    @contextmanager
    def connection(self, *, discard: bool = False) -> Iterator[Connection]:
        """A connection for the block; closed after it with ``discard``."""
        conn = self.getconn()
        broken = discard
        try:
            yield conn
        except driver.ERRORS as exc:
            broken = is_unreachable(exc, conn)
            raise
        finally:
            self.putconn(conn, discard=broken)

    def capacity(self) -> tuple[int, str] | None:
        """How many requests can hold a connection at once, and the setting that
        decides it; ``None`` when the pool cannot tell."""
        return None


class ConnectionPool(Pool):
    """Connections to one DSN; at most ``max_size`` open per process."""

    def __init__(
        self,
        dsn: str,
        *,
        max_size: int = 10,
        timeout: float = 5.0,
        connect_timeout: int = 3,
        connect_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self._dsn = dsn
        self._max_size = max_size
        self._timeout = timeout
        self._connect_kwargs = {
            "connect_timeout": connect_timeout,
            **TCP_DEFAULTS,
            **(connect_kwargs or {}),
        }
        self._reset()

    @property
    def max_size(self) -> int:
        return self._max_size

    def capacity(self) -> tuple[int, str] | None:
        return self._max_size, 'IDEMPOTENCY_DATABASE_OPTIONS["pool_size"]'

    def _reset(self) -> None:
        # After a fork the inherited idle connections are forgotten, not closed:
        # closing would send a Terminate message on the parent's socket.
        self._pid = os.getpid()
        self._idle: deque[Connection] = deque()
        self._slots = Slots(self._max_size)
        self._lock = threading.Lock()
        self._renewal: Connection | None = None
        self._renewal_lock = threading.Lock()
        self._warned_wait = False

    def _check_fork(self) -> None:
        if self._pid != os.getpid():
            self._reset()

    def getconn(self, checkout: Checkout | None = None) -> Connection:
        self._check_fork()
        observer = self.observer
        if not self._slots.acquire(blocking=False):
            self._warn_wait()
            if not self._wait_for_slot(observer, checkout):
                if checkout is not None and checkout.abandoned():
                    raise BreakerOpenError(ABANDONED)
                if observer is not None:
                    observer.pool_timeout()
                raise StoreUnavailableError("no free database connection in the pool")
        try:
            if checkout is not None and checkout.abandoned():
                raise BreakerOpenError(ABANDONED)
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            if conn is None or conn.closed:
                args = self._connect_args(checkout)
                conn = connect_within(
                    lambda: psycopg2.connect(self._dsn, **args), checkout, self._keep_idle
                )
            conn.autocommit = True
            if observer is not None:
                observer.pool_checkout()
            return conn
        except psycopg2.Error as exc:
            self._slots.release()
            raise StoreUnavailableError(
                f"cannot connect to PostgreSQL: {connect_failure(exc)}"
            ) from exc
        except BaseException:
            self._slots.release()
            raise

    def _wait_for_slot(self, observer: Observer | None, checkout: Checkout | None) -> bool:
        if observer is None:
            return wait_for_slot(self._slots, self._timeout, checkout)
        observer.pool_waiting(1)
        try:
            return wait_for_slot(self._slots, self._timeout, checkout)
        finally:
            observer.pool_waiting(-1)

    def _keep_idle(self, conn: Connection) -> None:
        """A connection whose request gave up on it while it was made: kept for the next."""
        if self._pid != os.getpid():
            _close_quietly(conn)
            return
        conn.autocommit = True
        with self._lock:
            self._idle.append(conn)

    def _connect_args(self, checkout: Checkout | None) -> dict[str, Any]:
        """The connection parameters, the connect timeout cut to the checkout's time."""
        seconds = connect_timeout(checkout, self._connect_kwargs.get("connect_timeout"))
        if seconds is None:
            return self._connect_kwargs
        return {**self._connect_kwargs, "connect_timeout": seconds}

    def _warn_wait(self) -> None:
        if self._warned_wait:
            return
        self._warned_wait = True
        log.warning(
            "idempotency: a request waited for a database connection: all %d of "
            'IDEMPOTENCY_DATABASE_OPTIONS["pool_size"] are in use. Each in-flight idempotent '
            "request holds one until it completes; size the pool to at least the worker's "
            "threads (requests answer 503 after its pool_timeout). Logged once per process.",
            self._max_size,
        )

    def renewal_connection(self) -> Connection:
        self._check_fork()
        with self._renewal_lock:
            conn = self._renewal
            if conn is None or conn.closed:
                try:
                    conn = psycopg2.connect(self._dsn, **self._connect_kwargs)
                except psycopg2.Error as exc:
                    raise StoreUnavailableError(
                        f"cannot connect to PostgreSQL: {connect_failure(exc)}"
                    ) from exc
                conn.autocommit = True
                self._renewal = conn
            return conn

    def discard_renewal_connection(self) -> None:
        self._check_fork()
        with self._renewal_lock:
            conn, self._renewal = self._renewal, None
        if conn is not None:
            _close_quietly(conn)

    def putconn(self, conn: Connection, *, discard: bool = False) -> None:
        if self._pid != os.getpid():
            return  # borrowed before a fork; the slot belongs to the old pool
        try:
            if not discard and not conn.closed:
                if self.driver.in_transaction(conn):
                    conn.rollback() if not conn.autocommit else _rollback_raw(conn)
                with self._lock:
                    self._idle.append(conn)
                return
        except psycopg2.Error:
            pass
        finally:
            self._slots.release()
            if self.observer is not None:
                self.observer.pool_checkin()
        _close_quietly(conn)

    def discard_idle(self) -> None:
        """Close idle connections: called after an error that suggests a server restart,
        so the next request reconnects instead of failing on another stale socket."""
        self._check_fork()
        with self._lock:
            idle, self._idle = self._idle, deque()
        for conn in idle:
            _close_quietly(conn)

    def close(self) -> None:
        self.discard_idle()
        self.discard_renewal_connection()


class BorrowedPool(Pool):
    """Adapts an application's own ``psycopg2.pool`` to the interface above.

    Connections go back exactly as they were lent: the extension works in
    autocommit mode and restores the connection's own ``autocommit`` flag (its
    ``SET LOCAL`` settings end with their transactions). The one trace it leaves
    is the prepared claim, ``idempotency_claim``, when
    ``IDEMPOTENCY_DATABASE_OPTIONS["prepare_statements"]`` is on; an application that runs
    ``DEALLOCATE ALL`` or ``DISCARD ALL`` is fine, the claim is prepared again.

    The lease keeper keeps one connection of the application's pool for itself
    (taken when its thread starts, at the process's first claim; given back by
    ``close()``), so give that pool one connection more: renewals must not
    wait behind in-flight requests, and psycopg2's pools do not wait at all.
    """

    def __init__(self, pool: psycopg2.pool.AbstractConnectionPool) -> None:
        self._pool = pool
        #: Connections lent to the extension -> their own ``autocommit`` flag.
        self._lent: dict[Connection, bool] = {}
        self._renewal: Connection | None = None
        self._renewal_pid = -1
        self._renewal_lock = threading.Lock()

    def capacity(self) -> tuple[int, str] | None:
        maxconn = getattr(self._pool, "maxconn", None)
        if not isinstance(maxconn, int):
            return None
        # The lease keeper keeps one of a borrowed pool's connections for itself.
        return maxconn - 1, "the maxconn of IDEMPOTENCY_POOL (less one kept by the lease keeper)"

    def _borrow(self) -> Connection:
        try:
            conn: Connection = self._pool.getconn()
        except psycopg2.Error as exc:
            raise StoreUnavailableError(
                f"cannot connect to PostgreSQL: {connect_failure(exc)}"
            ) from exc
        try:
            self._lent[conn] = bool(conn.autocommit)
            conn.autocommit = True
        except psycopg2.Error as exc:
            self._give_back(conn, discard=True)
            raise StoreUnavailableError(
                f"unusable pooled connection: {type(exc).__name__}"
            ) from exc
        return conn

    def _give_back(self, conn: Connection, *, discard: bool) -> None:
        autocommit = self._lent.pop(conn, None)
        if not discard and not conn.closed:
            try:
                if self.driver.in_transaction(conn):
                    _rollback_raw(conn)
                if autocommit is not None:
                    conn.autocommit = autocommit
            except psycopg2.Error:
                discard = True
        self._pool.putconn(conn, close=discard or bool(conn.closed))

    def getconn(self, checkout: Checkout | None = None) -> Connection:
        """psycopg2's pools never wait, so ``checkout`` has nothing to bound."""
        try:
            conn = self._borrow()
        except StoreUnavailableError as exc:
            # psycopg2's pools do not wait: an exhausted one refuses at once.
            if self.observer is not None and isinstance(exc.__cause__, psycopg2.pool.PoolError):
                self.observer.pool_timeout()
            raise
        if self.observer is not None:
            self.observer.pool_checkout()
        return conn

    def putconn(self, conn: Connection, *, discard: bool = False) -> None:
        try:
            self._give_back(conn, discard=discard)
        finally:
            if self.observer is not None:
                self.observer.pool_checkin()

    def renewal_connection(self) -> Connection:
        with self._renewal_lock:
            if self._renewal_pid != os.getpid():
                self._renewal = None  # the parent's; its pool's copy is not ours to return
                self._renewal_pid = os.getpid()
            conn = self._renewal
            if conn is not None and conn.closed:
                self._give_back(conn, discard=True)
                conn = self._renewal = None
            if conn is None:
                conn = self._renewal = self._borrow()
            return conn

    def discard_renewal_connection(self) -> None:
        with self._renewal_lock:
            conn, self._renewal = self._renewal, None
            if conn is not None and self._renewal_pid == os.getpid():
                self._give_back(conn, discard=True)

    def discard_idle(self) -> None:
        """The borrowed pool's idle connections are the application's to manage."""

    def close(self) -> None:
        """Give back the keeper's connection; the application owns the pool's lifetime."""
        with self._renewal_lock:
            conn, self._renewal = self._renewal, None
            if conn is not None and self._renewal_pid == os.getpid():
                try:
                    self._give_back(conn, discard=bool(conn.closed))
                except psycopg2.pool.PoolError:
                    _close_quietly(conn)  # the application closed its pool first


def _rollback_raw(conn: Connection) -> None:
    with conn.cursor() as cur:
        cur.execute("ROLLBACK")


def _close_quietly(conn: Connection) -> None:
    try:
        conn.close()
    except psycopg2.Error:
        pass
