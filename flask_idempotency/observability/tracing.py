"""OpenTelemetry spans for the claim, a replay and the completion (the ``opentelemetry`` extra).

::

    from flask_idempotency.observability.tracing import OpenTelemetryTracing

    OpenTelemetryTracing(app)   # after Idempotency(app)

Only ``opentelemetry-api`` is imported: the application configures the SDK,
its exporter and, usually, a server span per request (e.g.
``opentelemetry-instrumentation-flask``); without an SDK every span is a no-op.
The spans are children of whatever span is current, and are current while they
run, so an instrumented database driver's spans nest under the claim:

- ``idempotency.claim``: the claim statement. ``idempotency.claim.result``
  (``claimed``, ``replay``, ``in_progress``, ``key_reused``), ``idempotency.takeover``;
- ``idempotency.replay``: answering with a stored response.
  ``idempotency.replay.source`` (``cache`` or ``store``), ``http.response.status_code``
  (the stored one);
- ``idempotency.complete``: storing the answer with the view's commit.
  ``idempotency.outcome`` (``executed``, ``lease_lost``, ``store_unavailable``),
  ``http.response.status_code``.

Each carries ``idempotency.route`` and ``idempotency.key_digest`` (12 hex digits
of the record's SHA-256 digest, as in the logs); never the raw key, the scope or
a body. A failed stage has an error status and the exception recorded. The
request's span (the one current around the view) gets ``idempotency.outcome``
and, for replays, ``idempotency.replay.source``.
"""

from __future__ import annotations

import dataclasses
from contextvars import ContextVar, Token

from flask import Flask
from opentelemetry import context, trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, TracerProvider

from .. import __version__
from ..observer import Attributes, Observer, RequestEvent, Stage
from . import attach

SPAN_NAMES = {stage: f"idempotency.{stage.value}" for stage in Stage}

#: The span that was current when our outermost stage began: the request's, which
#: gets the outcome even when the outcome is decided inside a stage.
_request_span: ContextVar[Span | None] = ContextVar("flask_idempotency_request_span", default=None)


@dataclasses.dataclass(frozen=True)
class _Started:
    span: Span
    token: Token[Context]
    outer_token: Token[Span | None]


class OpenTelemetryTracing(Observer):
    """Spans for an app's idempotency stages; ``tracer_provider`` defaults to the global one."""

    stage_attributes = True

    def __init__(
        self, app: Flask | None = None, *, tracer_provider: TracerProvider | None = None
    ) -> None:
        # The release as the instrumentation scope's version.
        self._tracer = trace.get_tracer(
            "flask_idempotency", __version__, tracer_provider=tracer_provider
        )
        if app is not None:
            self.init_app(app)

    def init_app(self, app: Flask) -> None:
        """Trace ``app`` (its ``Idempotency`` must be initialised already)."""
        attach(app, self)

    def stage_started(self, stage: Stage, attributes: Attributes) -> object:
        outer_token = _request_span.set(_request_span.get() or trace.get_current_span())
        span = self._tracer.start_span(SPAN_NAMES[stage], kind=SpanKind.INTERNAL)
        return _Started(span, context.attach(trace.set_span_in_context(span)), outer_token)

    def stage_ended(
        self,
        stage: Stage,
        started: object,
        seconds: float,
        attributes: Attributes,
        error: BaseException | None,
    ) -> None:
        assert isinstance(started, _Started)
        context.detach(started.token)
        _request_span.reset(started.outer_token)
        started.span.set_attributes(attributes)
        if error is not None:
            started.span.record_exception(error)
            started.span.set_status(Status(StatusCode.ERROR, type(error).__name__))
        started.span.end()

    def request_finished(self, event: RequestEvent) -> None:
        span = _request_span.get() or trace.get_current_span()
        if not span.is_recording():
            return
        span.set_attribute("idempotency.outcome", event.outcome.value)
        if event.source is not None:
            span.set_attribute("idempotency.replay.source", event.source)
        if event.takeover:
            span.set_attribute("idempotency.takeover", True)
