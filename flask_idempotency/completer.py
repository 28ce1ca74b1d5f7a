"""The completer: finish attempts whose holder died, without waiting for a client.

A worker that dies after a payment processor charged but before its commit
leaves a ``processing`` record and no business row. A retry would take the
record over and the processor would replay the payment; when no retry ever
comes (a phone that lost signal, a batch job that crashed), this module is
what records it. It is the completer of Brandur Leach's rocket-rides-atomic
and of Stripe's idempotency design:

* a route declares ``recover=f`` (and, if its recovery needs more than the
  request, ``recovery_data=g``); the claim of such a route stores the request
  and ``g(request)`` with the record, in the claim statement itself
  (``recovery.capture``), and the completion drops them;
* ``flask idempotency recover`` (:class:`Recoverer`) takes abandoned records
  over a batch at a time (``FOR UPDATE SKIP LOCKED``, then a new lock token and
  lease, committed at once), and for each runs ``f`` in a request context
  rebuilt from the stored request, with ``idempotency.connection()``,
  ``derived_key()``, ``emit()`` and ``phase()`` bound to the record as in the
  view, under the new token;
* what ``f`` returns settles the record: an answer to store is stored in the
  transaction that holds ``f``'s writes (``idempotency_complete``, fenced by the
  token); ``None`` ("nothing happened") releases it, so a later retry runs
  afresh; a 5xx or an exception means "cannot tell yet": the record is handed
  back, abandoned again, for the next run.

Fencing makes races harmless: a client's retry that took the record first
leaves it out of the batch (its lease is live); one that comes after the
takeover gets ``409`` and then the recovered answer; a second completer skips
locked rows and re-checks the lease under the row lock; and a completer that
stalls past its own lease has its completion refused like any old holder's.

Recovery needs row mode: under ``IDEMPOTENCY_CLAIM_MODE = "transaction"`` a
dead attempt leaves no record, so the command refuses to run.
"""

from __future__ import annotations

import collections
import enum
import logging
import threading
from collections.abc import Callable, Mapping

from flask import Flask
from werkzeug.exceptions import HTTPException

from . import digests, flow
from .engine import Attempt, bound
from .errors import LeaseLost
from .recovery import Abandoned, recoverable_routes
from .route_options import RecoverFunc
from .state import app_state
from .store.base import LeaseHold, LeaseLostError, StoreUnavailableError, Taken
from .store.errors import store_failure
from .store.heartbeat import Heartbeat

log = logging.getLogger("flask_idempotency.recovery")

#: A record whose lease ended less than this many seconds ago is left to its
#: client for a while: a retry usually comes within seconds, and it replays the
#: processor's answer itself, with no lookup. ``--older-than`` changes it.
DEFAULT_OLDER_THAN = 60.0
#: Records taken over per statement. Each waits its turn with a live lease (the
#: keeper renews it), during which a retry of it gets ``409``: keep it small.
DEFAULT_BATCH_SIZE = 20
#: Seconds between passes when the command runs as a loop.
DEFAULT_INTERVAL = 10.0


class RecoveryOutcome(enum.Enum):
    RECOVERED = "recovered"  # the answer is stored, with the recovery's writes
    RELEASED = "released"  # nothing happened: a later retry runs afresh
    DEFERRED = "deferred"  # cannot tell yet: abandoned again for the next pass
    FENCED = "fenced"  # someone else holds the record now: nothing of ours kept
    SKIPPED = "skipped"  # no route of this app can recover it (handed back)


