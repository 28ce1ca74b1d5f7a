"""The Flask layer: ``Idempotency``, its decorators, hooks and per-request state.

The decorator claims the key (after the route's own authentication, which wraps
it) and runs the view; ``after_request`` completes or releases the claim once
the final response exists; ``teardown_request`` guarantees the claim and the
connection are given back even when something raised.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, ParamSpec, TypeVar, overload

from flask import Flask, Request, Response, current_app, g, request
from flask.typing import ResponseReturnValue
from werkzeug.exceptions import HTTPException

from . import cli, flow, keys, phases, recovery, responses
from .cache import ResponseCache, cache_from_settings
from .errors import (
    IdempotencyError,
    KeyReused,
    LeaseLost,
    RequestInProgress,
    ResponseTooLarge,
    StoreUnavailable,
)
from .events import consumer as events_consumer
from .events import outbox
from .lease import LeaseKeeper
from .metrics import Metrics
from .observability import PHASE_CLAIM, PHASE_COMPLETE, PHASE_REPLAY, Outcome
from .profiles import PROFILES, STRIPE, Profile
from .request_body import read_body
from .route_options import (
    EffectiveOptions,
    RecoverFunc,
    RecoveryDataFunc,
    RouteOptions,
    check_against_settings,
    route_options,
)
from .settings import FingerprintFunc, ScopeFunc, Settings, ShouldStore, settings_from_config
from .store.base import (
    Claimed,
    Existing,
    LeaseHold,
    LeaseLostError,
    StoredResponse,
    StoreUnavailableError,
)
from .store.errors import is_unreachable
from .store.postgres import PostgresRequest, PostgresStore

log = logging.getLogger("flask_idempotency")

P = ParamSpec("P")
R = TypeVar("R", bound=ResponseReturnValue)
T = TypeVar("T")
View = Callable[P, R]

EXTENSION_KEY = "idempotency"

#: Methods that are idempotent already: the layer lets them through, key or not.
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})



@dataclasses.dataclass
class IdempotencyState:
    """Everything one app's extension owns; lives in ``app.extensions["idempotency"]``."""

    settings: Settings
    store: PostgresStore
    cache: ResponseCache
    keeper: LeaseKeeper
    metrics: Metrics = dataclasses.field(default_factory=Metrics)
    #: The error format and replay headers (``IDEMPOTENCY_PROFILE``).
    profile: Profile = STRIPE
    #: ``IDEMPOTENCY_AUTO_MIGRATE`` found PostgreSQL unreachable at start-up: the
    #: migrations run before the first request that reaches it instead.
    migrations_pending: bool = False
    #: The start-up migration failed for an outage and was put off (for the log).
    migration_deferred: bool = False
    _migrate_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    #: Each route's options over the app's settings, checked on its first request.
    _routes: dict[RouteOptions, EffectiveOptions] = dataclasses.field(default_factory=dict)

    def migrate_if_pending(self) -> None:
        """Apply the pending migrations once; raises ``StoreUnavailableError`` while
        PostgreSQL is still unreachable (the caller answers 503)."""
        if not self.migrations_pending:
            return
        with self._migrate_lock:
            if self.migrations_pending:
                self.store.migrate(self.settings.migration_dirs)
                self.migrations_pending = False
                if self.migration_deferred:
                    log.warning("idempotency: PostgreSQL is back; migrations applied")

    def options_for(self, options: RouteOptions) -> EffectiveOptions:
        """A route's effective options; ``ValueError`` on its first request if they
        break renewal interval < lease <= TTL together with the app's settings."""
        effective = self._routes.get(options)
        if effective is None:
            effective = self._routes[options] = check_against_settings(options, self.settings)
        return effective

    def close(self) -> None:
        """Stop the keeper and close the pool and cache (tests, app shutdown)."""
        self.keeper.stop()
        self.cache.close()
        self.store.close()


