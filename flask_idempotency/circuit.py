"""A circuit breaker, so that a server's outage costs nothing once it is noticed.

Each failing call to a server that does not answer costs up to its timeout.
With the breaker, only ``threshold`` consecutive calls pay it; then the server
is skipped entirely (not even a connect attempt) for ``cooldown`` seconds,
after which exactly one call is let through as a trial: its success closes the
breaker, its failure opens it for another cooldown.

Two breakers use it: the Redis cache's (``cache/redis.py``: requests skip the
cache and go to PostgreSQL) and the store's (``store/breaker.py``: requests
answer 503 at once instead of queueing behind a frozen PostgreSQL). The cache's
keyring uses one of threshold 1 to space its reads of the database's identity.

The breaker reads an injectable clock, so tests move time instead of sleeping.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half-open"


class CircuitBreaker:
    """Closed -> ``threshold`` consecutive failures -> open -> ``cooldown`` -> half-open.

    Thread-safe: one lock around a few comparisons, never held during a call. Its
    threshold and cooldown are the settings' (checked at ``init_app``).
    """

    def __init__(
        self,
        threshold: int,
        cooldown: float,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.threshold = threshold
        self.cooldown = cooldown
        self.clock = clock
        self._lock = threading.Lock()
        #: Written under the lock; read without it (one attribute, for reports).
        self.state = BreakerState.CLOSED
        #: How many times the breaker has opened: a caller that notes it before a
        #: wait knows afterwards whether the breaker opened meanwhile.
        self.openings = 0
        self._failures = 0
        #: When the breaker opened, or when its latest half-open trial began.
        self._since = 0.0

    def allow(self) -> bool:
        """Whether a call may go to the server now. Open: no, until the cooldown has
        passed; then yes for exactly one caller (the half-open trial).

        A trial whose caller never reported back (killed by a ``BaseException``)
        does not keep the breaker half-open forever: after another cooldown a
        new trial is granted.
        """
        with self._lock:
            if self.state is BreakerState.CLOSED:
                return True
            now = self.clock()
            if now - self._since < self.cooldown:
                return False  # open: cooling down; half-open: a trial is in flight
            self.state = BreakerState.HALF_OPEN
            self._since = now
            return True

    def success(self) -> bool:
        """Report a call the server answered; whether that closed the breaker."""
        with self._lock:
            closes = self.state is BreakerState.HALF_OPEN
            if closes:
                self.state = BreakerState.CLOSED
            if self.state is BreakerState.CLOSED:
                self._failures = 0
            # OPEN: a call that began before the breaker opened; it proves
            # little about now, so the cooldown runs its course.
            return closes

    def failure(self) -> bool:
        """Report a failed call; whether that opened the breaker."""
        with self._lock:
            if self.state is BreakerState.CLOSED:
                self._failures += 1
            # OPEN: a straggler from before the opening, which counts no failure
            # (none are counted while open), so the cooldown is not extended.
            opens = self.state is BreakerState.HALF_OPEN or self._failures >= self.threshold
            if opens:
                self._open()
            return opens

    def _open(self) -> None:
        self.state = BreakerState.OPEN
        self._since = self.clock()
        self._failures = 0
        self.openings += 1

    def __repr__(self) -> str:
        return f"<CircuitBreaker {self.state.value} threshold={self.threshold}>"
