"""The table-wide figures of ``flask idempotency stats``, as Prometheus gauges.

Part of :class:`~flask_idempotency.observability.prometheus.PrometheusMetrics`
(``table_stats=True``); one query per interval however many workers answer
scrapes.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ..events import outbox
from ..store.base import StoreUnavailableError

if TYPE_CHECKING:
    from ..store.postgres import PostgresStore

log = logging.getLogger("flask_idempotency.observability")

#: Every metric's name begins with it.
PREFIX = "flask_idempotency"
#: Typical scrape interval: the table-wide collector queries at most this often.
DEFAULT_TABLE_STATS_INTERVAL = 15.0
#: The variable prometheus-client's multiprocess mode reads (flask_idempotency.gunicorn sets it).
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


#: ``store.stats()`` figures and the gauges they become (name and help).
_RECORD_STATES = ("processing", "completed", "expired")
_TABLE_GAUGES = {
    "lease_expired": (
        "records_lease_expired",
        "Processing records whose lease expired and that nobody took over (stuck)",
    ),
    "oldest_processing_seconds": (
        "oldest_processing_age_seconds",
        "Age of the oldest processing record",
    ),
    "takeovers": ("records_takeovers", "Takeovers counted on the records still in the table"),
    "recoverable": (
        "records_recoverable",
        "Abandoned records (holder dead, lease ended) of routes that declare recover=",
    ),
    "oldest_abandoned_seconds": (
        "oldest_abandoned_age_seconds",
        "How long the oldest abandoned record's lease has been over",
    ),
    "pending": (
        "outbox_pending_events",
        "Events written by committed attempts and not yet published by the relay",
    ),
    "oldest_pending_seconds": (
        "outbox_oldest_pending_age_seconds",
        "Age of the oldest event the relay has not published (the outbox's lag)",
    ),
}
#: ``flask idempotency recover``'s totals (kept in PostgreSQL, so one figure for every
#: process and host): counters, since they only grow.
_TABLE_COUNTERS = {
    "recovered": (
        "recovered_records",
        "Abandoned records flask idempotency recover finished with their recovered answer",
    ),
    "recovery_released": (
        "recovery_released_records",
        "Abandoned records flask idempotency recover released (nothing had happened)",
    ),
}


class TableStatsCollector:
    """The table-wide figures of ``flask idempotency stats`` as gauges.

    A scrape that comes less than ``interval`` seconds after the last query gets
    that query's figures. In multiprocess mode the figures are shared through a
    file in ``PROMETHEUS_MULTIPROC_DIR`` under an exclusive lock, so however many
    workers answer scrapes, PostgreSQL is asked at most once per interval. If it
    does not answer, ``flask_idempotency_table_stats_up`` is 0 (and the failure is
    remembered for the interval too: an outage is not hammered by scrapes).
    """

    def __init__(
        self,
        store: PostgresStore,
        *,
        interval: float = DEFAULT_TABLE_STATS_INTERVAL,
        shared_dir: str | None = None,
        clock: Any = time.time,
    ) -> None:
        self.store = store
        self.interval = interval
        self.clock = clock
        directory = shared_dir if shared_dir is not None else os.environ.get(MULTIPROC_ENV)
        self._shared = Path(directory) / "flask_idempotency_table_stats.json" if directory else None
        self._lock = threading.Lock()
        self._cached: tuple[float, dict[str, float] | None] | None = None
        #: Queries run by this collector (for tests and the curious).
        self.queries = 0

    def describe(self) -> list[Metric]:
        """The families, without querying (a registry asks when it registers us)."""
        return list(self._families(None))

    def collect(self) -> Iterator[Metric]:
        return self._families(self.figures())

    def _families(self, figures: dict[str, float] | None) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            f"{PREFIX}_table_stats_up",
            "1 if the last query of the table-wide figures succeeded",
            value=1 if figures is not None else 0,
        )
        records = GaugeMetricFamily(
            f"{PREFIX}_records",
            "Idempotency records by state (expired: past their TTL, awaiting purge)",
            labels=["state"],
        )
        if figures is not None:
            for state in _RECORD_STATES:
                records.add_metric([state], figures.get(state, 0.0))
        yield records
        kinds = ((GaugeMetricFamily, _TABLE_GAUGES), (CounterMetricFamily, _TABLE_COUNTERS))
        for kind, rows in kinds:
            for figure, (name, doc) in rows.items():
                family = kind(f"{PREFIX}_{name}", doc)
                if figures is not None:
                    family.add_metric([], figures.get(figure, 0.0))
                yield family

    def figures(self) -> dict[str, float] | None:
        """The latest figures (``None``: PostgreSQL did not answer), queried only if
        the cached ones are older than ``interval``."""
        with self._lock:
            now = self.clock()
            if self._cached is not None and now - self._cached[0] < self.interval:
                return self._cached[1]
            self._cached = self._shared_figures(now) if self._shared else (now, self._query())
            return self._cached[1]

    def _query(self) -> dict[str, float] | None:
        self.queries += 1
        try:
            figures = self.store.stats()
            figures.update(self.store.recovery_stats())
            pending = outbox.counts(self.store)
            figures.update((k, pending[k]) for k in ("pending", "oldest_pending_seconds"))
            return figures
        except StoreUnavailableError as exc:
            log.warning("idempotency: table stats unavailable: %s", exc)
            return None

    def _shared_figures(self, now: float) -> tuple[float, dict[str, float] | None]:
        assert self._shared is not None
        with open(self._shared.with_suffix(".lock"), "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one worker queries, the others wait and read
            try:
                cached = json.loads(self._shared.read_text())
                at, figures = float(cached["at"]), cached["figures"]
                if now - at < self.interval:
                    return at, figures
            except (OSError, ValueError, KeyError, TypeError):
                pass
            figures = self._query()
            tmp = self._shared.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"at": now, "figures": figures}))
            tmp.replace(self._shared)
            return now, figures