@dataclasses.dataclass
class RequestState:
    """What one request holds between the decorator and the teardown (``g._idempotency``)."""

    state: IdempotencyState
    #: ``None`` on an ``optional`` route called without a key: the view still gets
    #: ``connection()``, in an ordinary transaction settled by the same rule.
    record_key: bytes | None
    fingerprint: bytes
    route: EffectiveOptions
    tx: PostgresRequest | None = None
    token: int | None = None
    claimed_at: float = 0.0
    replayed: bool = False
    settled: bool = False
    #: The view raised (whatever an error handler then rendered): released, never stored.
    raised: bool = False
    #: The view ended in one of our errors (the store failed under it, its lease was
    #: lost): released like any unstored answer, but without ``Idempotent-Replayed``.
    own_error: bool = False
    # -- recovery (``recovery.py``, ``phases.py``)
    #: What a ``recover=`` route keeps with its claim, for the completer.
    recovery: bytes | None = None
    #: Recovery points committed for this record, by name: an earlier holder's
    #: (taken over) and this attempt's own.
    phases: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: Names of the phases this attempt has reached (each may appear once).
    phases_reached: set[str] = dataclasses.field(default_factory=set)
    # -- for the outcome's metrics, log event and spans (``metrics.RequestFacts``)
    #: ``time.monotonic()`` when the decorator took the request.
    started: float = 0.0
    #: The request itself (not Flask's proxy: reading it costs nothing).
    request: Request | None = None
    #: The principal the key belongs to (only its digest is ever reported).
    scope: str | None = None
    #: The claim took over a record whose holder's lease had expired.
    takeover: bool = False
    claim_seconds: float = 0.0
    completion_seconds: float | None = None
    #: Set once: every request reports exactly one outcome (``_record``).
    outcome: Outcome | None = None


class RouteDecorator:
    """The decorator behind ``required`` and ``optional``, usable bare or with
    per-route options. It needs no app: state is resolved when the view is called."""

    def __init__(self, required: bool) -> None:
        self._required = required

    @overload
    def __call__(self, view: View[P, R], /) -> View[P, R | Response]: ...

    @overload
    def __call__(
        self,
        *,
        ttl: float | timedelta | None = None,
        lease: float | timedelta | None = None,
        wait: float | timedelta | None = None,
        should_store: ShouldStore | None = None,
        scope_func: ScopeFunc | None = None,
        fingerprint_func: FingerprintFunc | None = None,
        oversize: str | None = None,
        recover: RecoverFunc | None = None,
        recovery_data: RecoveryDataFunc | None = None,
    ) -> Callable[[View[P, R]], View[P, R | Response]]: ...

    def __call__(
        self,
        view: Any = None,
        *,
        ttl: float | timedelta | None = None,
        lease: float | timedelta | None = None,
        wait: float | timedelta | None = None,
        should_store: ShouldStore | None = None,
        scope_func: ScopeFunc | None = None,
        fingerprint_func: FingerprintFunc | None = None,
        oversize: str | None = None,
        recover: RecoverFunc | None = None,
        recovery_data: RecoveryDataFunc | None = None,
    ) -> Any:
        """``recover=f`` (row mode): how ``flask idempotency recover`` finishes an
        attempt whose holder died; ``recovery_data=g``: JSON it needs beyond the
        request, kept with the claim. See ``recovery.py``."""
        options = route_options(
            self._required,
            ttl=ttl,
            lease=lease,
            wait=wait,
            should_store=should_store,
            scope_func=scope_func,
            fingerprint_func=fingerprint_func,
            oversize=oversize,
            recover=recover,
            recovery_data=recovery_data,
        )

        def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
            # Flask's ensure_sync asks this on every call; a view's kind never changes.
            is_async = inspect.iscoroutinefunction(fn)

            @functools.wraps(fn)
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                return _run_idempotent(options, fn, is_async, args, kwargs)

            # How the recover command finds the route (decorators above copy it).
            setattr(wrapper, recovery.ROUTE_ATTRIBUTE, options)
            return wrapper

        return decorator(view) if view is not None else decorator


