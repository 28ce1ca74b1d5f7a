"""The Flask layer: ``Idempotency``, its decorators, hooks and per-request state.

The decorator claims the key (after the route's own authentication, which wraps
it) and runs the view; ``after_request`` completes or releases the claim once
the final response exists; ``teardown_request`` guarantees the claim and the
connection are given back even when something raised.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar, overload

import psycopg2
from flask import Flask, Request, Response, current_app, g, request
from flask.typing import ResponseReturnValue
from typing_extensions import ParamSpec

from . import cli, flow, keys, responses
from .cache import ResponseCache, cache_from_settings
from .errors import (
    IdempotencyError,
    KeyReused,
    LeaseLost,
    RequestInProgress,
    ResponseTooLarge,
    StoreUnavailable,
)
from .lease import LeaseKeeper
from .metrics import Metrics
from .request_body import read_body
from .settings import FingerprintFunc, ScopeFunc, Settings, ShouldStore, settings_from_config
from .store.base import (
    Existing,
    LeaseHold,
    LeaseLostError,
    StoreUnavailableError,
)
from .store.postgres import PostgresRequest, PostgresStore

log = logging.getLogger("flask_idempotency")

P = ParamSpec("P")
R = TypeVar("R", bound=ResponseReturnValue)
View = Callable[P, R]

EXTENSION_KEY = "idempotency"

#: Driver errors that mean "PostgreSQL cannot be reached", as opposed to a failing statement.
_UNREACHABLE = (psycopg2.OperationalError, psycopg2.InterfaceError)


@dataclasses.dataclass
class IdempotencyState:
    """Everything one app's extension owns; lives in ``app.extensions["idempotency"]``."""

    settings: Settings
    store: PostgresStore
    cache: ResponseCache
    keeper: LeaseKeeper
    metrics: Metrics = dataclasses.field(default_factory=Metrics)
    #: ``IDEMPOTENCY_AUTO_MIGRATE`` found PostgreSQL unreachable at start-up: the
    #: migrations run before the first request that reaches it instead.
    migrations_pending: bool = False
    #: The start-up migration failed for an outage and was put off (for the log).
    migration_deferred: bool = False
    _migrate_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

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

    def close(self) -> None:
        """Stop the keeper and close the pool and cache (tests, app shutdown)."""
        self.keeper.stop()
        self.cache.close()
        self.store.close()


@dataclasses.dataclass(frozen=True)
class RouteOptions:
    """Per-route overrides given to the decorator; ``None`` means the app's setting."""

    required: bool
    ttl: float | None = None
    lease: float | None = None
    wait: float | None = None
    should_store: ShouldStore | None = None
    scope_func: ScopeFunc | None = None
    fingerprint_func: FingerprintFunc | None = None


