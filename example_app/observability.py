"""What an on-call engineer gets from the payments API: ``GET /metrics`` and traces.

``GET /metrics`` (CONTRACT §2) answers in Prometheus' text format, without
authentication (scrapers don't carry API keys; keep the port off the internet),
with every gunicorn worker's figures added up: ``gunicorn.conf.py`` points
``PROMETHEUS_MULTIPROC_DIR`` at a directory of its own before the workers start.
The table-wide gauges (records by state, stuck leases) are on, queried at most
once per ``METRICS_TABLE_STATS_INTERVAL`` seconds (config or environment; default
15, a common scrape interval).

Traces go out over OTLP (HTTP/protobuf) when ``OTEL_EXPORTER_OTLP_ENDPOINT`` or
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is set: a server span per request
(opentelemetry-instrumentation-flask) with the extension's claim, replay and
completion spans under it. The exporter reads the other ``OTEL_*`` variables
itself (headers, timeout); ``OTEL_SERVICE_NAME`` defaults to ``payments-api``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from flask import Flask, Response
from prometheus_client import CollectorRegistry

from flask_idempotency.observability.prometheus import (
    DEFAULT_TABLE_STATS_INTERVAL,
    PrometheusMetrics,
)

#: Any of these turns OTLP export on.
OTLP_ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
DEFAULT_SERVICE_NAME = "payments-api"


def init_app(app: Flask) -> None:
    """``GET /metrics``, and OTLP traces if the environment asks for them."""
    interval = table_stats_interval(app.config, os.environ)
    # A registry of the app's own: tests build many apps in one process, and each
    # must count only its own requests (under gunicorn the files are what counts).
    metrics = PrometheusMetrics(
        app, registry=CollectorRegistry(), table_stats=True, table_stats_interval=interval
    )

    def prometheus_metrics() -> Response:
        return metrics.response()

    app.add_url_rule("/metrics", "metrics", prometheus_metrics, methods=["GET"])
    if otlp_requested(os.environ):
        init_tracing(app, os.environ)


def table_stats_interval(config: Mapping[str, Any], environ: Mapping[str, str]) -> float:
    """``METRICS_TABLE_STATS_INTERVAL`` from the app's config, else the environment."""
    raw = config.get("METRICS_TABLE_STATS_INTERVAL")
    if raw is None:
        raw = environ.get("METRICS_TABLE_STATS_INTERVAL", "").strip() or None
    if raw is None:
        return DEFAULT_TABLE_STATS_INTERVAL
    try:
        seconds = float(raw)
    except (TypeError, ValueError):
        seconds = -1.0
    if not seconds >= 0:
        raise ValueError(f"METRICS_TABLE_STATS_INTERVAL must be seconds >= 0, not {raw!r}")
    return seconds


def otlp_requested(environ: Mapping[str, str]) -> bool:
    return any(environ.get(name, "").strip() for name in OTLP_ENDPOINT_VARIABLES)


def init_tracing(app: Flask, environ: Mapping[str, str], exporter: Any = None) -> None:
    """Export spans over OTLP (or to ``exporter``, for tests): a tracer provider for
    this process (each gunicorn worker builds the app, and its own exporter thread,
    after the fork), a server span per request, and the extension's spans."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.instrumentation.flask import FlaskInstrumentor
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from flask_idempotency.observability.tracing import OpenTelemetryTracing

    service = environ.get("OTEL_SERVICE_NAME", "").strip() or DEFAULT_SERVICE_NAME
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service}))
    provider.add_span_processor(BatchSpanProcessor(exporter or OTLPSpanExporter()))
    FlaskInstrumentor().instrument_app(  # type: ignore[no-untyped-call]
        app, tracer_provider=provider
    )
    OpenTelemetryTracing(app, tracer_provider=provider)
    app.extensions["otel_tracer_provider"] = provider