class Idempotency:
    """Idempotency-Key support for a Flask app, with PostgreSQL as the source of truth."""

    def __init__(self, app: Flask | None = None) -> None:
        if app is not None:
            self.init_app(app)

    def init_app(self, app: Flask) -> None:
        if EXTENSION_KEY in app.extensions:
            raise RuntimeError("flask_idempotency is already initialised on this app")
        settings = settings_from_config(app.config.get_namespace("IDEMPOTENCY_"))
        store = PostgresStore.from_settings(settings)
        state = IdempotencyState(
            settings=settings,
            store=store,
            cache=cache_from_settings(settings),
            keeper=LeaseKeeper(store, settings.renew_interval),
            profile=PROFILES[settings.profile],
        )
        app.extensions[EXTENSION_KEY] = state
        app.after_request(_after_request)
        app.teardown_request(_teardown_request)
        app.cli.add_command(cli.group)
        if settings.auto_migrate:
            state.migrations_pending = True
            try:
                state.migrate_if_pending()
            except StoreUnavailableError as exc:
                if exc.__cause__ is None or not is_unreachable(exc.__cause__):
                    raise  # a migration that fails on a live database must stop the start
                # Under gunicorn a worker that raises here makes the master halt every
                # worker: a database outage while one worker restarts would take the
                # whole API down for good. Start anyway; requests answer 503 until the
                # database is back, and the first one that reaches it migrates.
                state.migration_deferred = True
                log.error(
                    "idempotency: PostgreSQL unreachable at start (%s); migrating once it answers",
                    exc,
                )

    # -- decorators ---------------------------------------------------------

    #: ``@idempotency.required`` or ``@idempotency.required(ttl=...)``: require an
    #: Idempotency-Key (400 ``missing_key`` without one).
    required = RouteDecorator(required=True)
    #: ``@idempotency.optional``: deduplicate when the client sends a key, run
    #: normally when it does not.
    optional = RouteDecorator(required=False)

    # -- what views and applications use -------------------------------------

    def connection(self) -> Any:
        """The psycopg2 connection of the current idempotent request, inside the
        transaction that will also store the response: write your business rows
        here and they commit together with the idempotency record, or not at all.

        Do not commit or roll back yourself; the extension does, after the view.
        On an ``optional`` route called without a key there is no record, and the
        transaction is settled by the same rule: committed when the answer is one
        that would have been stored, rolled back otherwise (or if the view raised).
        """
        ctx = _request_state()
        if ctx is None or (ctx.record_key is not None and ctx.token is None):
            raise RuntimeError("idempotency.connection() needs a running idempotent request")
        if ctx.tx is None:
            ctx.tx = ctx.state.store.begin()
        try:
            return ctx.tx.connection()
        except StoreUnavailableError as exc:
            raise StoreUnavailable(retry_after=ctx.state.settings.retry_after) from exc

    @contextmanager
    def transaction(self) -> Iterator[Any]:
        """A pooled connection in a transaction for routes outside idempotency;
        committed on success, rolled back on an exception; 503 if unreachable."""
        state = _app_state()
        try:
            state.migrate_if_pending()
            with state.store.transaction() as conn, outbox.bind(conn, state.settings.ttl):
                yield conn  # emit() in the block writes on this transaction
        except StoreUnavailableError as exc:
            raise StoreUnavailable(retry_after=state.settings.retry_after) from exc

    def emit(self, event_type: str, payload: Any, *, ttl: float | timedelta | None = None) -> str:
        """Write an event to the outbox in the current transaction; return its id.

        Inside ``transaction()``, on that transaction; inside an idempotent request
        or a consumer's handler, on ``connection()``, so the event commits with the
        stored answer or not at all (released, rolled back, fenced: no event; a
        replay runs no view and emits nothing). On an ``optional`` route without a
        key it joins the keyless transaction, under a random id. ``payload`` must
        be JSON; a published event is kept ``ttl`` seconds (default: the record's
        TTL). ``flask idempotency relay`` publishes it (``events/outbox.py``).
        """
        bound = outbox.bound_transaction()
        if bound is not None:
            conn, scope = bound
        else:
            conn = self.connection()  # RuntimeError outside an idempotent request
            ctx = _request_state()
            assert ctx is not None
            scope = outbox.request_scope(ctx.record_key, ctx.token, ctx.route.ttl)
        return scope.emit(conn, event_type, payload, ttl)

    def consumer(
        self,
        name: str,
        *,
        key: events_consumer.KeyFunc | None = None,
        max_attempts: int = 5,
        lease: float | timedelta | None = None,
        ttl: float | timedelta | None = None,
        retry_delay: float | timedelta = 1.0,
        max_retry_delay: float | timedelta = 60.0,
        busy_delay: float | timedelta = 1.0,
    ) -> Callable[[events_consumer.Handler], events_consumer.ConsumerGuard]:
        """``@idempotency.consumer("receipts")``: run a message handler once in effect
        per message (keyed by message id, or ``key(delivery)``), with the HTTP
        route's claim, lease and fencing; dead-letter after ``max_attempts``.
        See ``events/consumer.py``."""
        options = events_consumer.consumer_options(
            name,
            key=key,
            max_attempts=max_attempts,
            lease=lease,
            ttl=ttl,
            retry_delay=retry_delay,
            max_retry_delay=max_retry_delay,
            busy_delay=busy_delay,
        )

        def decorator(handler: events_consumer.Handler) -> events_consumer.ConsumerGuard:
            return events_consumer.ConsumerGuard(handler, options)

        return decorator

    def derived_key(self, purpose: str) -> str:
        """A key for a downstream call, derived from this request's record (scope
        and client key): a retry after a crash sends the same key again."""
        ctx = _request_state()
        if ctx is None or ctx.record_key is None:
            raise RuntimeError("derived_key() needs a running idempotent request with a key")
        return keys.derived_key(ctx.record_key, purpose)

    def phase(self, name: str, step: Callable[[], T]) -> Any:
        """Run ``step`` as the recovery point ``name`` and return what it recorded.

        ``step`` does one external call and writes what came of it on
        ``connection()``; its return value (JSON) is committed with those writes
        and the record's progress, fenced by the lock token. When a takeover (a
        retry after the holder died, or ``flask idempotency recover``) reaches a
        phase an earlier attempt committed, ``step`` does not run again: its
        recorded value is returned. See ``phases.py``.
        """
        return phases.run(_request_state(), name, step)

    def metrics(self) -> dict[str, int]:
        """This process's counters (see ``metrics.NAMES``) for the current app."""
        return _app_state().metrics.snapshot()

    @property
    def state(self) -> IdempotencyState:
        return _app_state()


