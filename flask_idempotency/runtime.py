"""The request runtime: one decorated view's claim, run and settlement.

The decorator (``decorators.py``) hands each call to :func:`run_view`, which
claims the key (after the route's own authentication, which wraps it) and runs
the view; :func:`after_request` settles the claim (completes or releases it)
once the final response exists; :func:`teardown_request` closes the attempt,
so the claim and the connection are given back even when something raised.
The attempt itself (claim, completion, release, close) is the engine's
:class:`~.engine.Attempt`, which the completer and the consumer guard share.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NoReturn

from flask import Flask, Request, Response, current_app, request
from werkzeug.exceptions import HTTPException

from . import digests, flow, keys, recovery, responses
from .engine import Attempt, bind, current_attempt, unbind
from .errors import (
    DRILL_FAIL_AFTER_VIEW,
    DRILL_HEADER,
    DrillFailure,
    IdempotencyError,
    KeyReused,
    LeaseLost,
    MissingKey,
    RequestInProgress,
    ResponseNotStorable,
    ResponseTooLarge,
    SchemaMissing,
    StoreUnavailable,
    from_store_error,
    refused_as_data,
)
from .observer import RequestOutcome, Stage
from .request_body import read_body
from .route_options import RouteOptions
from .state import app_state
from .store.base import (
    Existing,
    LeaseLostError,
    SchemaMismatchError,
    StoredResponse,
    StoreUnavailableError,
)

#: Methods that are idempotent already: the layer lets them through, key or not.
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})


def run_view(
    options: RouteOptions, view: Callable[..., Any], is_async: bool, args: Any, kwargs: Any
) -> Any:
    # Resolved once: every attribute read through Flask's proxies costs a context
    # lookup, and the hot path reads the request about twenty times.
    app: Flask = current_app._get_current_object()  # type: ignore[attr-defined]
    # The view as WSGI calls it: an ``async def`` one through Flask's ``ensure_sync``.
    call = app.ensure_sync(view) if is_async else view
    if current_attempt() is not None:
        # A decorated view called from another one: the outer view's claim (or its
        # keyless transaction) already covers this request. A second claim of the
        # same key would answer 409 inside the outer view and wedge its record.
        return call(*args, **kwargs)
    started = time.monotonic()
    req: Request = request._get_current_object()  # type: ignore[attr-defined]
    state = app_state(app)
    settings = state.settings
    route = state.options_for(options)
    key = None
    try:
        # GET and its kin are idempotent already: a key on them is ignored (the IETF
        # draft's section 1), even on a route that requires one for POST.
        if req.method not in SAFE_METHODS:
            key = keys.parse_key(req.environ.get(settings.key_environ_name))
            if key is None and options.required:
                raise MissingKey()
        if key is not None:
            scope = keys.resolve_scope(route.scope_func, req)
            read_body(req)
    except HTTPException as exc:  # invalid_key, missing_key, missing_scope, malformed_body, 413
        state.metrics.refused(exc)
        raise
    if key is None:
        keyless = bind(Attempt(state, None, b"", route, started=started, request=req))
        return _call_view(keyless, call, args, kwargs)
    record_key = digests.record_key(scope, key)
    fingerprint = route.fingerprint_func(req)
    attempt = bind(
        Attempt(state, record_key, fingerprint, route, started=started, scope=scope, request=req)
    )

    cached = state.cache.get(record_key)
    if cached is not None:
        decision = flow.decide(
            Existing("completed", cached.fingerprint, cached.response), fingerprint
        )
        if isinstance(decision, flow.Replay):
            return _replay(attempt, decision.response, "cache")
        assert isinstance(decision, flow.Rejection)  # (a cached record is never claimed)
        _refuse(attempt, decision, None)

    try:
        state.migrate_if_pending()
        state.store.schema.ensure()  # a missing schema: refused before any claim
    except StoreUnavailableError as exc:
        raise refusal(attempt, exc) from exc
    kept = None
    if options.recover is not None and settings.claim_mode == "row":
        kept = recovery.capture(options, req)  # written by the claim itself
    decision, existing = _claim(attempt, kept)
    deadline = time.monotonic() + route.wait
    while decision is flow.Rejection.IN_PROGRESS and time.monotonic() < deadline:
        # A waiting duplicate gives its connection back while it sleeps: otherwise
        # a few waiters would hold every pool slot the running requests need.
        attempt.close()
        time.sleep(settings.wait_poll_interval)
        decision, existing = _claim(attempt, kept)

    if isinstance(decision, flow.Proceed):
        state.metrics.claimed(attempt)
        return _call_view(attempt, call, args, kwargs)

    attempt.close()
    if isinstance(decision, flow.Replay):
        if existing is not None and existing.ttl_remaining:
            # PostgreSQL measured the remainder when the claim ran; the copy must
            # not outlive the record by the time that has passed since.
            remaining = existing.ttl_remaining - (time.monotonic() - attempt.claimed_at)
            state.cache.put(record_key, fingerprint, decision.response, remaining)
        return _replay(attempt, decision.response, "store")
    _refuse(attempt, decision, existing)


def _refuse(attempt: Attempt, decision: flow.Rejection, existing: Existing | None) -> NoReturn:
    """A ``422`` (another request under the key) or a ``409`` (still running)."""
    if decision is flow.Rejection.KEY_REUSED:
        record(attempt, RequestOutcome.KEY_REUSED, status=KeyReused.code)
        raise KeyReused()
    record(attempt, RequestOutcome.IN_PROGRESS, status=RequestInProgress.code)
    lease_remaining = existing.lease_remaining if existing is not None else None
    retry_after = attempt.app_state.settings.retry_after
    raise RequestInProgress(retry_after=flow.retry_after_seconds(retry_after, lease_remaining))


def _call_view(attempt: Attempt, view: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    """Run the (synchronous) view; if it raises, nothing of the attempt is kept,
    whatever answer an error handler later renders for the exception (a 402
    included)."""
    try:
        return view(*args, **kwargs)
    except BaseException as exc:
        attempt.raised = True
        attempt.own_error = isinstance(exc, IdempotencyError)
        if isinstance(exc, (StoreUnavailable, LeaseLost, SchemaMissing)):  # else released
            record(attempt, RequestOutcome(exc.error_code), status=exc.code, error=exc.__cause__)
        _release(attempt)
        raise


def _claim(attempt: Attempt, kept: bytes | None) -> tuple[flow.Decision, Existing | None]:
    """The attempt's claim, timed for the observers; a store failure is a 503."""
    with attempt.app_state.metrics.stage(Stage.CLAIM, attempt) as stage:
        try:
            decision, existing = attempt.claim(recovery=kept)
        except StoreUnavailableError as exc:
            raise refusal(attempt, exc, observed=True) from exc
        stage.decided(decision, attempt.takeover)
    return decision, existing


