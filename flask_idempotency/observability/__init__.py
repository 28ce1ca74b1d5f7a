"""What the extension reports about its work, for metrics, traces and logs.

Every request that reaches a decorated view ends in exactly one
:class:`RequestOutcome`. The extension counts it
per process (``idempotency.metrics()``), logs it (``flask_idempotency.requests``,
see ``request_log.py``) and hands it, as a :class:`RequestEvent`, to the observers
attached to the app with :func:`attach`. The types live in
``flask_idempotency.observer``, below every part that reports to them.

Two observers ship with the package, each behind an optional dependency and
imported only by the application that uses it:

- ``observability.prometheus.PrometheusMetrics`` (``prometheus-client``);
- ``observability.tracing.OpenTelemetryTracing`` (``opentelemetry-api``).
"""

from __future__ import annotations

from flask import Flask

from ..observer import Observer, RequestEvent, RequestOutcome, Stage
from ..state import app_state


def attach(app: Flask, observer: Observer) -> None:
    """Report ``app``'s idempotency work to ``observer`` (after ``init_app``)."""
    state = app_state(app)
    hub = state.metrics
    hub.add_observer(observer)
    # The parts call the hub only once someone listens: until then each pays
    # for an attribute that is None.
    if state.store.pool is not None:  # (memory:// has none)
        state.store.pool.observer = hub.fanout
    breaker = getattr(state.store, "breaker", None)
    if breaker is not None:  # the state it is in now; transitions are reported as they come
        hub.fanout.store_breaker_changed(breaker.state.value)
    state.keeper.observer = hub.fanout
    attach_cache = getattr(state.cache, "attach_observer", None)
    if attach_cache is not None:
        attach_cache(hub.fanout)


__all__ = [
    "Observer",
    "RequestEvent",
    "RequestOutcome",
    "Stage",
    "attach",
]