def _app_state(app: Flask | None = None) -> IdempotencyState:
    """The extension's state on ``app`` (the current app when not given)."""
    extensions = (app if app is not None else current_app).extensions
    try:
        state: IdempotencyState = extensions[EXTENSION_KEY]
    except KeyError:
        raise RuntimeError("flask_idempotency is not initialised on this app") from None
    return state


def _request_state() -> RequestState | None:
    ctx: RequestState | None = g.get("_idempotency")
    return ctx


def _run_idempotent(
    options: RouteOptions, view: Callable[..., Any], is_async: bool, args: Any, kwargs: Any
) -> Any:
    # Resolved once: every attribute read through Flask's proxies costs a context
    # lookup, and the hot path reads the request about twenty times.
    app: Flask = current_app._get_current_object()  # type: ignore[attr-defined]
    if g.get("_idempotency") is not None:
        # A decorated view called from another one: the outer view's claim (or its
        # keyless transaction) already covers this request. A second claim of the
        # same key would answer 409 inside the outer view and wedge its record.
        return _sync(app, view, is_async)(*args, **kwargs)
    started = time.monotonic()
    req: Request = request._get_current_object()  # type: ignore[attr-defined]
    state = _app_state(app)
    settings = state.settings
    route = state.options_for(options)
    if req.method in SAFE_METHODS:
        # GET and its kin are idempotent already: a key on them is ignored (the
        # IETF draft's section 1), even on a route that requires one for POST.
        key = None
    else:
        try:
            key = keys.parse_key(req.headers.get(settings.key_header))
            if key is None and options.required:
                keys.require_key(None)
        except IdempotencyError as exc:
            state.metrics.refused(exc)
            raise
    if key is None:
        g._idempotency = RequestState(state, None, b"", route, started=started, request=req)
        return _call_view(g._idempotency, app, _sync(app, view, is_async), args, kwargs)

    try:
        scope = keys.resolve_scope(route.scope_func, req)
        read_body(req)
    except HTTPException as exc:  # missing_scope, malformed_body, 413
        state.metrics.refused(exc)
        raise
    record_key = keys.record_key(scope, key)
    fingerprint = route.fingerprint_func(req)
    ctx = RequestState(
        state, record_key, fingerprint, route, started=started, scope=scope, request=req
    )
    g._idempotency = ctx

    cached = state.cache.get(record_key)
    if cached is not None:
        decision = flow.decide(
            Existing("completed", cached.fingerprint, cached.response), fingerprint
        )
        if isinstance(decision, flow.Replay):
            return _replay(ctx, decision.response, "cache")
        _record(ctx, Outcome.KEY_REUSED, status=KeyReused.code)
        raise KeyReused()

    try:
        state.migrate_if_pending()
    except StoreUnavailableError as exc:
        _record(ctx, Outcome.STORE_UNAVAILABLE, status=StoreUnavailable.code, error=exc)
        raise StoreUnavailable(retry_after=settings.retry_after) from exc
    if options.recover is not None and settings.claim_mode == "row":
        ctx.recovery = recovery.capture(options, req)  # written by the claim itself
    ctx.tx = state.store.begin()
    decision, existing = _claim(ctx, route.lease)
    deadline = time.monotonic() + route.wait
    while _in_progress(decision) and time.monotonic() < deadline:
        # A waiting duplicate gives its connection back while it sleeps: otherwise
        # a few waiters would hold every pool slot the running requests need.
        ctx.tx.close()
        time.sleep(settings.wait_poll_interval)
        decision, existing = _claim(ctx, route.lease)

    if isinstance(decision, flow.Proceed):
        ctx.token = decision.token
        ctx.phases = dict(decision.phases)  # a dead holder's recovery points: resumed
        state.metrics.claimed(ctx)
        if ctx.tx.holds_lease:
            state.keeper.hold(LeaseHold(record_key, decision.token, route.lease))
        return _call_view(ctx, app, _sync(app, view, is_async), args, kwargs)

    ctx.tx.close()
    if isinstance(decision, flow.Replay):
        if existing is not None and existing.ttl_remaining:
            # PostgreSQL measured the remainder when the claim ran; the copy must
            # not outlive the record by the time that has passed since.
            remaining = existing.ttl_remaining - (time.monotonic() - ctx.claimed_at)
            state.cache.put(record_key, fingerprint, decision.response, remaining)
        return _replay(ctx, decision.response, "store")
    if decision.reason is flow.Rejection.KEY_REUSED:
        _record(ctx, Outcome.KEY_REUSED, status=KeyReused.code)
        raise KeyReused()
    _record(ctx, Outcome.IN_PROGRESS, status=RequestInProgress.code)
    lease_remaining = existing.lease_remaining if existing is not None else None
    raise RequestInProgress(
        retry_after=flow.retry_after_seconds(settings.retry_after, lease_remaining)
    )