def refusal(
    attempt: Attempt, exc: StoreUnavailableError, *, observed: bool = False
) -> IdempotencyError:
    """The answer to a store failure, recorded: a schema the database lacks is
    named (``500 schema_missing`` / ``schema_outdated``, no ``Retry-After``),
    anything else is an outage (``503 store_unavailable``). ``observed``: a
    statement of this request found the schema wanting (rather than the store's
    guard, which knew already), so the store refuses the next ones from memory."""
    if observed and isinstance(exc, SchemaMismatchError):
        attempt.app_state.store.schema.failed(exc)
    error = from_store_error(exc, attempt.app_state.settings.retry_after)
    record(attempt, RequestOutcome(error.error_code), status=error.code, error=exc)
    return error


def record(attempt: Attempt, outcome: RequestOutcome, **details: Any) -> None:
    """The request's outcome, once: counted, logged and handed to the app's
    observers (``metrics.Metrics.record``, whose ``source``, ``status`` and
    ``error`` keywords ``details`` are). Later calls for the same request (a
    release after a failed completion, the teardown's fallback) are ignored."""
    if attempt.outcome is None:
        attempt.outcome = outcome
        attempt.app_state.metrics.record(attempt, outcome, **details)


def _unsettled_outcome(attempt: Attempt) -> RequestOutcome:
    """The outcome of a request no claim settled: with no key to deduplicate, a safe
    method or an optional route called without one; with a key, released."""
    if attempt.record_key is not None:
        return RequestOutcome.RELEASED
    return RequestOutcome.SAFE_METHOD if request.method in SAFE_METHODS else RequestOutcome.KEYLESS


def _replay(attempt: Attempt, stored: StoredResponse, source: str) -> Response:
    """Answer with a stored response, from the cache or the store."""
    attempt.settled = True
    state = attempt.app_state
    with state.metrics.stage(Stage.REPLAY, attempt, source=source, status=stored.status):
        answer = responses.replay(stored, state.profile, state.settings.not_replayed_headers)
    record(attempt, RequestOutcome.REPLAYED, source=source, status=stored.status)
    return answer


def _release(attempt: Attempt, status: int | None = None) -> None:
    """Release the attempt (``Attempt.release``), its outcome recorded."""
    if attempt.release():
        record(attempt, RequestOutcome.RELEASED, status=status)


