"""A client-side deadline for the extension's own statements.

``statement_timeout``, ``lock_timeout``, TCP keepalives and ``tcp_user_timeout``
all need an answer from somewhere: from the server, or at least TCP ACKs that
stop coming. A PostgreSQL behind a proxy or load balancer that stops forwarding
(or a server that is frozen while its kernel still ACKs) sends neither, and
libpq then blocks in ``recv()`` for as long as the socket stays open.

One daemon thread per process looks at the statements in flight a few times a
second. When one overruns its deadline it shuts the connection's socket down
(``shutdown(SHUT_RDWR)`` on a duplicate of its descriptor): libpq's blocking
read returns, psycopg2 raises ``OperationalError``, and the caller discards the
connection and answers 503. The hot path only puts an entry in a dict and takes
it out again::

    ticket = WATCHDOG.watch(conn, seconds)
    try:
        cur.execute(...)
    finally:
        fired = WATCHDOG.unwatch(ticket)   # True: the watchdog shut it down

Exactly one of ``unwatch`` and the watchdog removes an entry (``dict.pop`` is
atomic), so the watchdog never touches a connection whose statement already
ended; and ``unwatch`` of a fired entry waits for the shutdown to finish, so
the caller never closes (and frees the descriptor of) a socket the watchdog is
still using.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("flask_idempotency.store")

#: How often the watchdog looks, seconds: the deadline's precision.
POLL_INTERVAL = 0.1


class Watchdog:
    def __init__(self) -> None:
        self._tickets = itertools.count(1)
        #: ticket -> (deadline on the monotonic clock, connection, called when it fires)
        self._watched: dict[int, tuple[float, Any, Callable[[], None] | None]] = {}
        self._kill_lock = threading.Lock()
        self._start_lock = threading.Lock()
        #: The process whose thread watches; ``None`` before it starts.
        self._pid: int | None = None

    def watch(self, conn: Any, seconds: float, on_fire: Callable[[], None] | None = None) -> int:
        """Start watching one statement on ``conn``; returns the ticket for ``unwatch``.

        ``on_fire`` is called if the deadline passes, before any socket of that
        round is shut down: the store's breaker counts every statement that ran out
        together before the first of their threads wakes and takes another request.
        """
        if self._pid != os.getpid():
            self._start()
        ticket = next(self._tickets)
        self._watched[ticket] = (time.monotonic() + seconds, conn, on_fire)
        return ticket

    def unwatch(self, ticket: int) -> bool:
        """Stop watching; True if the deadline passed and the socket was shut down
        (the connection is then unusable, whatever the statement returned)."""
        if self._watched.pop(ticket, None) is not None:
            return False
        with self._kill_lock:  # the watchdog has it: let the shutdown finish first
            return True

    def _start(self) -> None:
        if self._pid is not None and self._pid != os.getpid():
            # A forked child: the parent's thread did not survive the fork, nor do the
            # parent's statements matter here. A process-id check rather than an
            # at-fork hook: uWSGI forks without running those unless told to.
            self._watched, self._pid = {}, None
            self._kill_lock, self._start_lock = threading.Lock(), threading.Lock()
        with self._start_lock:
            if self._pid is None:
                name = "idempotency-statement-watchdog"
                threading.Thread(target=self._run, name=name, daemon=True).start()
                self._pid = os.getpid()

    def _run(self) -> None:
        while True:
            time.sleep(POLL_INTERVAL)
            if not self._watched:
                continue
            try:
                self._check(time.monotonic())
            except Exception:  # never die: the deadlines depend on this thread
                log.exception("idempotency: statement watchdog failed; still watching")

    def _check(self, now: float) -> None:
        overdue = [t for t, (deadline, _, _) in self._watched.copy().items() if deadline <= now]
        if not overdue:
            return
        with self._kill_lock:
            taken = [entry for t in overdue if (entry := self._watched.pop(t, None)) is not None]
            for _, _, on_fire in taken:
                try:
                    if on_fire is not None:
                        on_fire()
                except Exception:
                    log.exception("idempotency: watchdog callback failed")
            for _, conn, _ in taken:
                self._shut_down(conn)

    @staticmethod
    def _shut_down(conn: Any) -> None:
        try:
            dup = socket.fromfd(conn.fileno(), socket.AF_INET, socket.SOCK_STREAM)
        except Exception as exc:  # closed meanwhile, or no socket: nothing to wake
            log.debug("idempotency: watchdog found no socket to shut down: %s", exc)
            return
        with dup, contextlib.suppress(OSError):
            dup.shutdown(socket.SHUT_RDWR)
        log.warning("idempotency: PostgreSQL did not answer in time; connection shut down")


#: The process's watchdog.
WATCHDOG = Watchdog()
