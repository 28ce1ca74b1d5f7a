"""Prometheus metrics, correct across gunicorn workers (the ``prometheus`` extra).

::

    from flask_idempotency.observability.prometheus import PrometheusMetrics

    metrics = PrometheusMetrics(app, table_stats=True)   # after Idempotency(app)

    @app.get("/metrics")
    def prometheus_metrics():
        return metrics.response()

Under gunicorn every worker counts its own requests. prometheus-client's
multiprocess mode adds them up: each worker writes its values to memory-mapped
files in ``PROMETHEUS_MULTIPROC_DIR`` and whichever worker answers the scrape
reads them all. That variable must be set (to an empty directory) in gunicorn's
master before it forks, and each dead worker's live gauges removed in
``child_exit``: the hooks of :mod:`flask_idempotency.gunicorn` do both, imported
in one line of ``gunicorn.conf.py``. Without it (one process, ``flask run``,
tests) the metrics live in a registry as usual; under several gunicorn workers
without it, each worker logs an ERROR and the scrape exports
``flask_idempotency_metrics_multiprocess_misconfigured 1``.

Metric names (all under ``flask_idempotency_``) and their labels are listed in
the README's "Observability" section. Counters count from the process start
(rates are what dashboards use); gauges of gunicorn's workers are summed over
the live ones. The table-wide figures of ``flask idempotency stats`` are an
opt-in collector (``table_stats=True``) that queries PostgreSQL at most once
per ``table_stats_interval`` however often it is scraped.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
import weakref

from flask import Flask, Response, request
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, values
from prometheus_client.exposition import choose_encoder
from prometheus_client.multiprocess import MultiProcessCollector

from ..observer import (
    Attributes,
    Observer,
    RequestEvent,
    RequestOutcome,
    Stage,
)
from ..recovery import route_options_of
from ..state import app_state
from ..workers import gunicorn_workers, pool_capacity
from . import attach
from .table_stats import DEFAULT_TABLE_STATS_INTERVAL as DEFAULT_TABLE_STATS_INTERVAL
from .table_stats import MULTIPROC_ENV, PREFIX
from .table_stats import TableStatsCollector as TableStatsCollector

log = logging.getLogger("flask_idempotency.observability")

#: From a prepared claim on a local server (a few hundred microseconds) to the
#: statement timeout (5 s by default) and beyond.
LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip


#: How long a scrape waits for a starting worker to size its file (see
#: ``exposition``): a few milliseconds on an idle host, far more on a loaded one.
_SCRAPE_PATIENCE_SECONDS = 2.0


def multiprocess_mode() -> bool:
    """Whether prometheus-client writes its values to the multiprocess directory.

    It decides when it is first imported, from ``PROMETHEUS_MULTIPROC_DIR``: its
    value class is then a memory-mapped one instead of the plain ``MutexValue``."""
    return values.ValueClass is not values.MutexValue


#: The counters (``_total`` added to their names): name, help, then labels.
_COUNTERS: tuple[tuple[str, ...], ...] = (
    (
        "requests",
        "Requests to idempotent routes by route and outcome (source: cache or store for "
        "replays, else empty)",
        "route",
        "outcome",
        "source",
    ),
    ("lease_takeovers", "Claims that took over a record whose holder's lease had expired"),
    ("lease_renewals", "Leases of running views extended by the lease keeper"),
    ("lease_renewal_failures", "Lease renewal rounds that failed (PostgreSQL unreachable)"),
    (
        "cache_lookups",
        "Response cache lookups (a failed or skipped Redis call is a miss)",
        "result",
    ),
    (
        "cache_rejected",
        "Cached entries not replayed (failed verification, another version, expired)",
        "reason",
    ),
    (
        "events_dead_lettered",
        "Messages a consumer gave up on (dead-lettered), by consumer and reason",
        "consumer",
        "reason",
    ),
    ("redis_errors", "Redis commands that failed (treated as misses)", "command"),
    ("redis_skipped", "Redis commands skipped while the circuit breaker was open", "command"),
    ("redis_breaker_opened", "Times the Redis circuit breaker opened"),
    (
        "store_breaker_opened",
        "Times the PostgreSQL circuit breaker opened (requests answered 503 at once)",
    ),
    ("pool_timeouts", "Requests that found no free database connection in time (503)"),
)
#: The gauges, as the counters. Summed over live workers (``livesum``): a dead
#: worker's file is removed by mark_process_dead() in gunicorn's child_exit.
_GAUGES: tuple[tuple[str, ...], ...] = (
    ("claims_in_flight", "Claims held by running views"),
    ("redis_breaker_state", "Processes whose Redis circuit breaker is in each state", "state"),
    ("store_breaker_state", "Processes whose PostgreSQL circuit breaker is in each state", "state"),
    ("pool_connections_max", "Database connections the pools may lend to requests"),
    ("pool_connections_in_use", "Database connections lent to requests right now"),
    ("pool_waiting_requests", "Requests waiting for a free database connection"),
)
#: The histograms of the stages timed: name and help.
_HISTOGRAMS = {
    Stage.CLAIM: (
        "claim_duration_seconds",
        "Time of the claim statement (every try of a waiting one)",
    ),
    Stage.COMPLETE: (
        "completion_duration_seconds",
        "Time to store an answer: the completion statement and the view's commit",
    ),
}


class _Instruments:
    """The metric objects, by name (without the ``flask_idempotency_`` prefix). One
    set per registry, and one per process in multiprocess mode (two objects of one
    name would overwrite each other's file entries)."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.counter = {
            name: Counter(f"{PREFIX}_{name}", doc, labels, registry=registry)
            for name, doc, *labels in _COUNTERS
        }
        self.gauge = {
            name: Gauge(
                f"{PREFIX}_{name}", doc, labels, registry=registry, multiprocess_mode="livesum"
            )
            for name, doc, *labels in _GAUGES
        }
        self.stage_seconds = {
            stage: Histogram(f"{PREFIX}_{name}", doc, registry=registry, buckets=LATENCY_BUCKETS)
            for stage, (name, doc) in _HISTOGRAMS.items()
        }
        self.cache_hits = self.counter["cache_lookups"].labels("hit")
        self.cache_misses = self.counter["cache_lookups"].labels("miss")
        # Only ever 1 outside multiprocess mode, where it is a plain per-process gauge.
        self.multiprocess_misconfigured = Gauge(
            f"{PREFIX}_metrics_multiprocess_misconfigured",
            "1 when this scrape shows one of several gunicorn workers' figures alone "
            "(prometheus-client's multiprocess mode is not set up)",
            registry=registry,
            multiprocess_mode="livemax",
        )


