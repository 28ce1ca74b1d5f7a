"""Per-process counters of what the extension decided, for dashboards and alerts.

Cheap enough for the hot path (one lock, one dict increment). Each gunicorn
worker counts its own requests; export them with your metrics library of choice
(e.g. a Prometheus collector reading ``idempotency.metrics()``), and use
``flask idempotency stats`` for the table-wide view.
"""

from __future__ import annotations

import threading
from collections import Counter

#: Every counter, so a snapshot always has the same keys.
NAMES = (
    "executed",  # the view ran under a new claim
    "completed",  # its answer was stored
    "released",  # its answer was not stored (5xx, not-acted-on 4xx, exception)
    "replayed_from_cache",
    "replayed_from_store",
    "in_progress",  # 409: a duplicate while the first was running
    "key_reused",  # 422
    "lease_lost",  # 409: our completion was fenced off after a takeover
    "store_unavailable",  # 503: PostgreSQL failed, fail closed
    "not_storable",  # 500: answer too large or a file stream
)


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def inc(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {name: self._counts[name] for name in NAMES}
