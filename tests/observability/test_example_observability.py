"""The payments API's ``GET /metrics`` and its OTLP switch, in one process.

Through gunicorn, with every worker's figures added up: test_metrics_gunicorn.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from flask import Flask
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from example_app import create_app, observability
from example_app.processor_client import InProcessProcessorClient
from example_app.processor_core import FakeProcessor

BuildApp = Callable[..., Flask]
AUTH = {"Authorization": "Bearer sk_test_metrics"}
REQ = "flask_idempotency_requests_total"
BODY: dict[str, Any] = {"amount": 1500, "currency": "usd", "customer": "cus_1", "source": "tok"}


@pytest.fixture
def build_app(clean_db: str) -> Iterator[BuildApp]:
    apps: list[Flask] = []

    def build(**config: Any) -> Flask:
        app = create_app(
            {
                "TESTING": True,
                "DATABASE_URL": clean_db,
                "REDIS_URL": None,
                "PROCESSOR_URL": None,
                "PROCESSOR_CLIENT": InProcessProcessorClient(FakeProcessor(), 2.0),
                **config,
            }
        )
        apps.append(app)
        return app

    yield build
    for app in apps:
        provider = app.extensions.get("otel_tracer_provider")
        if provider is not None:
            provider.shutdown()
        app.extensions["idempotency"].close()


def test_metrics_are_prometheus_text_without_authentication(build_app: BuildApp) -> None:
    app = build_app(METRICS_TABLE_STATS_INTERVAL=0)
    client = app.test_client()
    for key in ("k1", "k1", None):
        headers = AUTH if key is None else {**AUTH, "Idempotency-Key": key}
        client.post("/v1/charges", json=BODY, headers=headers)

    answer = client.get("/metrics")  # no Authorization
    assert answer.status_code == 200
    assert answer.content_type.startswith("text/plain; version=")
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(answer.get_data(as_text=True))
        for s in family.samples
    }
    route = ("route", "/v1/charges")
    assert samples[REQ, (("outcome", "executed"), route, ("source", ""))] == 1
    assert samples[REQ, (("outcome", "replayed"), route, ("source", "store"))] == 1
    assert samples[REQ, (("outcome", "missing_key"), route, ("source", ""))] == 1
    assert samples["flask_idempotency_records", (("state", "completed"),)] == 1

    openmetrics = client.get("/metrics", headers={"Accept": "application/openmetrics-text"})
    assert openmetrics.content_type.startswith("application/openmetrics-text")
    assert openmetrics.get_data(as_text=True).endswith("# EOF\n")


def test_otlp_export_is_switched_on_by_the_environment(
    build_app: BuildApp, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert not observability.otlp_requested({})
    assert observability.otlp_requested({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318"})

    assert "otel_tracer_provider" not in build_app().extensions
    # Nothing listens there, and nothing is sent: the app only builds its exporter.
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "payments-test")
    provider = build_app().extensions["otel_tracer_provider"]
    assert isinstance(provider, TracerProvider)
    assert provider.resource.attributes["service.name"] == "payments-test"
    [processor] = provider._active_span_processor._span_processors
    assert isinstance(processor, BatchSpanProcessor)
    assert isinstance(processor.span_exporter, OTLPSpanExporter)


def test_traces_nest_the_claim_under_the_request_span(build_app: BuildApp) -> None:
    app = build_app()
    exporter = InMemorySpanExporter()
    observability.init_tracing(app, {}, exporter=exporter)
    response = app.test_client().post(
        "/v1/charges", json=BODY, headers={**AUTH, "Idempotency-Key": "traced"}
    )
    assert response.status_code == 201
    provider = app.extensions["otel_tracer_provider"]
    provider.force_flush()
    by_name = {span.name: span for span in exporter.get_finished_spans()}
    server = by_name["POST /v1/charges"]
    for name in ("idempotency.claim", "idempotency.complete"):
        span = by_name[name]
        assert span.parent is not None and span.parent.span_id == server.context.span_id
    assert (server.attributes or {})["idempotency.outcome"] == "executed"
    assert provider.resource.attributes["service.name"] == observability.DEFAULT_SERVICE_NAME
