"""Metrics, traces and logs of the extension, in one process (the core test app).

Every request to a decorated view ends in exactly one outcome, counted once in
``idempotency.metrics()`` and in Prometheus, logged once on
``flask_idempotency.requests`` and put on the request's span. The spans and log
lines carry digests, never the key, the scope or a body. Across gunicorn
workers: tests/observability/test_metrics_gunicorn.py.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg2
import pytest
from flask import Flask
from flask.testing import FlaskClient
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from prometheus_client import CollectorRegistry
from werkzeug.test import TestResponse

from flask_idempotency import Idempotency, digests
from flask_idempotency.observability import (
    Observer,
    RequestEvent,
    RequestOutcome,
    attach,
)
from flask_idempotency.observability.prometheus import PrometheusMetrics, TableStatsCollector
from flask_idempotency.observability.tracing import OpenTelemetryTracing
from flask_idempotency.observer import scope_digest
from flask_idempotency.scopes import authorization_digest
from flask_idempotency.store import StoreUnavailableError
from support.core_app import CLIENT_AUTHORIZATION
from support.dead_store import make_unreachable, store_unreachable
from support.servers import ProxyFactory
from support.waiting import wait_until

MakeApp = Callable[..., Flask]
SAME_REQUEST = {"IDEMPOTENCY_FINGERPRINT_FUNC": lambda request: b"same request"}
#: Keys no log line, span or label may contain.
SECRET = "sk-raw-key-7f3a"
REQUESTS = "flask_idempotency_requests_total"


def post(
    app: Flask,
    body: Any = None,
    key: str | None = None,
    path: str = "/charges",
    client: FlaskClient | None = None,
    **kwargs: Any,
) -> TestResponse:
    headers = {"Idempotency-Key": key} if key is not None else {}
    return (client or app.test_client()).post(path, json=body, headers=headers, **kwargs)


def requests_by_label(registry: CollectorRegistry) -> Counter[tuple[str, str, str]]:
    found: Counter[tuple[str, str, str]] = Counter()
    for metric in registry.collect():
        for sample in metric.samples:
            if sample.name == REQUESTS and sample.value:
                labels = sample.labels
                found[labels["route"], labels["outcome"], labels["source"]] += int(sample.value)
    return found


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    found = registry.get_sample_value(name, labels)
    return 0.0 if found is None else found


def start_holder(
    app: Flask, gate: str, key: str = SECRET
) -> tuple[threading.Thread, list[TestResponse]]:
    """A request whose view waits at ``gate`` until the test opens it."""
    result: list[TestResponse] = []
    thread = threading.Thread(target=lambda: result.append(post(app, {"gate": gate}, key)))
    thread.start()
    assert app.extensions["gates"].entered_event(gate).wait(10)
    return thread, result


def execute(database_url: str, query: str) -> None:
    with psycopg2.connect(database_url) as conn, conn.cursor() as cur:
        cur.execute(query)
    conn.close()


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def spans() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter
    provider.shutdown()


def test_every_outcome_is_counted_logged_and_labelled_once(
    make_app: MakeApp,
    clean_redis: str,
    registry: CollectorRegistry,
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = make_app(
        IDEMPOTENCY_REDIS_URL=clean_redis,
        IDEMPOTENCY_OVERSIZE="reject",
        IDEMPOTENCY_MAX_STORED_BODY=2000,
        MAX_CONTENT_LENGTH=1000,
    )
    idempotency: Idempotency = app.extensions["idem"]

    @app.route("/safe", methods=["GET", "POST"])
    @idempotency.required
    def safe() -> str:
        return "ok"

    metrics = PrometheusMetrics(app, registry=registry)
    # Every outcome of every decorated route is there from the start, at 0.
    labels = {"route": "/optional", "outcome": "replayed", "source": "cache"}
    assert registry.get_sample_value(REQUESTS, labels) == 0
    state = app.extensions["idempotency"]
    caplog.set_level(logging.DEBUG, logger="flask_idempotency")
    expected: Counter[tuple[str, str, str]] = Counter()

    def expect(status: int, answer: TestResponse, outcome: str, route: str = "/charges") -> None:
        assert answer.status_code == status, answer.get_data(as_text=True)
        source = ""
        if outcome.startswith("replayed/"):
            outcome, source = outcome.split("/")
        expected[route, outcome, source] += 1

    expect(201, post(app, {}, SECRET), "executed")
    expect(201, post(app, {}, SECRET), "replayed/store")  # and copied to Redis
    expect(201, post(app, {}, SECRET), "replayed/cache")
    state.cache.client.flushdb()
    expect(201, post(app, {}, SECRET), "replayed/store")
    expect(422, post(app, {"amount": 2}, SECRET), "key_reused")
    expect(500, post(app, {"status": 500}, SECRET + "-5xx"), "released")
    expect(500, post(app, {"raise": True}, SECRET + "-raise"), "released")
    expect(500, post(app, {"big": 3000}, SECRET + "-big"), "not_storable")
    holder, first = start_holder(app, "slow", SECRET + "-slow")
    expect(409, post(app, {"gate": "slow"}, SECRET + "-slow"), "in_progress")
    app.extensions["gates"].get("slow").set()
    holder.join(10)
    expect(201, first[0], "executed")
    with store_unreachable(app):
        expect(503, post(app, {}, SECRET + "-down"), "store_unavailable")
    expect(400, post(app, {}), "missing_key")
    expect(400, post(app, {}, "a b"), "invalid_key")
    expect(400, post(app, {}, SECRET, client=FlaskClient(app)), "missing_scope")
    expect(
        400,
        post(app, None, SECRET + "-cut", data=b"{}", environ_overrides={"CONTENT_LENGTH": "9"}),
        "malformed_body",
    )
    expect(413, post(app, {"pad": "x" * 2000}, SECRET + "-pad"), "body_too_large")
    expect(201, post(app, {}, path="/optional"), "keyless", "/optional")
    safe_get = app.test_client().get("/safe", headers={"Idempotency-Key": SECRET})
    expect(200, safe_get, "safe_method", "/safe")

    # Prometheus: one count per request, under its route and outcome.
    assert requests_by_label(registry) == expected
    assert sample(registry, "flask_idempotency_claims_in_flight") == 0
    assert sample(registry, "flask_idempotency_pool_connections_in_use") == 0
    assert sample(registry, "flask_idempotency_pool_connections_max") == 10
    assert sample(registry, "flask_idempotency_cache_lookups_total", result="hit") == 2
    # Claims: the first, the two store replays, the 5xx, the raise, the big one, the
    # slow one and its duplicate, the one that found PostgreSQL gone.
    assert sample(registry, "flask_idempotency_claim_duration_seconds_count") == 9
    assert sample(registry, "flask_idempotency_completion_duration_seconds_count") == 2
    text, content_type = metrics.exposition()
    assert content_type.startswith("text/plain")
    assert SECRET.encode() not in text

    # The per-process snapshot keeps its names: "executed" counts claims that ran
    # the view, "completed" those whose answer was stored (the outcome "executed").
    with app.app_context():
        snapshot = idempotency.metrics()
    assert {name: n for name, n in snapshot.items() if n} == {
        "executed": 5,
        "completed": 2,
        "released": 2,
        "not_storable": 1,
        "replayed_from_cache": 1,
        "replayed_from_store": 2,
        "key_reused": 1,
        "in_progress": 1,
        "store_unavailable": 1,
        "missing_key": 1,
        "invalid_key": 1,
        "missing_scope": 1,
        "malformed_body": 1,
        "body_too_large": 1,
        "keyless": 1,
        "safe_method": 1,
    }

    # Logs: one event per request, at its level, with its fields; never the key.
    events = [r for r in caplog.records if hasattr(r, "outcome")]
    assert {r.name for r in events} == {"flask_idempotency.requests"}
    logged = Counter((r.route, r.outcome, r.source or "") for r in events)  # type: ignore[attr-defined]
    assert logged == expected
    levels = {r.outcome: r.levelname for r in events}
    assert levels["executed"] == levels["replayed"] == levels["missing_key"] == "DEBUG"
    assert levels["in_progress"] == levels["key_reused"] == "INFO"
    assert levels["store_unavailable"] == "WARNING"
    assert levels["not_storable"] == "ERROR"
    first_event = events[0]
    assert first_event.key_digest == digests.log_key(  # type: ignore[attr-defined]
        digests.record_key(authorization_digest(CLIENT_AUTHORIZATION), SECRET)
    )
    assert first_event.scope_digest == scope_digest(  # type: ignore[attr-defined]
        authorization_digest(CLIENT_AUTHORIZATION)
    )
    assert first_event.duration_ms > 0 and first_event.claim_ms > 0  # type: ignore[attr-defined]
    assert first_event.completion_ms > 0  # type: ignore[attr-defined]
    for record in caplog.records:
        assert SECRET not in record.getMessage()
        assert all(SECRET not in str(v) for v in vars(record).values()), record
    print(f"{len(events)} requests, {len(expected)} (route, outcome, source) series")


def test_takeovers_lease_losses_and_renewals(
    make_app: MakeApp,
    database_url: str,
    registry: CollectorRegistry,
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = make_app(IDEMPOTENCY_LEASE_RENEW_INTERVAL=0, **SAME_REQUEST)
    PrometheusMetrics(app, registry=registry)
    caplog.set_level(logging.INFO, logger="flask_idempotency")
    holder, old = start_holder(app, "slow")
    execute(
        database_url,
        "UPDATE idempotency_records SET lease_expires_at = now() - interval '1 second'",
    )
    assert post(app, {}, SECRET).status_code == 201  # takes the dead-looking holder's record
    app.extensions["gates"].get("slow").set()
    holder.join(10)
    assert old[0].status_code == 409  # fenced: lease_lost

    assert sample(registry, REQUESTS, route="/charges", outcome="executed", source="") == 1
    assert sample(registry, REQUESTS, route="/charges", outcome="lease_lost", source="") == 1
    assert sample(registry, "flask_idempotency_lease_takeovers_total") == 1
    assert sample(registry, "flask_idempotency_claims_in_flight") == 0
    info = [
        (r.outcome, r.takeover)  # type: ignore[attr-defined]
        for r in caplog.records
        if hasattr(r, "outcome")
    ]
    assert sorted(info) == [("executed", True), ("lease_lost", False)]
    assert app.extensions["idempotency"].metrics.snapshot()["takeovers"] == 1

    # The keeper reports each lease it extends.
    renewing = make_app(IDEMPOTENCY_LEASE=1.0, IDEMPOTENCY_LEASE_RENEW_INTERVAL=0.05)
    renewals = CollectorRegistry()
    PrometheusMetrics(renewing, registry=renewals)
    holder, _ = start_holder(renewing, "renewed", SECRET + "-renewed")
    wait_until(
        lambda: sample(renewals, "flask_idempotency_lease_renewals_total") >= 2,
        5,
        "two renewals to be reported",
    )
    assert sample(renewals, "flask_idempotency_claims_in_flight") == 1
    renewing.extensions["gates"].get("renewed").set()
    holder.join(10)
    assert sample(renewals, "flask_idempotency_claims_in_flight") == 0


def test_spans_for_the_claim_the_replay_and_the_completion(
    make_app: MakeApp, spans: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    provider, exporter = spans
    app = make_app()
    OpenTelemetryTracing(app, tracer_provider=provider)
    tracer = provider.get_tracer("test")
    digest = digests.log_key(digests.record_key(authorization_digest(CLIENT_AUTHORIZATION), SECRET))

    with tracer.start_as_current_span("POST /charges") as server:
        assert post(app, {}, SECRET).status_code == 201
    claim, complete, request_span = exporter.get_finished_spans()
    assert (claim.name, complete.name) == ("idempotency.claim", "idempotency.complete")
    assert claim.parent is not None and claim.parent.span_id == server.get_span_context().span_id
    assert attributes(claim) == {
        "idempotency.route": "/charges",
        "idempotency.key_digest": digest,
        "idempotency.claim.result": "claimed",
        "idempotency.takeover": False,
    }
    assert attributes(complete)["idempotency.outcome"] == "executed"
    assert attributes(complete)["http.response.status_code"] == 201
    assert attributes(request_span)["idempotency.outcome"] == "executed"

    exporter.clear()
    with tracer.start_as_current_span("POST /charges"):
        assert post(app, {}, SECRET).status_code == 201
    claim, replay, request_span = exporter.get_finished_spans()
    assert attributes(claim)["idempotency.claim.result"] == "replay"
    assert replay.name == "idempotency.replay"
    assert attributes(replay)["idempotency.replay.source"] == "store"
    assert attributes(replay)["http.response.status_code"] == 201
    assert attributes(request_span)["idempotency.outcome"] == "replayed"
    assert attributes(request_span)["idempotency.replay.source"] == "store"

    # A claim PostgreSQL did not answer: the span says so, the request span too.
    exporter.clear()
    with store_unreachable(app), tracer.start_as_current_span("POST /charges"):
        assert post(app, {}, SECRET + "-down").status_code == 503
    claim, request_span = exporter.get_finished_spans()
    assert claim.status.status_code is StatusCode.ERROR
    assert claim.events[0].name == "exception"
    assert attributes(request_span)["idempotency.outcome"] == "store_unavailable"

    for span in exporter.get_finished_spans():
        assert all(SECRET not in str(v) for v in attributes(span).values())


def attributes(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def test_table_stats_query_at_most_once_per_interval(
    make_app: MakeApp, database_url: str, tmp_path: Path
) -> None:
    app = make_app()
    post(app, {}, SECRET)
    store = app.extensions["idempotency"].store
    now = [1000.0]
    collector = TableStatsCollector(store, interval=15, shared_dir="", clock=lambda: now[0])
    figures = gauges(collector)
    assert figures["flask_idempotency_records"] == {"processing": 0, "completed": 1, "expired": 0}
    assert figures["flask_idempotency_table_stats_up"] == {"": 1}
    post(app, {}, SECRET + "-2")
    now[0] += 14  # scraped again within the interval: the same figures, no query
    assert gauges(collector)["flask_idempotency_records"]["completed"] == 1
    assert collector.queries == 1
    now[0] += 1
    assert gauges(collector)["flask_idempotency_records"]["completed"] == 2
    assert collector.queries == 2

    # Workers sharing the multiprocess directory share one query per interval.
    workers = [
        TableStatsCollector(store, interval=15, shared_dir=str(tmp_path), clock=lambda: now[0])
        for _ in range(3)
    ]
    for worker in workers * 2:
        assert gauges(worker)["flask_idempotency_records"]["completed"] == 2
    assert sum(worker.queries for worker in workers) == 1

    # PostgreSQL gone: up is 0, and the failure is not retried at every scrape.
    make_unreachable(app)
    now[0] += 15
    assert gauges(collector) == {"flask_idempotency_table_stats_up": {"": 0}}
    assert gauges(collector) == {"flask_idempotency_table_stats_up": {"": 0}}
    assert collector.queries == 3


def test_table_stats_count_abandoned_and_recovered_records(
    make_app: MakeApp, database_url: str
) -> None:
    app = make_app()
    store = app.extensions["idempotency"].store
    with store.transaction() as conn, conn.cursor() as cur:
        # One record of a recover= route whose holder died 60 s ago, and the
        # completer's totals of earlier passes.
        cur.execute(
            "INSERT INTO idempotency_records (record_key, fingerprint, state, lock_token,"
            " lease_expires_at, expires_at, recovery)"
            " VALUES ('\\x01', '\\x02', 'processing', 7, now() - interval '60 s',"
            " now() + interval '1 h', '\\x03')"
        )
        cur.execute(
            "INSERT INTO idempotency_recovery_totals (outcome, total)"
            " VALUES ('recovered', 5), ('released', 2)"
        )
    figures = gauges(TableStatsCollector(store, shared_dir=""))
    assert figures["flask_idempotency_records_recoverable"] == {"": 1}
    assert 59 <= figures["flask_idempotency_oldest_abandoned_age_seconds"][""] < 120
    assert figures["flask_idempotency_recovered_records_total"] == {"": 5}
    assert figures["flask_idempotency_recovery_released_records_total"] == {"": 2}
    assert figures["flask_idempotency_records_lease_expired"] == {"": 1}
    assert figures["flask_idempotency_outbox_pending_events"] == {"": 0}
    assert figures["flask_idempotency_outbox_oldest_pending_age_seconds"] == {"": 0}


def test_table_stats_show_the_outbox_lag(make_app: MakeApp) -> None:
    app = make_app()
    store = app.extensions["idempotency"].store
    with store.transaction() as conn, conn.cursor() as cur:
        # Two events nobody published, the oldest written 90 s ago, and one published.
        cur.execute(
            "INSERT INTO idempotency_outbox (id, record_key, derived_key, event_type, payload,"
            " expires_at, created_at, published_at) VALUES"
            " ('e1', '\\x01', '\\x02', 'charge.created', '{}', now() + interval '1 d',"
            "  now() - interval '90 s', NULL),"
            " ('e2', '\\x01', '\\x03', 'charge.created', '{}', now() + interval '1 d',"
            "  now(), NULL),"
            " ('e3', '\\x01', '\\x04', 'charge.created', '{}', now() + interval '1 d',"
            "  now() - interval '1 h', now())"
        )
    figures = gauges(TableStatsCollector(store, shared_dir=""))
    assert figures["flask_idempotency_outbox_pending_events"] == {"": 2}
    assert 89 <= figures["flask_idempotency_outbox_oldest_pending_age_seconds"][""] < 150


def gauges(collector: TableStatsCollector) -> dict[str, dict[str, float]]:
    found: dict[str, dict[str, float]] = {}
    for metric in collector.collect():
        for s in metric.samples:
            found.setdefault(s.name, {})[s.labels.get("state", "")] = s.value
    return found


def test_pool_waits_and_timeouts(make_app: MakeApp, registry: CollectorRegistry) -> None:
    app = make_app(IDEMPOTENCY_DATABASE_OPTIONS={"pool_size": 1, "pool_timeout": 0.3})
    PrometheusMetrics(app, registry=registry)
    idempotency = app.extensions["idem"]
    with app.app_context(), idempotency.transaction():  # the only connection
        assert sample(registry, "flask_idempotency_pool_connections_in_use") == 1
        waiter = threading.Thread(target=lambda: post(app, {}, SECRET))
        waiter.start()
        wait_until(
            lambda: sample(registry, "flask_idempotency_pool_waiting_requests") >= 1,
            5,
            "the request to wait for the pool",
        )
        waiter.join(10)
    assert sample(registry, "flask_idempotency_pool_waiting_requests") == 0
    assert sample(registry, "flask_idempotency_pool_timeouts_total") == 1
    assert sample(registry, "flask_idempotency_pool_connections_in_use") == 0
    assert sample(registry, REQUESTS, route="/charges", outcome="store_unavailable", source="") == 1


def test_redis_down_shows_in_the_breaker_and_its_logger_is_silenced_alone(
    make_app: MakeApp, registry: CollectorRegistry, caplog: pytest.LogCaptureFixture
) -> None:
    app = make_app(
        IDEMPOTENCY_REDIS_URL="redis://127.0.0.1:9/0",
        # fill on completion, so that a first request also sends a SET
        IDEMPOTENCY_REDIS_OPTIONS={"breaker_threshold": 2, "fill": "completion"},
    )
    PrometheusMetrics(app, registry=registry)
    assert sample(registry, "flask_idempotency_redis_breaker_state", state="closed") == 1
    caplog.set_level(logging.DEBUG, logger="flask_idempotency")
    logging.getLogger("flask_idempotency.cache").setLevel(logging.CRITICAL)
    try:
        for n in range(3):
            assert post(app, {}, f"{SECRET}-{n}").status_code == 201
    finally:
        logging.getLogger("flask_idempotency.cache").setLevel(logging.NOTSET)
    assert sample(registry, "flask_idempotency_redis_breaker_state", state="open") == 1
    assert sample(registry, "flask_idempotency_redis_breaker_state", state="closed") == 0
    assert sample(registry, "flask_idempotency_redis_breaker_opened_total") == 1
    assert sample(registry, "flask_idempotency_redis_errors_total", command="GET") == 1
    assert sample(registry, "flask_idempotency_redis_errors_total", command="SET") == 1
    assert sample(registry, "flask_idempotency_redis_skipped_total", command="GET") == 2
    assert sample(registry, "flask_idempotency_cache_lookups_total", result="miss") == 3
    names = {r.name for r in caplog.records}
    assert "flask_idempotency.cache" not in names
    assert "flask_idempotency.requests" in names


def test_the_store_breaker_state_is_a_gauge_and_its_openings_a_counter(
    make_app: MakeApp, clean_db: str, tcp_proxy: ProxyFactory, registry: CollectorRegistry
) -> None:
    proxy = tcp_proxy(clean_db)
    app = make_app(
        IDEMPOTENCY_DATABASE_URL=proxy.url_for(clean_db),
        IDEMPOTENCY_DATABASE_OPTIONS={
            "statement_timeout": 0.2,
            "breaker_threshold": 1,
            "breaker_cooldown": 0.3,
        },
    )
    PrometheusMetrics(app, registry=registry)
    name = "flask_idempotency_store_breaker_state"
    assert sample(registry, name, state="closed") == 1
    assert post(app, {}, f"{SECRET}-a").status_code == 201
    proxy.stall()
    assert post(app, {}, f"{SECRET}-b").status_code == 503  # no answer by the deadline: open
    assert sample(registry, name, state="open") == 1
    assert sample(registry, name, state="closed") == 0
    assert sample(registry, "flask_idempotency_store_breaker_opened_total") == 1
    proxy.resume()
    time.sleep(0.3)
    assert post(app, {}, f"{SECRET}-c").status_code == 201  # the probe
    assert sample(registry, name, state="closed") == 1
    assert sample(registry, name, state="open") == 0


def test_a_custom_observer_and_no_observer_at_all(make_app: MakeApp) -> None:
    app = make_app()
    # Unobserved, the parts hold no observer: the hot path pays an attribute read.
    state = app.extensions["idempotency"]
    assert state.store.pool.observer is None and state.keeper.observer is None
    assert state.metrics.observers == ()

    seen: list[RequestEvent] = []

    class Recorder(Observer):
        def request_finished(self, event: RequestEvent) -> None:
            seen.append(event)

    attach(app, Recorder())
    assert post(app, {}, SECRET).status_code == 201
    assert post(app, {}, SECRET).status_code == 201
    assert [(e.outcome, e.source, e.status, e.claimed) for e in seen] == [
        (RequestOutcome.EXECUTED, None, 201, True),
        (RequestOutcome.REPLAYED, "store", 201, False),
    ]
    assert seen[0].duration is not None and seen[0].claim_duration is not None


def test_table_stats_collector_reports_an_unreachable_store() -> None:
    class Down:
        def stats(self) -> dict[str, float]:
            raise StoreUnavailableError("gone")

    collector = TableStatsCollector(Down(), shared_dir="")  # type: ignore[arg-type]
    assert gauges(collector) == {"flask_idempotency_table_stats_up": {"": 0}}
