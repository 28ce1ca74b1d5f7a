"""The store's circuit breaker: a PostgreSQL that stopped answering costs one deadline.

A frozen server (stopped processes, a proxy that stopped forwarding) answers
nothing, so each statement on it waits out the client-side deadline
(``watchdog.py``). Without a breaker the requests behind the first ones queue:
for a pool connection held by a stuck request, then for a connect, then for
their own statement, and answer after a multiple of the deadline while every
worker thread is held. The breaker counts the failures that mean "the server
is not answering" (a statement cut at its deadline, a lost connection, a
connect that failed); after ``threshold`` in a row it opens, and requests
answer ``503 store_unavailable`` at once, including those already waiting for
a pool connection (they noted ``openings`` when admitted). After ``cooldown``
exactly one request goes through as a probe; its answer closes the breaker.

Any answer from the server counts as a success: a unique violation, a lock
timeout or a 409 are a live server's. Each statement's ending is counted where
every statement runs, ``runner.watched``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ..circuit import BreakerState, CircuitBreaker
from ..observer import Observer
from .base import BreakerOpenError

log = logging.getLogger("flask_idempotency.store")


class StoreBreaker(CircuitBreaker):
    """The store's :class:`~flask_idempotency.circuit.CircuitBreaker`, with the
    store's log lines and metrics on each transition."""

    def __init__(
        self,
        threshold: int,
        cooldown: float,
        *,
        observer: Callable[[], Observer | None] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(threshold, cooldown, clock=clock)
        #: The observer to tell (the pool's, set by ``observability.attach``).
        self._observer = observer

    def admit(self) -> int:
        """Let a request go to PostgreSQL, or raise ``StoreUnavailableError`` at once
        while the breaker is open. Returns the number of openings so far, for
        :meth:`opened_since`."""
        openings = self.openings
        if not self.allow():
            raise BreakerOpenError("PostgreSQL is not answering (store circuit breaker open)")
        return openings

    def opened_since(self, openings: int) -> bool:
        """Whether the breaker opened after a request was admitted: a request still
        waiting for a connection then gives up."""
        return self.openings != openings

    def answered(self) -> None:
        """PostgreSQL answered a statement (whatever the answer)."""
        if self.success():  # it closed the breaker
            log.info("idempotency: PostgreSQL answers again; store circuit breaker closed")
            self._report(BreakerState.CLOSED)

    def failed(self, reason: str = "no answer before the deadline") -> None:
        """PostgreSQL did not answer: ``reason`` names how (an exception's class, never
        a key or a statement's parameters)."""
        if self.failure():  # it opened the breaker
            log.warning(
                "idempotency: PostgreSQL is not answering (%s); store circuit breaker open, "
                "requests answer 503 at once for %.1f s, then one probes",
                reason,
                self.cooldown,
            )
            self._report(BreakerState.OPEN)

    #: A statement ran out of its deadline: called by the watchdog as it cuts it
    #: (``WATCHDOG.watch(conn, seconds, breaker.no_answer)``), so statements that ran
    #: out together are counted before any of their threads takes a new request.
    no_answer = failed

    def _report(self, state: BreakerState) -> None:
        observer = self._observer()
        if observer is not None:
            observer.store_breaker_changed(state.value)