def after_request(response: Response) -> Response:
    """Settle the attempt once its final response exists (complete or release)."""
    attempt = current_attempt()
    if attempt is None:
        return response
    response = _settle(attempt, response)
    settings = attempt.app_state.settings
    if attempt.record_key is not None and attempt.app_state.profile.stripe:
        responses.echo_key(
            response, settings.key_header, request.environ[settings.key_environ_name]
        )
    if settings.expose_headers:
        responses.expose_headers(response, settings.key_header)
    return response


def _settle(attempt: Attempt, response: Response) -> Response:
    if attempt.raised:
        # Released when the view raised; this is an error handler's rendering.
        if not attempt.own_error and attempt.record_key is not None:
            responses.mark_original(response, attempt.app_state.profile)
        return response
    if attempt.settled or (attempt.record_key is not None and attempt.token is None):
        # Settled: a replay (it carries its header from responses.replay()), or the
        # hooks' second run after one failed. No token: a refusal, nothing claimed.
        return response
    if attempt.record_key is None:
        response = _settle_keyless(attempt, response)
        record(attempt, _unsettled_outcome(attempt), status=response.status_code)
        return response
    return _settle_claim(attempt, response)


def _settle_keyless(attempt: Attempt, response: Response) -> Response:
    """An ``optional`` route without a key: commit the view's transaction when its
    answer is one that would have been stored, roll it back otherwise."""
    if not attempt.route.should_store(response.status_code):
        attempt.release()
        return response
    try:
        attempt.commit()
    except StoreUnavailableError as exc:
        return _error_response(refusal(attempt, exc))
    return response


def _settle_claim(attempt: Attempt, response: Response) -> Response:
    state, req = attempt.app_state, attempt.request
    assert attempt.record_key is not None and req is not None
    try:
        settlement, stored = attempt.capture(response)
    except BaseException:
        # A streamed body that failed while it was read: as if the view raised.
        attempt.raised = True
        _release(attempt)
        raise
    if settlement is flow.Settlement.RELEASE:
        _release(attempt, status=response.status_code)
        responses.mark_original(response, state.profile)  # (the view returned it: not ours)
        return response
    if settlement is flow.Settlement.TOO_LARGE or stored is None:
        return _not_stored(attempt, response, ResponseTooLarge())
    stored = responses.answer_only(stored, state.settings.not_replayed_headers)
    if not responses.storable(stored):
        return _not_stored(attempt, response, ResponseNotStorable())

    if state.settings.testing_drills and req.headers.get(DRILL_HEADER) == DRILL_FAIL_AFTER_VIEW:
        # ``assert_idempotent``'s atomicity drill asks this attempt to fail now.
        _release(attempt, status=DrillFailure.code)
        return _error_response(DrillFailure(retry_after=state.settings.retry_after))
    try:
        with state.metrics.stage(Stage.COMPLETE, attempt, status=stored.status):
            attempt.complete(stored)
    except LeaseLostError:
        record(attempt, RequestOutcome.LEASE_LOST, status=LeaseLost.code)
        return _error_response(LeaseLost(retry_after=state.settings.retry_after))
    except StoreUnavailableError as exc:
        if refused_as_data(exc):  # what storable() did not foresee: rolled back, released
            return _not_stored(attempt, response, ResponseNotStorable())
        return _error_response(refusal(attempt, exc, observed=True))
    record(attempt, RequestOutcome.EXECUTED, status=stored.status)
    if state.settings.redis_fill == "completion":
        # (With "replay" the copy is made by the first replay from PostgreSQL.)
        remaining = attempt.route.ttl - (time.monotonic() - attempt.claimed_at)
        state.cache.put(attempt.record_key, attempt.fingerprint, stored, remaining)
    responses.mark_original(response, state.profile)
    return response


def _not_stored(attempt: Attempt, response: Response, error: IdempotencyError) -> Response:
    """An answer that would be stored but cannot be: rolled back, released, a 500."""
    record(attempt, RequestOutcome.NOT_STORABLE, status=error.code, error=error)
    attempt.release()
    response.close()
    return _error_response(error)


def _error_response(error: IdempotencyError) -> Response:
    """Render one of our errors from ``after_request``, where raising is too late."""
    return Response(error.get_body(), error.code, error.get_headers())


def teardown_request(exc: BaseException | None) -> None:
    """Give the claim and the connection back, whatever raised on the way."""
    attempt = unbind()
    if attempt is None:
        return
    # Unsettled (a no-op otherwise): the view raised past Flask's handlers, or
    # after_request failed: nothing is stored, so a retry runs again.
    _release(attempt)
    attempt.close()
    # A pass-through, or an answer no settlement saw (``record`` keeps the first).
    record(attempt, _unsettled_outcome(attempt))
