"""One attempt at a record: begin, claim, run, settle, close.

A decorated view (``runtime.py``), a recovered record (``completer.py``) and a
consumed message (``events/consumer.py``, and through it a Celery task) are
callers of one :class:`Attempt`, the way rocket-rides-atomic's API, completer
and workers all go through ``atomic_phase``:

1. :meth:`Attempt.claim` takes the record under a lease (the keeper renews it
   while the attempt runs), or says who has it; the attempt's handle on the
   store is begun on first use, and with ``db=`` the application's session
   joins the attempt's transaction;
2. the caller runs its work with the attempt bound to the context
   (:func:`bound`), so ``idempotency.connection()``, ``emit()`` and
   ``phase()`` write on the attempt's transaction;
3. the attempt is settled: :meth:`Attempt.complete` stores the answer in that
   transaction, fenced by the lock token (``LeaseLostError`` once taken over),
   or :meth:`Attempt.release` gives the claim up so a retry runs again;
4. :meth:`Attempt.close` (or leaving the ``with`` block) ends it: what was not
   committed is rolled back, the session is the application's again, the
   connection goes back to the pool and the lease is no longer renewed.

What each caller does with the outcome (an HTTP answer, a recovery outcome, an
ack) is its own; the order of the store calls, the keeper and the session, and
the fencing rules, are here. The attempt bound to the current context lives in
Flask's ``g`` (this module is the only place that spells it).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, cast

from flask import Request, Response, g

from . import flow, responses
from .state import AppState, JoinedSession
from .store.base import Claimed, Existing, LeaseHold, StoredResponse, StoreUnavailableError

if TYPE_CHECKING:
    from .observer import RequestOutcome
    from .route_options import EffectiveOptions
    from .store.memory import MemoryRequest
    from .store.request import PostgresRequest

#: ``g`` attribute of the current context's :class:`Attempt`.
_ATTRIBUTE = "_idempotency"


@dataclasses.dataclass(eq=False)
class Attempt:
    """One attempt at a record, from its claim to its settlement: a view's request,
    a recovered record (the completer) or a consumed message."""

    app_state: AppState
    #: ``None`` on an ``optional`` route called without a key: the view still gets
    #: ``connection()``, in an ordinary transaction settled by the same rule.
    record_key: bytes | None
    fingerprint: bytes
    route: EffectiveOptions
    #: The attempt's handle on the store (its connection), begun on first use.
    handle: PostgresRequest | MemoryRequest | None = None
    token: int | None = None
    claimed_at: float = 0.0
    #: Completed, released or answered from a stored response: nothing more to do
    #: but close.
    settled: bool = False
    #: The view raised (whatever an error handler then rendered): released, never stored.
    raised: bool = False
    #: The view ended in one of our errors (the store failed under it, its lease was
    #: lost): released like any unstored answer, but without ``Idempotent-Replayed``.
    own_error: bool = False
    #: Recovery points committed for this record, by name: an earlier holder's
    #: (taken over) and this attempt's own (``phases.py``).
    phases: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: Names of the phases this attempt has reached (each may appear once).
    phases_reached: set[str] = dataclasses.field(default_factory=set)
    #: Purposes this attempt has given downstream calls (``client.purpose_key``).
    purposes: set[str] = dataclasses.field(default_factory=set)
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
    #: Set once: every request reports exactly one outcome (``runtime.record``).
    outcome: RequestOutcome | None = None
    #: The attempt's joined ``db.session``, with ``db=``.
    session: JoinedSession | None = None

    def __enter__(self) -> Attempt:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def begin(self) -> PostgresRequest | MemoryRequest:
        """The attempt's handle on the store, begun now if it was not yet."""
        if self.handle is None:
            self.handle = self.app_state.store.begin()
        return self.handle

    def claim(self, *, recovery: bytes | None = None) -> tuple[flow.Decision, Existing | None]:
        """Claim the record and decide; on ``Proceed`` the attempt holds the token,
        its lease is renewed from now on and the session (``db=``) has joined.
        ``recovery`` is what a ``recover=`` route keeps with a row-mode claim.

        Raises ``StoreUnavailableError`` when PostgreSQL fails (nothing was claimed).
        """
        assert self.record_key is not None
        handle = self.begin()
        sessions = self.app_state.sessions
        if sessions is not None:
            sessions.detach()  # one pool connection per request, never two
        started = time.monotonic()
        try:
            result = handle.claim(
                self.record_key,
                self.fingerprint,
                lease=self.route.lease,
                ttl=self.route.ttl,
                recovery=recovery,
            )
        finally:
            self.claim_seconds += time.monotonic() - started
        self.claimed_at = started
        decision = flow.decide(result, self.fingerprint)
        self.takeover = isinstance(result, Claimed) and result.takeover
        if isinstance(decision, flow.Proceed):
            if handle.holds_lease:
                lease = LeaseHold(self.record_key, decision.token, self.route.lease)
                self.app_state.keeper.hold(lease)
            self.adopt(decision.token, dict(decision.phases))
        return decision, result if isinstance(result, Existing) else None

    def adopt(self, token: int, phases: dict[str, Any]) -> None:
        """The attempt holds its record under ``token``, resuming after ``phases``
        (a dead holder's recovery points): won by :meth:`claim`, or taken over by
        the completer (whose keeper hold is its own); the session joins it."""
        self.token = token
        self.phases = phases
        self.begin().has_progress = bool(phases)
        sessions = self.app_state.sessions
        if sessions is not None:
            self.session = sessions.join(cast("PostgresRequest", self.begin()))  # (db=: PostgreSQL)

    def connection(self) -> Any:
        """The connection, in the attempt's transaction (opened now if it is not)."""
        return self.begin().connection()

    def capture(self, response: Response) -> tuple[flow.Settlement, StoredResponse | None]:
        """What a finished answer means for the record (store it, release the claim,
        or neither: too large to store), and the answer as it would be stored.
        An answer that is not kept (a 5xx, a validation 400) is released unread,
        whatever its size; reading a streamed body may raise."""
        if not self.route.should_store(response.status_code):
            return flow.Settlement.RELEASE, None
        settings = self.app_state.settings
        try:
            stored = responses.capture(
                response, settings.max_stored_body, omit_oversize=self.route.oversize == "omit_body"
            )
        except responses.NotStorable:
            return flow.Settlement.TOO_LARGE, None
        return flow.Settlement.COMPLETE, stored

    def checkpoint(self, phase: str, data_json: str) -> None:
        """Commit the attempt's writes so far with the recovery point ``phase``, the
        session's with them; ``LeaseLostError`` once taken over. Only a claim that
        is a row (row mode) keeps recovery points: otherwise all commits at the end."""
        handle, record_key, token = self.handle, self.record_key, self.token
        if handle is None or record_key is None or token is None or not handle.holds_lease:
            return
        if self.session is not None:
            self.session.keep()
        handle.checkpoint(record_key, token, phase, data_json)

    def complete(self, stored: StoredResponse, *, recovered: bool = False) -> None:
        """Store ``stored`` in the attempt's transaction, fenced by its token;
        ``recovered``: the completer's, counted in the same transaction.

        Raises what the session's flush raises (nothing is settled then), then
        ``LeaseLostError`` when the record was taken over after our lease ran out
        (our transaction was rolled back: nothing of it is kept), and
        ``StoreUnavailableError`` when PostgreSQL failed (the claim was released,
        best effort, so a retry runs again; a recovered one is kept for the
        completer's next pass).
        """
        assert self.handle is not None and self.record_key is not None and self.token is not None
        if self.session is not None:  # before anything is settled: a failed flush is the work's
            self.session.keep()
        self.settled = True
        self.app_state.keeper.drop(self.record_key, self.token)
        started = time.monotonic()
        try:
            if recovered:
                self.handle.count_recovered()
            self.handle.complete(self.record_key, self.token, stored)
        except StoreUnavailableError:
            if not recovered:
                self.handle.release(self.record_key, self.token)
            raise
        finally:
            self.completion_seconds = time.monotonic() - started
            self._leave_session()

    def commit(self) -> None:
        """Commit a keyless attempt's transaction (an ``optional`` route without a key)."""
        assert self.record_key is None
        self.settled = True
        if self.handle is not None:
            self.handle.commit()

    def release(self) -> bool:
        """Roll the attempt back and give up its claim (a keyless attempt: just roll
        back), once. True if this call released a claim."""
        if self.settled:
            return False
        self.settled = True
        if self.handle is None:
            return False
        if self.session is not None:
            self.session.discard()  # before the server's transaction ends
        try:
            if self.record_key is None or self.token is None:
                self.handle.rollback()
                return False
            self.app_state.keeper.drop(self.record_key, self.token)
            self.handle.release(self.record_key, self.token)
            return True
        finally:
            self._leave_session()

    def close(self) -> None:
        """End the attempt: what it did not commit is rolled back, the session is
        the application's again, the connection goes back to the pool, and its
        lease is no longer renewed (unsettled, the claim lapses with it)."""
        if self.record_key is not None and self.token is not None:
            self.app_state.keeper.drop(self.record_key, self.token)
        self._leave_session()
        if self.handle is not None:
            self.handle.close()

    def _leave_session(self) -> None:
        """The session's work in the attempt is rolled back unless kept, and the
        session is the application's again."""
        joined, self.session = self.session, None
        if joined is not None:
            joined.leave()


def current_attempt() -> Attempt | None:
    """The attempt bound to the current context, if any."""
    return cast("Attempt | None", g.get(_ATTRIBUTE))


def bind(attempt: Attempt) -> Attempt:
    """Make ``attempt`` the current context's (``connection()``, ``emit()``...)."""
    setattr(g, _ATTRIBUTE, attempt)
    return attempt


def unbind() -> Attempt | None:
    """Take the current context's attempt off it (so no hook settles it again)."""
    return cast("Attempt | None", g.pop(_ATTRIBUTE, None))


@contextmanager
def bound(attempt: Attempt) -> Iterator[Attempt]:
    """``attempt`` bound for the block, and unbound after it whatever happens: the
    request's own hooks must not settle an attempt its caller settles."""
    bind(attempt)
    try:
        yield attempt
    finally:
        unbind()
