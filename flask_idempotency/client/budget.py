"""A retry budget shared by many calls: retries stay a fraction of the calls made.

Each call's own limits (attempts, deadline) bound what one call does; they do
not bound what a thousand calls do together when the server is down: every one
of them retries, and the load on a server that is struggling multiplies. A
budget shared by all the calls of a client caps the retries at a fraction of
the calls (Finagle's ``RetryBudget``, gRPC's retry throttling), with a small
reserve per second so that a quiet client can still retry at all. A call whose
retry finds the budget spent returns its last answer (or raises its last error)
at once, with ``exhausted == "budget"``; its key lets it be called again later.
"""

from __future__ import annotations

import collections
import math
import threading
import time
from collections.abc import Callable


class RetryBudget:
    """Retries allowed in any ``window`` seconds: ``ratio`` times the calls begun in
    them, plus a reserve of ``per_second`` times the window.

    Thread-safe; share one between every session or transport of a client
    (``RetryPolicy(budget=RetryBudget())``). ``409`` in-progress polls do not draw
    on it: the server paces them with ``Retry-After``.
    """

    def __init__(
        self,
        ratio: float = 0.2,
        per_second: float = 10.0,
        *,
        window: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        finite = all(0 <= value < math.inf for value in (ratio, per_second))
        if not finite or not 0 < window < math.inf:
            raise ValueError("ratio and per_second must be finite and >= 0, window > 0")
        self.ratio = ratio
        self.reserve = per_second * window
        self.window = window
        self._clock = clock
        self._lock = threading.Lock()
        #: When each call began, and each retry was made, in the last window.
        self._calls: collections.deque[float] = collections.deque()
        self._retries: collections.deque[float] = collections.deque()

    def _forget(self, now: float) -> None:
        for times in (self._calls, self._retries):
            while times and times[0] <= now - self.window:
                times.popleft()

    def deposit(self) -> None:
        """A call begins: it earns ``ratio`` of a retry for the next window."""
        with self._lock:
            now = self._clock()
            self._forget(now)
            self._calls.append(now)

    def withdraw(self) -> bool:
        """Whether one retry may be made now (and if so, it is counted)."""
        with self._lock:
            now = self._clock()
            self._forget(now)
            if len(self._retries) + 1 > self.ratio * len(self._calls) + self.reserve:
                return False
            self._retries.append(now)
            return True
