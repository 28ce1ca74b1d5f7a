"""Redis commands sent on one connection per thread: the cache's hot path.

Most of the CPU ``redis.Redis.get`` spends per call is the pool checkout and
release, the retry wrapper and the observability hooks around the exchange
itself (``benchmarks/`` measures it). A replay served from Redis costs about
one such call, so for the clients the extension builds itself (from
``IDEMPOTENCY_REDIS_URL``) each thread keeps one connection of its own. It is
made by the client's pool's connection class with the pool's options: same
address, database, credentials, TLS, timeouts and handshake. The command is
packed here and read back with redis-py's parser, which still raises its own
errors.

An application's own client (``IDEMPOTENCY_REDIS``) is never used this way.
Its retries and instrumentation are the application's, so it goes through
``execute_command``.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any

import redis
import redis.exceptions


def pack(*args: bytes | str | int) -> bytes:
    """One command as a RESP array of bulk strings."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        if isinstance(arg, str):
            data = arg.encode()
        elif isinstance(arg, int):
            data = b"%d" % arg
        else:
            data = arg
        parts.append(b"$%d\r\n%b\r\n" % (len(data), data))
    return b"".join(parts)


class ThreadConnections:
    """One connection per thread, made lazily, replaced after a fork or a reset.

    Fork-safe: a forked child inherits its parent thread's connection object,
    so each connection is tagged with the PID that made it and a child makes
    its own, never touching the parent's socket.
    """

    def __init__(self, pool: redis.ConnectionPool) -> None:
        self._connection_class = pool.connection_class
        self._connection_kwargs = dict(pool.connection_kwargs)
        self._local = threading.local()
        self._lock = threading.Lock()
        self._generation = 0
        self._made: weakref.WeakSet[redis.connection.AbstractConnection] = weakref.WeakSet()

    def execute(self, *args: bytes | str | int) -> Any:
        """Send one command and return its reply. An error reply leaves the socket
        in step and in use; any other failure (a timeout mid-reply) drops it."""
        conn = self._connection()
        try:
            packed: Any = [pack(*args)]  # (types-redis says list[str]; redis-py sends bytes)
            conn.send_packed_command(packed, check_health=False)
            return conn.read_response()
        except redis.exceptions.ResponseError:
            raise
        except BaseException:
            conn.disconnect()  # a late reply must never be read as the next command's
            raise

    def reset(self) -> None:
        """Presume every thread's socket dead (Redis restarted): each reconnects on
        its next command instead of failing once more on a stale socket."""
        with self._lock:
            self._generation += 1

    def close(self) -> None:
        """Disconnect every connection made in this process (app shutdown, tests)."""
        with self._lock:
            self._generation += 1
            made, self._made = list(self._made), weakref.WeakSet()
        for conn in made:
            if getattr(conn, "pid", None) == os.getpid():
                conn.disconnect()

    def _connection(self) -> redis.connection.AbstractConnection:
        local = self._local
        conn: redis.connection.AbstractConnection | None = getattr(local, "conn", None)
        pid = os.getpid()
        if conn is not None and local.pid == pid and local.generation == self._generation:
            return conn
        if conn is not None and local.pid == pid:
            conn.disconnect()  # ours and stale; a parent's socket is left alone
        conn = self._connection_class(**self._connection_kwargs)
        with self._lock:
            local.generation = self._generation
            self._made.add(conn)
        local.conn, local.pid = conn, pid
        return conn