def _sync(app: Flask, view: Callable[..., Any], is_async: bool) -> Callable[..., Any]:
    """The view as WSGI calls it: an ``async def`` one through Flask's ``ensure_sync``."""
    return app.ensure_sync(view) if is_async else view


def _call_view(
    ctx: RequestState, app: Flask, view: Callable[..., Any], args: Any, kwargs: Any
) -> Any:
    """Run the (synchronous) view; if it raises, nothing of the attempt is kept,
    whatever answer an error handler later renders for the exception (a 402
    included)."""
    try:
        return view(*args, **kwargs)
    except BaseException as exc:
        ctx.raised = True
        ctx.own_error = isinstance(exc, IdempotencyError)
        if isinstance(exc, (StoreUnavailable, LeaseLost)):  # else released, below
            _record(ctx, Outcome(exc.error_code), status=exc.code, error=exc.__cause__)
        _release(ctx)
        raise


def _in_progress(decision: flow.Decision) -> bool:
    return isinstance(decision, flow.Reject) and decision.reason is flow.Rejection.IN_PROGRESS


def _claim(ctx: RequestState, lease: float) -> tuple[flow.Decision, Existing | None]:
    assert ctx.tx is not None and ctx.record_key is not None
    started = time.monotonic()
    with ctx.state.metrics.phase(PHASE_CLAIM, ctx) as phase:
        try:
            result = ctx.tx.claim(
                ctx.record_key,
                ctx.fingerprint,
                lease=lease,
                ttl=ctx.route.ttl,
                recovery=ctx.recovery,
            )
        except StoreUnavailableError as exc:
            ctx.claim_seconds += time.monotonic() - started
            _record(ctx, Outcome.STORE_UNAVAILABLE, status=StoreUnavailable.code, error=exc)
            raise StoreUnavailable(retry_after=ctx.state.settings.retry_after) from exc
        decision = flow.decide(result, ctx.fingerprint)
        ctx.takeover = isinstance(result, Claimed) and result.takeover
        phase.decided(decision, ctx.takeover)
    ctx.claimed_at = started
    ctx.claim_seconds += time.monotonic() - started
    return decision, result if isinstance(result, Existing) else None


