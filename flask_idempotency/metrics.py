"""Per-process counters of what the extension decided, and the hub that reports it.

Each request's outcome goes through :meth:`Metrics.record`: one dict increment
for ``idempotency.metrics()``, one log-level check, and nothing more unless an
observer is attached (``observability.attach``: Prometheus, OpenTelemetry, your
own). Those counters are this process's only; under gunicorn use
``observability.prometheus`` for figures that add up across workers, and
``flask idempotency stats`` (or its Prometheus collector) for the table-wide view.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, Protocol

from flask import Request, has_request_context, request
from werkzeug.exceptions import HTTPException

from . import flow
from .digests import log_key
from .observer import (
    Attributes,
    Observer,
    RequestEvent,
    RequestOutcome,
    Stage,
)
from .request_log import BREAKER_REFUSAL_LEVEL, LEVELS, TAKEOVER_LEVEL, log, log_event
from .store.base import BreakerOpenError, LeaseLostError, StoreUnavailableError

#: The snapshot counter of each outcome (a replay's depends on its source): an
#: executed request whose answer was stored is ``completed``.
_COUNTER: dict[RequestOutcome, str] = {outcome: outcome.value for outcome in RequestOutcome}
_COUNTER[RequestOutcome.EXECUTED] = "completed"
_REPLAY_COUNTER = {"cache": "replayed_from_cache", "store": "replayed_from_store"}

#: Every counter, so a snapshot always has the same keys: one per outcome, and
#: ``executed`` (claims won: the view ran, and its outcome is counted too) and
#: ``takeovers`` (those of them that took over a dead holder's record).
NAMES = (
    "executed",
    "takeovers",
    *_REPLAY_COUNTER.values(),
    *(name for outcome, name in _COUNTER.items() if outcome is not RequestOutcome.REPLAYED),
)

#: The outcome of a request refused before anything was claimed, by error code.
_REFUSALS = {
    "invalid_key": RequestOutcome.INVALID_KEY,
    "missing_key": RequestOutcome.MISSING_KEY,
    "missing_scope": RequestOutcome.MISSING_SCOPE,
    "malformed_body": RequestOutcome.MALFORMED_BODY,
}

#: What a claim decided, as the claim span's ``idempotency.claim.result``.
_CLAIM_RESULTS: dict[type, str] = {flow.Proceed: "claimed", flow.Replay: "replay"}


class RequestFacts(Protocol):
    """What the hub reads from the extension's per-request state."""

    record_key: bytes | None
    token: int | None
    scope: str | None
    request: Request | None
    started: float
    takeover: bool
    claim_seconds: float
    completion_seconds: float | None


