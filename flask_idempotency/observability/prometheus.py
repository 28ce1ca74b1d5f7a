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
from collections.abc import Iterable

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


#: Reads of the multiprocess directory before a scrape gives up (see ``exposition``).
_SCRAPE_TRIES = 5


def multiprocess_mode() -> bool:
    """Whether prometheus-client writes its values to the multiprocess directory.

    It decides when it is first imported, from ``PROMETHEUS_MULTIPROC_DIR``: its
    value class is then a memory-mapped one instead of the plain ``MutexValue``."""
    return values.ValueClass is not values.MutexValue


class _Instruments:
    """The metric objects. One set per registry, and one per process in
    multiprocess mode (two objects of one name would overwrite each other's file
    entries)."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        def counter(name: str, doc: str, labels: Iterable[str] = ()) -> Counter:
            return Counter(f"{PREFIX}_{name}", doc, list(labels), registry=registry)

        def gauge(name: str, doc: str, labels: Iterable[str] = ()) -> Gauge:
            # livesum: summed over live workers; a dead worker's file is removed by
            # mark_process_dead() in gunicorn's child_exit.
            return Gauge(
                f"{PREFIX}_{name}", doc, list(labels), registry=registry,
                multiprocess_mode="livesum",
            )  # fmt: skip

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(f"{PREFIX}_{name}", doc, registry=registry, buckets=LATENCY_BUCKETS)

        self.requests = counter(
            "requests",
            "Requests to idempotent routes by route and outcome (source: cache or store for "
            "replays, else empty)",
            ("route", "outcome", "source"),
        )
        self.claim_seconds = histogram(
            "claim_duration_seconds", "Time of the claim statement (every try of a waiting one)"
        )
        self.completion_seconds = histogram(
            "completion_duration_seconds",
            "Time to store an answer: the completion statement and the view's commit",
        )
        self.in_flight = gauge("claims_in_flight", "Claims held by running views")
        self.takeovers = counter(
            "lease_takeovers", "Claims that took over a record whose holder's lease had expired"
        )
        self.lease_renewals = counter(
            "lease_renewals", "Leases of running views extended by the lease keeper"
        )
        self.lease_renewal_failures = counter(
            "lease_renewal_failures", "Lease renewal rounds that failed (PostgreSQL unreachable)"
        )
        self.cache_lookups = counter(
            "cache_lookups",
            "Response cache lookups (a failed or skipped Redis call is a miss)",
            ("result",),
        )
        self.cache_hits = self.cache_lookups.labels("hit")
        self.cache_misses = self.cache_lookups.labels("miss")
        self.cache_rejected = counter(
            "cache_rejected",
            "Cached entries not replayed (failed verification, another version, expired)",
            ("reason",),
        )
        self.dead_lettered = counter(
            "events_dead_lettered",
            "Messages a consumer gave up on (dead-lettered), by consumer and reason",
            ("consumer", "reason"),
        )
        self.redis_errors = counter(
            "redis_errors", "Redis commands that failed (treated as misses)", ("command",)
        )
        self.redis_skipped = counter(
            "redis_skipped",
            "Redis commands skipped while the circuit breaker was open",
            ("command",),
        )
        self.breaker_state = gauge(
            "redis_breaker_state",
            "Processes whose Redis circuit breaker is in each state",
            ("state",),
        )
        self.breaker_opened = counter(
            "redis_breaker_opened", "Times the Redis circuit breaker opened"
        )
        self.store_breaker_state = gauge(
            "store_breaker_state",
            "Processes whose PostgreSQL circuit breaker is in each state",
            ("state",),
        )
        self.store_breaker_opened = counter(
            "store_breaker_opened",
            "Times the PostgreSQL circuit breaker opened (requests answered 503 at once)",
        )
        self.pool_max = gauge(
            "pool_connections_max", "Database connections the pools may lend to requests"
        )
        self.pool_in_use = gauge(
            "pool_connections_in_use", "Database connections lent to requests right now"
        )
        self.pool_waiting = gauge(
            "pool_waiting_requests", "Requests waiting for a free database connection"
        )
        self.pool_timeouts = counter(
            "pool_timeouts", "Requests that found no free database connection in time (503)"
        )
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
            self._m.pool_max.inc(capacity[0])
        attach(app, self)
        self._apps.append(app)
        self._show_routes()
        if self.table_stats:
            state = app_state(app)
            store = state.postgres_store("IDEMPOTENCY table statistics (table_stats=True)")
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
        for attempt in range(1, _SCRAPE_TRIES):
            try:
                return encoder(self._registry_to_scrape()), content_type
            except struct.error:
                # A worker starting now has created its file but not yet sized it
                # (prometheus-client opens, then truncates): read again shortly.
                time.sleep(0.01 * attempt)
        return encoder(self._registry_to_scrape()), content_type

    def _check_workers(self) -> None:
        """The misconfiguration gauge (and ERROR) of a worker that exports its figures
        alone; at start-up, and on scrapes for a worker forked after ``init_app``
        (``preload_app``)."""
        if _misconfigured():
            self._m.multiprocess_misconfigured.set(1)

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
                        self._m.requests.labels(rule.rule, outcome.value, source)

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
        self._m.requests.labels(event.route, event.outcome.value, event.source or "").inc()
        if event.claimed:
            self._m.in_flight.dec()

    def claimed(self, takeover: bool) -> None:
        self._m.in_flight.inc()
        if takeover:
            self._m.takeovers.inc()

    def stage_ended(
        self,
        stage: Stage,
        started: object,
        seconds: float,
        attributes: Attributes,
        error: BaseException | None,
    ) -> None:
        if stage is Stage.CLAIM:
            self._m.claim_seconds.observe(seconds)
        elif stage is Stage.COMPLETE:
            self._m.completion_seconds.observe(seconds)

    def leases_renewed(self, renewed: int) -> None:
        if renewed:
            self._m.lease_renewals.inc(renewed)

    def lease_renewal_failed(self) -> None:
        self._m.lease_renewal_failures.inc()

    def cache_lookup(self, hit: bool) -> None:
        (self._m.cache_hits if hit else self._m.cache_misses).inc()

    def cache_rejected(self, reason: str) -> None:
        self._m.cache_rejected.labels(reason).inc()

    def dead_lettered(self, consumer: str, reason: str) -> None:
        self._m.dead_lettered.labels(consumer, reason).inc()

    def redis_failed(self, command: str) -> None:
        self._m.redis_errors.labels(command).inc()

    def redis_skipped(self, command: str) -> None:
        self._m.redis_skipped.labels(command).inc()

    def breaker_changed(self, state: str) -> None:
        _breaker_changed(self._m.breaker_state, self._m.breaker_opened, state)

    def store_breaker_changed(self, state: str) -> None:
        _breaker_changed(self._m.store_breaker_state, self._m.store_breaker_opened, state)

    def pool_checkout(self) -> None:
        self._m.pool_in_use.inc()

    def pool_checkin(self) -> None:
        self._m.pool_in_use.dec()

    def pool_waiting(self, delta: int) -> None:
        self._m.pool_waiting.inc(delta)

    def pool_timeout(self) -> None:
        self._m.pool_timeouts.inc()


def _breaker_changed(state_gauge: Gauge, opened: Counter, state: str) -> None:
    for name in ("closed", "open", "half-open"):
        state_gauge.labels(name).set(1 if name == state else 0)
    if state == "open":
        opened.inc()


#: The process that last logged the misconfiguration (a forked worker logs again:
#: its parent's log is not its own).
_misconfiguration_logged_in: int | None = None


def _misconfigured() -> bool:
    """Whether this process is one of several gunicorn workers exporting only its own
    figures (not in prometheus-client's multiprocess mode); logs an ERROR once per process.

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
        return False
    with _instruments_lock:
        if _misconfiguration_logged_in == os.getpid():
            return True
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
    return True