def _record(
    ctx: RequestState,
    outcome: Outcome,
    *,
    source: str | None = None,
    status: int | None = None,
    error: BaseException | None = None,
) -> None:
    """The request's outcome, once: counted, logged and handed to the app's
    observers (``metrics.Metrics.record``). Later calls for the same request (a
    release after a failed completion, the teardown's fallback) are ignored."""
    if ctx.outcome is None:
        ctx.outcome = outcome
        ctx.state.metrics.record(ctx, outcome, source=source, status=status, error=error)


def _pass_through(ctx: RequestState) -> Outcome:
    """A request with no key to deduplicate: a safe method, or an optional route
    called without one."""
    return Outcome.SAFE_METHOD if request.method in SAFE_METHODS else Outcome.KEYLESS


def _replay(ctx: RequestState, stored: StoredResponse, source: str) -> Response:
    """Answer with a stored response, from the cache or the store."""
    ctx.replayed = True
    with ctx.state.metrics.phase(PHASE_REPLAY, ctx, source=source, status=stored.status):
        answer = responses.replay(stored, ctx.state.profile)
    _record(ctx, Outcome.REPLAYED, source=source, status=stored.status)
    return answer


def _release(ctx: RequestState) -> None:
    """Roll back the attempt and give up its claim (or its keyless transaction) once."""
    if ctx.settled:
        return
    ctx.settled = True
    if ctx.tx is None:
        return
    if ctx.record_key is None or ctx.token is None:
        ctx.tx.rollback()
        return
    ctx.state.keeper.drop(ctx.record_key, ctx.token)
    _record(ctx, Outcome.RELEASED)
    ctx.tx.release(ctx.record_key, ctx.token)


def _after_request(response: Response) -> Response:
    ctx = _request_state()
    if ctx is None:
        return response
    response = _settle(ctx, response)
    if ctx.state.settings.expose_headers:
        responses.expose_headers(response)
    return response


def _settle(ctx: RequestState, response: Response) -> Response:
    if ctx.replayed:
        # A replay carries its header from responses.replay(); nothing to settle.
        return response
    if ctx.raised:
        # Released when the view raised; this is an error handler's rendering.
        if not ctx.own_error and ctx.record_key is not None:
            responses.mark_original(response, ctx.state.profile)
        return response
    if ctx.settled:
        return response
    if ctx.record_key is None:
        response = _settle_keyless(ctx, response)
        _record(ctx, _pass_through(ctx), status=response.status_code)
        return response
    if ctx.token is None or ctx.tx is None:
        return response
    return _settle_claim(ctx, ctx.tx, ctx.record_key, ctx.token, response)