class Metrics:
    """This process's counters for one app, and its observers."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        #: Empty until ``observability.attach``: then every hook fans out to these.
        self.observers: tuple[Observer, ...] = ()
        #: What the pool, the cache and the lease keeper call once observers exist.
        self.fanout = _Fanout(self)

    def inc(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {name: self._counts[name] for name in NAMES}

    def add_observer(self, observer: Observer) -> None:
        if observer not in self.observers:
            self.observers = (*self.observers, observer)

    # -- the request path ------------------------------------------------------

    def claimed(self, ctx: RequestFacts) -> None:
        """A claim was won; the view runs next."""
        with self._lock:
            self._counts["executed"] += 1
            if ctx.takeover:
                self._counts["takeovers"] += 1
        for observer in self.observers:
            observer.claimed(ctx.takeover)

    def record(
        self,
        ctx: RequestFacts | None,
        outcome: RequestOutcome,
        *,
        source: str | None = None,
        status: int | None = None,
        error: BaseException | None = None,
    ) -> None:
        """Count, log and report a request's outcome. The caller makes sure it is
        called once per request (``ctx`` is ``None`` before there is a record key)."""
        name = _COUNTER[outcome] if source is None else _REPLAY_COUNTER[source]
        with self._lock:
            self._counts[name] += 1
        level = LEVELS[outcome]
        if error is not None and (
            isinstance(error, BreakerOpenError) or isinstance(error.__cause__, BreakerOpenError)
        ):
            level = BREAKER_REFUSAL_LEVEL  # the breaker said it once, as it opened
        if ctx is not None and ctx.takeover and level < TAKEOVER_LEVEL:
            level = TAKEOVER_LEVEL
        loud = log.isEnabledFor(level)
        if not (loud or self.observers):
            return
        event = _event(ctx, outcome, source, status, error)
        if loud:
            log_event(event, level)
        for observer in self.observers:
            observer.request_finished(event)

    def refused(self, exc: Exception) -> None:
        """A request refused before anything was claimed (its key, scope or body)."""
        if isinstance(exc, HTTPException) and exc.code == 413:
            self.record(None, RequestOutcome.BODY_TOO_LARGE, status=413)
            return
        outcome = _REFUSALS.get(getattr(exc, "error_code", ""))
        if outcome is not None:
            self.record(None, outcome, status=400)

    def stage(
        self,
        stage: Stage,
        ctx: RequestFacts,
        *,
        source: str | None = None,
        status: int | None = None,
    ) -> StageTimer:
        """A context manager around one stage, for the observers' spans and
        histograms (with none attached, it times nothing for nobody)."""
        attributes: Attributes = {}
        if any(observer.stage_attributes for observer in self.observers):
            attributes["idempotency.route"] = _where(ctx.request)[0]
            if ctx.record_key is not None:
                attributes["idempotency.key_digest"] = log_key(ctx.record_key)
            if source is not None:
                attributes["idempotency.replay.source"] = source
            if status is not None:
                attributes["http.response.status_code"] = status
        return StageTimer(self.observers, stage, attributes)


class StageTimer:
    """One stage, told to every observer as it starts and ends."""

    __slots__ = ("_observers", "_stage", "_attributes", "_tokens", "_started")

    def __init__(
        self, observers: tuple[Observer, ...], stage: Stage, attributes: Attributes
    ) -> None:
        self._observers = observers
        self._stage = stage
        self._attributes = attributes
        self._tokens: list[object] = []
        self._started = 0.0

    def __enter__(self) -> StageTimer:
        self._tokens = [o.stage_started(self._stage, self._attributes) for o in self._observers]
        self._started = time.perf_counter()
        return self

    def __exit__(self, *exc_info: object) -> None:
        seconds = time.perf_counter() - self._started
        error = exc_info[1] if isinstance(exc_info[1], BaseException) else None
        if self._stage is Stage.COMPLETE:
            self._attributes["idempotency.outcome"] = _completion_outcome(error)
        for observer, token in zip(self._observers, self._tokens, strict=True):
            observer.stage_ended(self._stage, token, seconds, self._attributes, error)

    def decided(self, decision: flow.Decision, takeover: bool) -> None:
        """Note what the claim decided (the claim span's result and takeover)."""
        result = _CLAIM_RESULTS.get(type(decision))
        if result is None and isinstance(decision, flow.Reject):
            result = decision.reason.value
        self._attributes["idempotency.claim.result"] = result or "unknown"
        self._attributes["idempotency.takeover"] = takeover


def _completion_outcome(error: BaseException | None) -> str:
    if error is None:
        return RequestOutcome.EXECUTED.value
    if isinstance(error, LeaseLostError):
        return RequestOutcome.LEASE_LOST.value
    if isinstance(error, StoreUnavailableError):
        return RequestOutcome.STORE_UNAVAILABLE.value
    return "error"


def _passed_on(hook: str) -> Callable[..., None]:
    """An :class:`Observer` hook that calls ``hook`` of every attached observer."""

    def pass_on(self: _Fanout, *args: Any) -> None:
        for observer in self.metrics.observers:
            getattr(observer, hook)(*args)

    return pass_on


class _Fanout(Observer):
    """The pool's, the cache's and the keeper's observer: passes each call on."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    leases_renewed = _passed_on("leases_renewed")
    lease_renewal_failed = _passed_on("lease_renewal_failed")
    cache_lookup = _passed_on("cache_lookup")
    cache_rejected = _passed_on("cache_rejected")
    redis_failed = _passed_on("redis_failed")
    redis_skipped = _passed_on("redis_skipped")
    breaker_changed = _passed_on("breaker_changed")
    store_breaker_changed = _passed_on("store_breaker_changed")
    pool_checkout = _passed_on("pool_checkout")
    pool_checkin = _passed_on("pool_checkin")
    pool_waiting = _passed_on("pool_waiting")
    pool_timeout = _passed_on("pool_timeout")
    dead_lettered = _passed_on("dead_lettered")


def _where(req: Request | None) -> tuple[str, str]:
    """The matched URL rule (bounded, unlike the path, so fit for a metric label)
    and the method; from Flask's proxy only when the extension did not keep the
    request."""
    if req is None:
        if not has_request_context():
            return "<none>", ""
        req = request
    rule = req.url_rule
    return (rule.rule if rule is not None else "<unmatched>"), req.method


def _event(
    ctx: RequestFacts | None,
    outcome: RequestOutcome,
    source: str | None,
    status: int | None,
    error: BaseException | None,
) -> RequestEvent:
    route, method = _where(ctx.request if ctx is not None else None)
    if ctx is None:
        return RequestEvent(outcome, route, method, status=status, error=_describe(error))
    return RequestEvent(
        outcome,
        route,
        method,
        source,
        status,
        ctx.token is not None,
        ctx.takeover,
        log_key(ctx.record_key) if ctx.record_key is not None else None,
        time.monotonic() - ctx.started if ctx.started else None,
        ctx.claim_seconds or None,
        ctx.completion_seconds,
        _describe(error),
        ctx.scope,
    )


def _describe(error: BaseException | None) -> str | None:
    if error is None:
        return None
    text = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
