"""Claim, run, settle: the one engine every attempt goes through.

A decorated view (``runtime.py``), a recovered record (``completer.py``) and a
consumed message (``events/consumer.py``) are three callers of the same steps,
the way rocket-rides-atomic's API, completer and workers all go through
``atomic_phase``:

1. :func:`claim` the record under the attempt's lease (the keeper renews it
   while the attempt runs), or learn who has it;
2. the caller runs its work with the attempt bound (``state.bound``), so
   ``idempotency.connection()``, ``emit()`` and ``phase()`` write on the
   attempt's transaction;
3. :func:`settle` decides what a finished answer means, then :func:`complete`
   stores it in that transaction, fenced by the lock token (``LeaseLostError``
   once taken over), or :func:`release` gives the claim up so a retry runs
   again.

What each caller does with the outcome (an HTTP answer, a recovery outcome, an
ack) is its own; the store calls, the keeper and the fencing rules are here.
"""

from __future__ import annotations

import time

from flask import Response

from . import flow, responses
from .state import RequestState
from .store.base import Claimed, Existing, LeaseHold, StoredResponse, StoreUnavailableError


def claim(
    ctx: RequestState, lease: float, *, recovery: bytes | None = None
) -> tuple[flow.Decision, Existing | None]:
    """Claim ``ctx``'s record on its transaction and decide; on ``Proceed`` the
    attempt holds the token (and its lease is renewed from now on).

    Raises ``StoreUnavailableError`` when PostgreSQL fails (nothing was claimed).
    """
    assert ctx.tx is not None and ctx.record_key is not None
    if ctx.state.sessions is not None:
        ctx.state.sessions.detach()  # one pool connection per request, never two
    started = time.monotonic()
    try:
        result = ctx.tx.claim(
            ctx.record_key, ctx.fingerprint, lease=lease, ttl=ctx.route.ttl, recovery=recovery
        )
    finally:
        ctx.claim_seconds += time.monotonic() - started
    ctx.claimed_at = started
    decision = flow.decide(result, ctx.fingerprint)
    ctx.takeover = isinstance(result, Claimed) and result.takeover
    if isinstance(decision, flow.Proceed):
        hold(ctx, decision.token, lease)
        if decision.phases:
            ctx.phases = dict(decision.phases)  # a dead holder's recovery points: resumed
        join_session(ctx)
    return decision, result if isinstance(result, Existing) else None


def join_session(ctx: RequestState) -> None:
    """With ``db=``: the application's session works on the attempt's transaction
    from now until the attempt is settled."""
    sessions = ctx.state.sessions
    if sessions is not None:
        sessions.join(ctx)


def keep_session(ctx: RequestState) -> None:
    """Flush the joined session into the attempt's transaction (before the answer
    is stored, or a recovery point commits). Raises what the flush raises."""
    sessions = ctx.state.sessions
    if sessions is not None:
        sessions.keep(ctx)


def checkpoint_session(ctx: RequestState) -> None:
    """A recovery point is about to commit: the joined session's writes go with it."""
    sessions = ctx.state.sessions
    if sessions is not None:
        sessions.before_checkpoint(ctx)


def leave_session(ctx: RequestState) -> None:
    """The attempt's transaction is over: the session is the application's again."""
    sessions = ctx.state.sessions
    if sessions is not None:
        sessions.leave(ctx)


def hold(ctx: RequestState, token: int, lease: float) -> None:
    """The attempt owns its record under ``token``: keep its lease alive."""
    assert ctx.tx is not None and ctx.record_key is not None
    ctx.token = token
    if ctx.tx.holds_lease:
        ctx.state.keeper.hold(LeaseHold(ctx.record_key, token, lease))


def settle(ctx: RequestState, response: Response) -> tuple[flow.Settlement, StoredResponse | None]:
    """What a finished answer means for the record: store it, release the claim,
    or neither (too large to store). Reading a streamed body may raise."""
    settings = ctx.state.settings
    try:
        stored = responses.capture(
            response, settings.max_stored_body, omit_oversize=ctx.route.oversize == "omit_body"
        )
    except responses.NotStorable:
        return flow.Settlement.TOO_LARGE, None
    settlement = flow.settle(
        stored.status, len(stored.body), ctx.route.should_store, settings.max_stored_body
    )
    return settlement, stored


def complete(ctx: RequestState, stored: StoredResponse, *, release_on_failure: bool = True) -> None:
    """Store ``stored`` in the attempt's transaction, fenced by its token.

    Raises ``LeaseLostError`` when the record was taken over after our lease ran
    out (our transaction was rolled back: nothing of it is kept), and
    ``StoreUnavailableError`` when PostgreSQL failed (the claim was released, best
    effort, so a retry runs again; the completer keeps it for its next pass).
    """
    assert ctx.tx is not None and ctx.record_key is not None and ctx.token is not None
    keep_session(ctx)  # before anything is settled: a failed flush is the view's failure
    ctx.settled = True
    ctx.state.keeper.drop(ctx.record_key, ctx.token)
    started = time.monotonic()
    try:
        ctx.tx.complete(ctx.record_key, ctx.token, stored)
    except StoreUnavailableError:
        if release_on_failure:
            ctx.tx.release(ctx.record_key, ctx.token)
        raise
    finally:
        ctx.completion_seconds = time.monotonic() - started
        leave_session(ctx)


def roll_back(ctx: RequestState) -> None:
    """Discard the attempt's writes but keep its claim (the caller settles it)."""
    sessions = ctx.state.sessions
    if sessions is not None:
        sessions.discard(ctx)
        sessions.leave(ctx)
    if ctx.tx is not None:
        ctx.tx.rollback()


def release(ctx: RequestState) -> bool:
    """Roll the attempt back and give up its claim (a keyless request: just roll
    back), once. True if this call released a claim."""
    if ctx.settled:
        return False
    ctx.settled = True
    if ctx.tx is None:
        return False
    sessions = ctx.state.sessions
    if sessions is not None:
        sessions.discard(ctx)
    try:
        if ctx.record_key is None or ctx.token is None:
            ctx.tx.rollback()
            return False
        ctx.state.keeper.drop(ctx.record_key, ctx.token)
        ctx.tx.release(ctx.record_key, ctx.token)
        return True
    finally:
        leave_session(ctx)
