"""A background worker's heartbeat: "the relay (or the completer) ran, just now".

The relay and the completer run as processes of their own; one that stopped
is noticed only when events pile up or abandoned records are never finished.
Each run reports itself in ``idempotency_heartbeats`` so ``flask idempotency
doctor`` can say when each was last seen. A report is one upsert, sent at most
once per ``interval`` by a process (the relay loops every half second), and
never allowed to stop the worker: a failed report is logged once and retried
at the next interval.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable
from typing import Any

from .base import StoreUnavailableError

log = logging.getLogger("flask_idempotency")

#: Seconds between two reports of one process: a few rows written a minute,
#: well inside the doctor's default staleness (``--stale-after``, 10 min).
HEARTBEAT_INTERVAL = 30.0


class Heartbeat:
    """Reports ``worker``'s runs through ``store.heartbeat``, at most once per interval."""

    def __init__(
        self,
        store: Any,
        worker: str,
        *,
        interval: float = HEARTBEAT_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._report: Callable[[str, str], None] = store.heartbeat
        self.worker = worker
        self.interval = interval
        self._clock = clock
        self._last: float | None = None
        self._failed = False

    def beat(self) -> None:
        """Report a run, unless this process reported less than ``interval`` ago."""
        now = self._clock()
        if self._last is not None and now - self._last < self.interval:
            return
        self._last = now
        try:
            self._report(self.worker, f"{socket.gethostname()}:{os.getpid()}")
        except StoreUnavailableError as exc:
            if not self._failed:  # once: an outage is already logged by the worker itself
                log.warning("idempotency: %s heartbeat not recorded: %s", self.worker, exc)
            self._failed = True
        else:
            self._failed = False
