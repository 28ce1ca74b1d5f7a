"""A small blocking, fork-aware psycopg2 connection pool.

psycopg2's own pools raise at once when exhausted and know nothing of fork;
under gunicorn a connection inherited from the master must never be used by a
worker (two processes on one socket corrupt the protocol). This pool waits up
to a timeout for a free connection, notices a fork by PID and starts afresh,
and drops connections that come back broken.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg2
import psycopg2.extensions
import psycopg2.pool

from .base import StoreUnavailableError

Connection = psycopg2.extensions.connection


class _Pool:
    """What both pools share: a connection borrowed for a ``with`` block."""

    def getconn(self) -> Connection:
        raise NotImplementedError

    def putconn(self, conn: Connection, *, discard: bool = False) -> None:
        raise NotImplementedError

    @contextmanager
    def connection(self) -> Iterator[Connection]:
        conn = self.getconn()
        broken = False
        try:
            yield conn
        except psycopg2.Error:
            broken = bool(conn.closed)
            raise
        finally:
            self.putconn(conn, discard=broken)


class ConnectionPool(_Pool):
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
        self._connect_kwargs = {"connect_timeout": connect_timeout, **(connect_kwargs or {})}
        self._reset()

    def _reset(self) -> None:
        # After a fork the inherited idle connections are forgotten, not closed:
        # closing would send a Terminate message on the parent's socket.
        self._pid = os.getpid()
        self._idle: deque[Connection] = deque()
        self._slots = threading.BoundedSemaphore(self._max_size)
        self._lock = threading.Lock()

    def _check_fork(self) -> None:
        if self._pid != os.getpid():
            self._reset()

    def getconn(self) -> Connection:
        self._check_fork()
        if not self._slots.acquire(timeout=self._timeout):
            raise StoreUnavailableError("no free database connection in the pool")
        try:
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            if conn is None or conn.closed:
                conn = psycopg2.connect(self._dsn, **self._connect_kwargs)
            conn.autocommit = True
            return conn
        except psycopg2.Error as exc:
            self._slots.release()
            raise StoreUnavailableError(
                f"cannot connect to PostgreSQL: {type(exc).__name__}"
            ) from exc
        except BaseException:
            self._slots.release()
            raise

    def putconn(self, conn: Connection, *, discard: bool = False) -> None:
        if self._pid != os.getpid():
            return  # borrowed before a fork; the slot belongs to the old pool
        try:
            if not discard and not conn.closed:
                status = conn.info.transaction_status
                if status != psycopg2.extensions.TRANSACTION_STATUS_IDLE:
                    conn.rollback() if not conn.autocommit else _rollback_raw(conn)
                with self._lock:
                    self._idle.append(conn)
                return
        except psycopg2.Error:
            pass
        finally:
            self._slots.release()
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


class BorrowedPool(_Pool):
    """Adapts an application's own ``psycopg2.pool`` to the interface above."""

    def __init__(self, pool: psycopg2.pool.AbstractConnectionPool) -> None:
        self._pool = pool

    def getconn(self) -> Connection:
        try:
            conn: Connection = self._pool.getconn()
        except psycopg2.Error as exc:
            raise StoreUnavailableError(
                f"cannot connect to PostgreSQL: {type(exc).__name__}"
            ) from exc
        conn.autocommit = True
        return conn

    def putconn(self, conn: Connection, *, discard: bool = False) -> None:
        if not discard and not conn.closed:
            try:
                if conn.info.transaction_status != psycopg2.extensions.TRANSACTION_STATUS_IDLE:
                    _rollback_raw(conn)
            except psycopg2.Error:
                discard = True
        self._pool.putconn(conn, close=discard or bool(conn.closed))

    def discard_idle(self) -> None:
        """The borrowed pool's idle connections are the application's to manage."""

    def close(self) -> None:
        """The application owns the pool's lifetime."""


def _rollback_raw(conn: Connection) -> None:
    with conn.cursor() as cur:
        cur.execute("ROLLBACK")


def _close_quietly(conn: Connection) -> None:
    try:
        conn.close()
    except psycopg2.Error:
        pass