@dataclasses.dataclass
class RequestState:
    """What one request holds between the decorator and the teardown (``g._idempotency``)."""

    state: IdempotencyState
    record_key: bytes
    fingerprint: bytes
    ttl: float
    should_store: ShouldStore
    tx: PostgresRequest | None = None
    token: int | None = None
    claimed_at: float = 0.0
    replayed: bool = False
    settled: bool = False
    #: The view ended in one of our errors (the store failed under it, its lease was
    #: lost): released like any unstored answer, but without ``Idempotent-Replayed``.
    own_error: bool = False


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
        ttl: float | None = None,
        lease: float | None = None,
        wait: float | None = None,
        should_store: ShouldStore | None = None,
        scope_func: ScopeFunc | None = None,
        fingerprint_func: FingerprintFunc | None = None,
    ) -> Callable[[View[P, R]], View[P, R | Response]]: ...

    def __call__(
        self,
        view: Any = None,
        *,
        ttl: float | None = None,
        lease: float | None = None,
        wait: float | None = None,
        should_store: ShouldStore | None = None,
        scope_func: ScopeFunc | None = None,
        fingerprint_func: FingerprintFunc | None = None,
    ) -> Any:
        options = RouteOptions(
            self._required, ttl, lease, wait, should_store, scope_func, fingerprint_func
        )

        def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(fn)
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                return _run_idempotent(options, fn, args, kwargs)

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
                if not isinstance(exc.__cause__, _UNREACHABLE):
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
        """
        ctx = _request_state()
        if ctx is None or ctx.tx is None or ctx.token is None:
            raise RuntimeError("idempotency.connection() needs a running idempotent request")
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
            with state.store.transaction() as conn:
                yield conn
        except StoreUnavailableError as exc:
            raise StoreUnavailable(retry_after=state.settings.retry_after) from exc

    def derived_key(self, purpose: str) -> str:
        """A key for a downstream call, derived from this request's record (scope
        and client key): a retry after a crash sends the same key again."""
        ctx = _request_state()
        if ctx is None:
            raise RuntimeError("derived_key() needs a running idempotent request")
        return keys.derived_key(ctx.record_key, purpose)

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


def _run_idempotent(options: RouteOptions, view: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    # Resolved once: every attribute read through Flask's proxies costs a context
    # lookup, and the hot path reads the request about twenty times.
    app: Flask = current_app._get_current_object()  # type: ignore[attr-defined]
    req: Request = request._get_current_object()  # type: ignore[attr-defined]
    state = _app_state(app)
    settings = state.settings
    key = keys.parse_key(req.headers.get(settings.key_header))
    if key is None:
        if options.required:
            keys.require_key(None)
        return app.ensure_sync(view)(*args, **kwargs)

    scope_func = options.scope_func or settings.scope_func
    fingerprint_func = options.fingerprint_func or settings.fingerprint_func
    record_key = keys.record_key(scope_func(req), key)
    read_body(req)
    fingerprint = fingerprint_func(req)
    ctx = RequestState(
        state=state,
        record_key=record_key,
        fingerprint=fingerprint,
        ttl=options.ttl if options.ttl is not None else settings.ttl,
        should_store=options.should_store or settings.should_store,
    )
    g._idempotency = ctx

    cached = state.cache.get(record_key)
    if cached is not None:
        decision = flow.decide(
            Existing("completed", cached.fingerprint, cached.response), fingerprint
        )
        if isinstance(decision, flow.Replay):
            ctx.replayed = True
            state.metrics.inc("replayed_from_cache")
            return responses.replay(decision.response)
        state.metrics.inc("key_reused")
        raise KeyReused()

    lease = options.lease if options.lease is not None else settings.lease
    wait = options.wait if options.wait is not None else settings.wait
    try:
        state.migrate_if_pending()
    except StoreUnavailableError as exc:
        state.metrics.inc("store_unavailable")
        raise StoreUnavailable(retry_after=settings.retry_after) from exc
    ctx.tx = state.store.begin()
    decision, existing = _claim(ctx, lease)
    deadline = time.monotonic() + wait
    while _in_progress(decision) and time.monotonic() < deadline:
        time.sleep(settings.wait_poll_interval)
        decision, existing = _claim(ctx, lease)

    if isinstance(decision, flow.Proceed):
        ctx.token = decision.token
        state.metrics.inc("executed")
        state.keeper.hold(LeaseHold(record_key, decision.token, lease))
        try:
            return app.ensure_sync(view)(*args, **kwargs)
        except IdempotencyError:
            ctx.own_error = True
            raise

    ctx.tx.close()
    if isinstance(decision, flow.Replay):
        ctx.replayed = True
        state.metrics.inc("replayed_from_store")
        if existing is not None and existing.ttl_remaining:
            # PostgreSQL measured the remainder when the claim ran; the copy must
            # not outlive the record by the time that has passed since.
            remaining = existing.ttl_remaining - (time.monotonic() - ctx.claimed_at)
            state.cache.put(record_key, fingerprint, decision.response, remaining)
        return responses.replay(decision.response)
    if decision.reason is flow.Rejection.KEY_REUSED:
        state.metrics.inc("key_reused")
        raise KeyReused()
    state.metrics.inc("in_progress")
    lease_remaining = existing.lease_remaining if existing is not None else None
    raise RequestInProgress(
        retry_after=flow.retry_after_seconds(settings.retry_after, lease_remaining)
    )


def _in_progress(decision: flow.Decision) -> bool:
    return isinstance(decision, flow.Reject) and decision.reason is flow.Rejection.IN_PROGRESS


def _claim(ctx: RequestState, lease: float) -> tuple[flow.Decision, Existing | None]:
    assert ctx.tx is not None
    started = time.monotonic()
    try:
        result = ctx.tx.claim(ctx.record_key, ctx.fingerprint, lease=lease, ttl=ctx.ttl)
    except StoreUnavailableError as exc:
        log.error(
            "idempotency: store unavailable for key %s: %s", keys.log_key(ctx.record_key), exc
        )
        ctx.state.metrics.inc("store_unavailable")
        raise StoreUnavailable(retry_after=ctx.state.settings.retry_after) from exc
    ctx.claimed_at = started
    return flow.decide(result, ctx.fingerprint), result if isinstance(result, Existing) else None


def _after_request(response: Response) -> Response:
    ctx = _request_state()
    if ctx is None:
        return response
    if ctx.replayed or ctx.token is None or ctx.settled or ctx.tx is None:
        # A replay carries its header from responses.replay(); nothing to settle.
        return response
    ctx.settled = True
    state, tx, token = ctx.state, ctx.tx, ctx.token
    state.keeper.drop(ctx.record_key, token)
    try:
        stored = responses.capture(response)
        settlement = flow.settle(
            stored.status, len(stored.body), ctx.should_store, state.settings.max_stored_body
        )
    except responses.NotStorable:
        settlement = flow.Settlement.TOO_LARGE

    if settlement is flow.Settlement.RELEASE:
        state.metrics.inc("released")
        tx.release(ctx.record_key, token)
        if not ctx.own_error:
            response.headers[responses.REPLAYED_HEADER] = "false"
        return response
    if settlement is flow.Settlement.TOO_LARGE:
        log.error(
            "idempotency: response for key %s cannot be stored; rolled back",
            keys.log_key(ctx.record_key),
        )
        state.metrics.inc("not_storable")
        tx.release(ctx.record_key, token)
        return _error_response(ResponseTooLarge())

    try:
        tx.complete(ctx.record_key, token, stored)
    except LeaseLostError:
        state.metrics.inc("lease_lost")
        log.warning(
            "idempotency: lease lost for key %s; this attempt was rolled back",
            keys.log_key(ctx.record_key),
        )
        return _error_response(LeaseLost(retry_after=state.settings.retry_after))
    except StoreUnavailableError as exc:
        log.error(
            "idempotency: completion failed for key %s: %s", keys.log_key(ctx.record_key), exc
        )
        state.metrics.inc("store_unavailable")
        tx.release(ctx.record_key, token)
        return _error_response(StoreUnavailable(retry_after=state.settings.retry_after))
    state.metrics.inc("completed")
    if state.settings.redis_fill == "completion":
        # (With "replay" the copy is made by the first replay from PostgreSQL.)
        remaining = ctx.ttl - (time.monotonic() - ctx.claimed_at)
        state.cache.put(ctx.record_key, ctx.fingerprint, stored, remaining)
    response.headers[responses.REPLAYED_HEADER] = "false"
    return response


def _error_response(error: IdempotencyError) -> Response:
    """Render one of our errors from ``after_request``, where raising is too late."""
    return Response(error.get_body(), error.code, error.get_headers())


def _teardown_request(exc: BaseException | None) -> None:
    ctx: RequestState | None = g.pop("_idempotency", None)
    if ctx is None or ctx.tx is None:
        return
    if ctx.token is not None and not ctx.settled:
        # The view raised past Flask's handlers (or after_request failed): nothing
        # is stored, so a retry runs again.
        ctx.settled = True
        ctx.state.keeper.drop(ctx.record_key, ctx.token)
        ctx.state.metrics.inc("released")
        ctx.tx.release(ctx.record_key, ctx.token)
    ctx.tx.close()