class Recoverer:
    """Runs the routes' ``recover=`` functions over abandoned records of one app."""

    def __init__(
        self,
        app: Flask,
        *,
        older_than: float = DEFAULT_OLDER_THAN,
        batch_size: int = DEFAULT_BATCH_SIZE,
    ) -> None:
        self.app = app
        self.state = app_state(app)
        self.store = self.state.postgres_store("recovering abandoned attempts")
        if self.state.settings.claim_mode != "row":
            raise RuntimeError(
                "recovery needs IDEMPOTENCY_CLAIM_MODE = 'row': under "
                f"{self.state.settings.claim_mode!r} a dead attempt leaves no record to recover"
            )
        self.routes = recoverable_routes(app)
        self.older_than = older_than
        self.batch_size = batch_size
        self.lease = self.state.settings.lease
        #: Every outcome so far, over all passes.
        self.totals: collections.Counter[RecoveryOutcome] = collections.Counter()
        #: "The completer ran": what ``flask idempotency doctor`` reads to say it is alive.
        self.heartbeat = Heartbeat(self.state.store, "completer")

    def run(
        self,
        stop: threading.Event,
        *,
        once: bool = False,
        interval: float = DEFAULT_INTERVAL,
        on_outcome: Callable[[RecoveryOutcome], None] | None = None,
    ) -> collections.Counter[RecoveryOutcome]:
        """Passes until ``stop`` is set (or one, with ``once``). An outage ends a
        ``once`` run with ``StoreUnavailableError``; a loop logs it and waits.
        ``on_outcome`` is told each record's outcome (the CLI's progress)."""
        while True:
            try:
                outcomes = self.run_pass(stop, on_outcome)
            except StoreUnavailableError as exc:
                if once:
                    raise
                level, what = store_failure(exc)
                log.log(level, "idempotency recover: %s: %s", what, exc)
            else:
                self.heartbeat.beat()
                if outcomes and not once:
                    log.info("idempotency recover: %s", describe(outcomes))
            if once or stop.wait(interval):
                return self.totals

    def run_pass(
        self,
        stop: threading.Event | None = None,
        on_outcome: Callable[[RecoveryOutcome], None] | None = None,
    ) -> collections.Counter[RecoveryOutcome]:
        """Recover every record abandoned before the pass began; a record handed
        back during the pass waits for the next one."""
        outcomes: collections.Counter[RecoveryOutcome] = collections.Counter()
        cutoff = self.store.recovery_cutoff(self.older_than)
        while stop is None or not stop.is_set():
            batch = self.store.take_over(cutoff, self.batch_size, self.lease)
            for item in batch:  # each waits its turn with a live lease
                self.state.keeper.hold(LeaseHold(item.record_key, item.token, self.lease))
            for index, taken in enumerate(batch):
                if stop is not None and stop.is_set():
                    # Interrupted: the rest are abandoned again, for the next run.
                    for rest in batch[index:]:
                        self._hand_back(rest)
                    break
                outcome = self.recover(taken)
                outcomes[outcome] += 1
                self.totals[outcome] += 1
                if on_outcome is not None:
                    on_outcome(outcome)
            if len(batch) < self.batch_size:
                break
        return outcomes

    def recover(self, taken: Taken) -> RecoveryOutcome:
        """Run the route's recovery for one record we took over; settle it."""
        label = digests.log_key(taken.record_key)
        try:
            return self._recover(taken, label)
        except StoreUnavailableError as exc:
            level, what = store_failure(exc)
            log.log(level, "idempotency recover: %s for key %s: %s", what, label, exc)
            return RecoveryOutcome.DEFERRED
        finally:
            self.state.keeper.drop(taken.record_key, taken.token)

    def _recover(self, taken: Taken, label: str) -> RecoveryOutcome:
        try:
            abandoned = Abandoned.from_payload(
                taken.recovery, taken.record_key, dict(taken.phases), taken.abandoned_seconds
            )
        except ValueError as exc:
            log.error("idempotency recover: key %s: %s; handed back", label, exc)
            return self._hand_back(taken, RecoveryOutcome.SKIPPED)
        options = self.routes.get(abandoned.endpoint)
        if options is None or options.recover is None:
            log.error(
                "idempotency recover: key %s: endpoint %r declares no recover= in this app; "
                "handed back",
                label,
                abandoned.endpoint,
            )
            return self._hand_back(taken, RecoveryOutcome.SKIPPED)
        route = self.state.options_for(options)
        # A fresh app context and the rebuilt request, the record held as the view
        # held it: connection(), emit() and phase() work.
        with self.app.app_context(), self.app.request_context(abandoned.environ()):
            with Attempt(self.state, taken.record_key, taken.fingerprint, route) as attempt:
                attempt.adopt(taken.token, dict(taken.phases))  # phase() adds to them
                outcome = self._run(attempt, abandoned, options.recover, label)
        # Closed: what the recovery did not complete is rolled back.
        if outcome is RecoveryOutcome.DEFERRED:
            return self._hand_back(taken)
        if outcome is RecoveryOutcome.RELEASED:
            keep = bool(taken.phases)  # their writes stand: kept for a retry to resume
            if not self.store.release_abandoned(taken.record_key, taken.token, keep_phases=keep):
                return RecoveryOutcome.FENCED
            log.info("idempotency recover: key %s released", label)
        return outcome

    def _run(
        self, attempt: Attempt, abandoned: Abandoned, recover: RecoverFunc, label: str
    ) -> RecoveryOutcome:
        """Run ``recover`` with the attempt bound, and complete the record with its
        answer; ``RELEASED`` and ``DEFERRED`` are the caller's to do once the
        attempt is closed."""
        with bound(attempt):  # unbound after: our after_request must not settle it
            try:
                value = recover(abandoned)
                response = None if value is None else self.app.make_response(value)
            except LeaseLost:
                return RecoveryOutcome.FENCED
            except StoreUnavailableError as exc:  # (StoreUnavailable is one)
                level, what = store_failure(exc)
                log.log(level, "idempotency recover: key %s: %s: %s", label, what, exc)
                return RecoveryOutcome.DEFERRED
            except HTTPException as exc:
                # Raised as the view would have (a 400 for a body it refuses): a 4xx
                # means the request was never acted on; a 5xx, that it cannot tell.
                if exc.code is not None and exc.code < 500:
                    return RecoveryOutcome.RELEASED
                return RecoveryOutcome.DEFERRED
            except Exception as exc:
                log.warning(
                    "idempotency recover: key %s: recover=%s raised %s; handed back",
                    label,
                    getattr(recover, "__qualname__", "?"),
                    type(exc).__name__,
                )
                return RecoveryOutcome.DEFERRED
        if response is None:
            return RecoveryOutcome.RELEASED
        response = self.app.process_response(response)
        if response.status_code >= 500:
            # The recovery could not tell (its processor is down, say). A client would
            # retry a 5xx; here the next pass does, so the record is handed back.
            response.close()
            return RecoveryOutcome.DEFERRED
        try:
            settlement, stored = attempt.capture(response)
        finally:
            response.close()
        if settlement is flow.Settlement.RELEASE:
            return RecoveryOutcome.RELEASED
        if settlement is flow.Settlement.TOO_LARGE or stored is None:
            log.error("idempotency recover: key %s: answer too large to store; handed back", label)
            return RecoveryOutcome.DEFERRED
        try:
            attempt.complete(stored, recovered=True)
        except LeaseLostError:
            log.warning("idempotency recover: key %s: taken over meanwhile; rolled back", label)
            return RecoveryOutcome.FENCED
        except StoreUnavailableError:
            raise
        except Exception as exc:  # the session's flush failed: as if recover= raised
            log.warning("idempotency recover: key %s: flush failed: %s", label, type(exc).__name__)
            return RecoveryOutcome.DEFERRED
        log.info("idempotency recover: key %s recovered (%d)", label, stored.status)
        return RecoveryOutcome.RECOVERED

    def _hand_back(
        self, taken: Taken, outcome: RecoveryOutcome = RecoveryOutcome.DEFERRED
    ) -> RecoveryOutcome:
        self.state.keeper.drop(taken.record_key, taken.token)
        if not self.store.hand_back(taken.record_key, taken.token):
            return RecoveryOutcome.FENCED
        return outcome


def describe(outcomes: Mapping[RecoveryOutcome, int]) -> str:
    """``recovered 3, released 1, deferred 0, fenced 0, skipped 0``."""
    return ", ".join(f"{o.value} {outcomes.get(o, 0)}" for o in RecoveryOutcome)