_instruments: weakref.WeakKeyDictionary[CollectorRegistry, _Instruments] = (
    weakref.WeakKeyDictionary()
)
_instruments_lock = threading.Lock()
#: The process that last logged the misconfiguration (a forked worker logs again:
#: its parent's log is not its own).
_misconfiguration_logged_in: int | None = None


def _instruments_for(registry: CollectorRegistry) -> _Instruments:
    # In multiprocess mode the instruments are registered nowhere (the scrape reads
    # the files), so the process has one set, kept under the default registry.
    multiprocess = multiprocess_mode()
    key = REGISTRY if multiprocess else registry
    with _instruments_lock:
        found = _instruments.get(key)
        if found is None:
            found = _instruments[key] = _Instruments(None if multiprocess else registry)
        return found


class PrometheusMetrics(Observer):
    """Reports one or more apps' idempotency work as Prometheus metrics.

    ``registry`` is where the metrics are registered outside multiprocess mode
    (the default registry unless given). ``table_stats=True`` adds the table-wide
    gauges of ``flask idempotency stats``, queried at most once per
    ``table_stats_interval`` seconds, across workers too when they share
    ``PROMETHEUS_MULTIPROC_DIR``.
    """

    def __init__(
        self,
        app: Flask | None = None,
        *,
        registry: CollectorRegistry = REGISTRY,
        table_stats: bool = False,
        table_stats_interval: float = DEFAULT_TABLE_STATS_INTERVAL,
    ) -> None:
        self.registry = registry
        self.table_stats = table_stats
        self.table_stats_interval = table_stats_interval
        self._m = _instruments_for(registry)
        self._collectors: list[TableStatsCollector] = []
        self._scrape_registry: CollectorRegistry | None = None
        self._apps: list[Flask] = []
        self._routes_shown: set[str] = set()
        if app is not None:
            self.init_app(app)

    def init_app(self, app: Flask) -> None:
        """Observe ``app`` (its ``Idempotency`` must be initialised already)."""
        if os.environ.get(MULTIPROC_ENV) and not multiprocess_mode():
            log.warning(
                "%s is set but prometheus_client was imported before it was: each "
                "process exports only its own figures. Set it before the import "
                "(in gunicorn.conf.py, in the master).",
                MULTIPROC_ENV,
            )
        self._check_workers()
        capacity = pool_capacity(app)
        if capacity is not None:
            self._m.gauge["pool_connections_max"].inc(capacity[0])
        attach(app, self)
        self._apps.append(app)
        self._show_routes()
        if self.table_stats:
            store = app_state(app).postgres_store("IDEMPOTENCY table statistics (table_stats=True)")
            collector = TableStatsCollector(store, interval=self.table_stats_interval)
            self._collectors.append(collector)
            if not multiprocess_mode():
                self.registry.register(collector)
        app.extensions["idempotency_prometheus"] = self

    # -- exposition --------------------------------------------------------------

    def exposition(self, accept: str | None = None) -> tuple[bytes, str]:
        """The metrics in the format ``accept`` asks for (Prometheus text by
        default, OpenMetrics on request), and its content type. In multiprocess
        mode, every worker's figures added up."""
        self._show_routes()
        self._check_workers()
        encoder, content_type = choose_encoder(accept or "")
        give_up_at = time.monotonic() + _SCRAPE_PATIENCE_SECONDS
        pause = 0.005
        while True:
            try:
                return encoder(self._registry_to_scrape()), content_type
            except struct.error:
                # A worker starting now has created its file but not yet sized it
                # (prometheus-client opens, then truncates): read again shortly.
                if time.monotonic() + pause > give_up_at:
                    raise
                time.sleep(pause)
                pause = min(pause * 2, 0.1)

    def _check_workers(self) -> None:
        """The misconfiguration gauge (and ERROR, once per process) of a worker that
        is one of several gunicorn workers exporting only its own figures (not in
        prometheus-client's multiprocess mode); at start-up, and on scrapes for a
        worker forked after ``init_app`` (``preload_app``).

        Without prometheus-client's multiprocess mode every worker of a multi-process
        server keeps its own figures, and a scrape shows whichever worker answered it:
        the counters jump back and forth and nothing looks wrong. So this is said once
        in each such process, and the ``metrics_multiprocess_misconfigured`` gauge set
        to 1 for an alert. It knows gunicorn only
        (:func:`~flask_idempotency.workers.gunicorn_workers`); under another
        multi-process server (uWSGI, mod_wsgi) it stays silent.
        """
        global _misconfiguration_logged_in
        workers = None if multiprocess_mode() else gunicorn_workers()  # walks the stacks
        if workers is None or workers < 2:
            return
        self._m.multiprocess_misconfigured.set(1)
        with _instruments_lock:
            if _misconfiguration_logged_in == os.getpid():
                return
            _misconfiguration_logged_in = os.getpid()
        reason = (
            f"{MULTIPROC_ENV} is set but prometheus_client was imported before it was"
            if os.environ.get(MULTIPROC_ENV)
            else f"{MULTIPROC_ENV} is not set"
        )
        log.error(
            "Prometheus metrics are served by one of gunicorn's %d workers without "
            "prometheus-client's multiprocess mode (%s): each scrape shows only the figures "
            "of the worker that answers it. Add to gunicorn.conf.py: from "
            "flask_idempotency.gunicorn import child_exit, on_exit, on_starting, "
            "post_worker_init (docs: observability).",
            workers,
            reason,
        )

    def _show_routes(self) -> None:
        """Every outcome of every decorated route at 0 until it happens: rates and
        alerts need the series to exist, and in multiprocess mode a metric without
        a sample is not exported at all (not even its ``# TYPE`` line)."""
        for app in self._apps:
            for rule in app.url_map.iter_rules():
                view = app.view_functions.get(rule.endpoint)
                if rule.rule in self._routes_shown or route_options_of(view) is None:
                    continue
                self._routes_shown.add(rule.rule)
                for outcome in RequestOutcome:
                    sources = ("cache", "store") if outcome is RequestOutcome.REPLAYED else ("",)
                    for source in sources:
                        self._m.counter["requests"].labels(rule.rule, outcome.value, source)

    def response(self) -> Response:
        """``exposition()`` as the answer of a Flask view (``GET /metrics``)."""
        body, content_type = self.exposition(request.headers.get("Accept"))
        return Response(body, content_type=content_type)

    def _registry_to_scrape(self) -> CollectorRegistry:
        if not multiprocess_mode():
            return self.registry
        if self._scrape_registry is None:
            registry = CollectorRegistry(auto_describe=True)
            MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
            for collector in self._collectors:
                registry.register(collector)
            self._scrape_registry = registry
        return self._scrape_registry

    # -- the observer hooks ------------------------------------------------------

    def request_finished(self, event: RequestEvent) -> None:
        requests = self._m.counter["requests"]
        requests.labels(event.route, event.outcome.value, event.source or "").inc()
        if event.claimed:
            self._m.gauge["claims_in_flight"].dec()

    def claimed(self, takeover: bool) -> None:
        self._m.gauge["claims_in_flight"].inc()
        if takeover:
            self._m.counter["lease_takeovers"].inc()

    def stage_ended(
        self,
        stage: Stage,
        started: object,
        seconds: float,
        attributes: Attributes,
        error: BaseException | None,
    ) -> None:
        if stage in self._m.stage_seconds:
            self._m.stage_seconds[stage].observe(seconds)

    def leases_renewed(self, renewed: int) -> None:
        if renewed:
            self._m.counter["lease_renewals"].inc(renewed)

    def lease_renewal_failed(self) -> None:
        self._m.counter["lease_renewal_failures"].inc()

    def cache_lookup(self, hit: bool) -> None:
        (self._m.cache_hits if hit else self._m.cache_misses).inc()

    def cache_rejected(self, reason: str) -> None:
        self._m.counter["cache_rejected"].labels(reason).inc()

    def dead_lettered(self, consumer: str, reason: str) -> None:
        self._m.counter["events_dead_lettered"].labels(consumer, reason).inc()

    def redis_failed(self, command: str) -> None:
        self._m.counter["redis_errors"].labels(command).inc()

    def redis_skipped(self, command: str) -> None:
        self._m.counter["redis_skipped"].labels(command).inc()

    def breaker_changed(self, state: str) -> None:
        self._breaker_changed("redis_breaker", state)

    def store_breaker_changed(self, state: str) -> None:
        self._breaker_changed("store_breaker", state)

    def _breaker_changed(self, breaker: str, state: str) -> None:
        for name in ("closed", "open", "half-open"):
            self._m.gauge[f"{breaker}_state"].labels(name).set(1 if name == state else 0)
        if state == "open":
            self._m.counter[f"{breaker}_opened"].inc()

    def pool_checkout(self) -> None:
        self._m.gauge["pool_connections_in_use"].inc()

    def pool_checkin(self) -> None:
        self._m.gauge["pool_connections_in_use"].dec()

    def pool_waiting(self, delta: int) -> None:
        self._m.gauge["pool_waiting_requests"].inc(delta)

    def pool_timeout(self) -> None:
        self._m.counter["pool_timeouts"].inc()
