"""Per-process counters of what the extension decided, and the hub that reports it.

Each request's outcome goes through :meth:`Metrics.record`: one dict increment
for ``idempotency.metrics()``, one log-level check, and nothing more unless an
observer is attached (``observability.attach``: Prometheus, OpenTelemetry, your
own). Those counters are this process's only; under gunicorn use
``observability.prometheus`` for figures that add up across workers, and
``flask idempotency stats`` (or its Prometheus collector) for the table-wide view.
"""

from __future__ import annotations

import dataclasses
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

#: The snapshot counter of each outcome but a replay, whose counter depends on its
#: source: an executed request whose answer was stored is ``completed``.
_COUNTER: dict[RequestOutcome, str] = {outcome: outcome.value for outcome in RequestOutcome}
_COUNTER[RequestOutcome.EXECUTED] = "completed"
del _COUNTER[RequestOutcome.REPLAYED]
_REPLAY_COUNTER = {"cache": "replayed_from_cache", "store": "replayed_from_store"}

#: Every counter, so a snapshot always has the same keys: one per outcome, and
#: ``executed`` (claims won: the view ran, and its outcome is counted too) and
#: ``takeovers`` (those of them that took over a dead holder's record).
NAMES = ("executed", "takeovers", *_REPLAY_COUNTER.values(), *_COUNTER.values())

#: The outcomes of a request refused before anything was claimed (each the error
#: code of the refusal, but ``body_too_large``: any 413).
_REFUSALS = {"invalid_key", "missing_key", "missing_scope", "malformed_body", "body_too_large"}


class RequestFacts(Protocol):
    """What the hub reads of a request (an ``engine.Attempt``): the fields its outcome
    is reported with. A protocol, so that this module, below the engine, does not
    import it."""

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
        route, method = _where(ctx.request if ctx is not None else None)
        if ctx is None:
            event = RequestEvent(outcome, route, method, source, status, error=_describe(error))
        else:
            event = RequestEvent(
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
        if loud:
            log_event(event, level)
        for observer in self.observers:
            observer.request_finished(event)

    def refused(self, exc: HTTPException) -> None:
        """A request refused before anything was claimed (its key, scope or body)."""
        code = "body_too_large" if exc.code == 413 else getattr(exc, "error_code", "")
        if code in _REFUSALS:
            self.record(None, RequestOutcome(code), status=exc.code)

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


@dataclasses.dataclass(slots=True, eq=False)
class StageTimer:
    """One stage, told to every observer as it starts and ends."""

    observers: tuple[Observer, ...]
    stage: Stage
    attributes: Attributes
    tokens: list[object] = dataclasses.field(default_factory=list)
    started: float = 0.0

    def __enter__(self) -> StageTimer:
        self.tokens = [o.stage_started(self.stage, self.attributes) for o in self.observers]
        self.started = time.perf_counter()
        return self

    def __exit__(self, *exc_info: object) -> None:
        seconds = time.perf_counter() - self.started
        error = exc_info[1] if isinstance(exc_info[1], BaseException) else None
        if self.stage is Stage.COMPLETE:
            self.attributes["idempotency.outcome"] = _completion_outcome(error)
        for observer, token in zip(self.observers, self.tokens, strict=True):
            observer.stage_ended(self.stage, token, seconds, self.attributes, error)

    def decided(self, decision: flow.Decision, takeover: bool) -> None:
        """Note what the claim decided (the claim span's ``idempotency.claim.result``:
        ``claimed``, ``replay`` or why it was rejected; and the takeover)."""
        result = "claimed" if isinstance(decision, flow.Proceed) else "replay"
        if isinstance(decision, flow.Rejection):
            result = decision.value
        self.attributes["idempotency.claim.result"] = result
        self.attributes["idempotency.takeover"] = takeover


def _completion_outcome(error: BaseException | None) -> str:
    if error is None:
        return RequestOutcome.EXECUTED.value
    if isinstance(error, LeaseLostError):
        return RequestOutcome.LEASE_LOST.value
    if isinstance(error, StoreUnavailableError):
        return RequestOutcome.STORE_UNAVAILABLE.value
    return "error"


class _Fanout(Observer):
    """The pool's, the cache's, the keeper's and the consumers' observer: each of
    their hooks (every :class:`Observer` hook but the request path's, which the hub
    calls itself) is passed on to every attached observer."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics


def _passed_on(hook: str) -> Callable[..., None]:
    """An :class:`Observer` hook that calls ``hook`` of every attached observer."""

    def pass_on(self: _Fanout, *args: Any) -> None:
        for observer in self.metrics.observers:
            getattr(observer, hook)(*args)

    return pass_on


#: The request path's hooks: the hub calls the observers' own.
_REQUEST_HOOKS = {"request_finished", "claimed", "stage_started", "stage_ended"}
for _hook in vars(Observer).keys() - _REQUEST_HOOKS:
    if not _hook.startswith("_") and callable(getattr(Observer, _hook)):
        setattr(_Fanout, _hook, _passed_on(_hook))


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


def _describe(error: BaseException | None) -> str | None:
    if error is None:
        return None
    text = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