def _settle_keyless(ctx: RequestState, response: Response) -> Response:
    """An ``optional`` route without a key: commit the view's transaction when its
    answer is one that would have been stored, roll it back otherwise."""
    ctx.settled = True
    if ctx.tx is None:
        return response
    if not ctx.route.should_store(response.status_code):
        ctx.tx.rollback()
        return response
    try:
        ctx.tx.commit()
    except StoreUnavailableError as exc:
        _record(ctx, Outcome.STORE_UNAVAILABLE, status=StoreUnavailable.code, error=exc)
        return _error_response(StoreUnavailable(retry_after=ctx.state.settings.retry_after))
    return response


def _settle_claim(
    ctx: RequestState, tx: PostgresRequest, record_key: bytes, token: int, response: Response
) -> Response:
    state = ctx.state
    try:
        stored = responses.capture(
            response,
            state.settings.max_stored_body,
            omit_oversize=ctx.route.oversize == "omit_body",
        )
    except responses.NotStorable:
        stored = None
    except BaseException:
        # A streamed body that failed while it was read: as if the view raised.
        ctx.raised = True
        _release(ctx)
        raise
    ctx.settled = True
    state.keeper.drop(record_key, token)
    if stored is None:
        settlement = flow.Settlement.TOO_LARGE
    else:
        settlement = flow.settle(
            stored.status, len(stored.body), ctx.route.should_store, state.settings.max_stored_body
        )

    if settlement is flow.Settlement.RELEASE:
        _record(ctx, Outcome.RELEASED, status=response.status_code)
        tx.release(record_key, token)
        if not ctx.own_error:
            responses.mark_original(response, state.profile)
        return response
    if settlement is flow.Settlement.TOO_LARGE or stored is None:
        too_large = ResponseTooLarge()
        _record(ctx, Outcome.NOT_STORABLE, status=too_large.code, error=too_large)
        tx.release(record_key, token)
        response.close()
        return _error_response(too_large)

    started = time.monotonic()
    try:
        with state.metrics.phase(PHASE_COMPLETE, ctx, status=stored.status):
            tx.complete(record_key, token, stored)
    except LeaseLostError:
        ctx.completion_seconds = time.monotonic() - started
        _record(ctx, Outcome.LEASE_LOST, status=LeaseLost.code)
        return _error_response(LeaseLost(retry_after=state.settings.retry_after))
    except StoreUnavailableError as exc:
        ctx.completion_seconds = time.monotonic() - started
        tx.release(record_key, token)
        _record(ctx, Outcome.STORE_UNAVAILABLE, status=StoreUnavailable.code, error=exc)
        return _error_response(StoreUnavailable(retry_after=state.settings.retry_after))
    ctx.completion_seconds = time.monotonic() - started
    _record(ctx, Outcome.EXECUTED, status=stored.status)
    if state.settings.redis_fill == "completion":
        # (With "replay" the copy is made by the first replay from PostgreSQL.)
        remaining = ctx.route.ttl - (time.monotonic() - ctx.claimed_at)
        state.cache.put(record_key, ctx.fingerprint, stored, remaining)
    responses.mark_original(response, state.profile)
    return response


def _error_response(error: IdempotencyError) -> Response:
    """Render one of our errors from ``after_request``, where raising is too late."""
    return Response(error.get_body(), error.code, error.get_headers())


def _teardown_request(exc: BaseException | None) -> None:
    ctx: RequestState | None = g.pop("_idempotency", None)
    if ctx is None:
        return
    if ctx.tx is not None:
        if not ctx.settled and not ctx.replayed:
            # The view raised past Flask's handlers, or after_request failed: nothing
            # is stored, so a retry runs again.
            _release(ctx)
        ctx.tx.close()
    if ctx.outcome is None:  # a pass-through, or an answer no settlement saw
        _record(ctx, _pass_through(ctx) if ctx.record_key is None else Outcome.RELEASED)
