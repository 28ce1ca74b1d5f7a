"""The consumer guard: a message handler that runs once in effect per message.

Brokers deliver at least once, and a consumer may die between its work and its
acknowledgement. ``@idempotency.consumer(name)`` gives a handler the HTTP
route's semantics, on the same table and statements:

* the message's key (its message id by default) is claimed in
  ``idempotency_records`` under the scope ``consumer:<name>``, with a lease the
  process's lease keeper renews while the handler runs;
* the handler runs with ``idempotency.connection()`` inside the transaction
  that also records the completion (``idempotency_complete``, fenced by the
  claim's token), so its writes and "done" commit together or not at all; it
  may ``emit()`` follow-up events in that transaction too;
* the transport acknowledges only after that commit.

What :meth:`ConsumerGuard.handle` answers, and what the transport does:

============================  ==========================================  =============
situation                     outcome                                     transport
============================  ==========================================  =============
handler ran and committed     ``HANDLED``                                 ack
completed before (redelivery  ``DUPLICATE``: handler not run              ack
or a re-publish)
claim held by a live consumer ``BUSY``: ``delay`` = until its lease ends  requeue later
our lease was taken over      ``FENCED``: our transaction rolled back     ack (the new
(we stalled past it)                                                      holder has it)
handler raised                ``RETRY`` after a backoff ``delay``          requeue later
handler raised the N-th time  ``DEAD_LETTERED``: copied to the dead-      ack
                              letter queue, record released
another message under the     ``DEAD_LETTERED`` (``key_reused``)           ack
same key, or no key
PostgreSQL unreachable        ``RETRY`` (not counted as an attempt)       requeue later
============================  ==========================================  =============

Attempts are counted in PostgreSQL, not in the message: a failed attempt ends
its lease at once and keeps the record, so the next delivery takes it over and
the record's ``takeovers`` grows by one; a consumer that died mid-handler is
taken over when its lease runs out, and counts the same way. A message that
crashes its consumer every time therefore reaches the dead-letter queue too.
A dead-lettered message's record is released: replayed from the dead-letter
queue after a fix, it runs again from its first attempt.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

from flask import Flask, current_app

from .. import digests, flow
from ..engine import Attempt, bound
from ..route_options import route_options
from ..state import app_state
from ..store.base import LeaseLostError, StoredResponse, StoreUnavailableError
from ..store.errors import store_failure
from .messages import (
    ConsumerOptions,
    ConsumerOutcome,
    DeadLetter,
    Delivery,
    Handler,
    Result,
)

log = logging.getLogger("flask_idempotency.events")

#: What a consumer's completed record stores: there is no answer to replay, only
#: the fact that the message was handled.
HANDLED_RECORD = StoredResponse(200, (), b"")


class ConsumerGuard:
    """A handler wrapped by ``@idempotency.consumer(name)``.

    Call :meth:`handle` with a :class:`~.messages.Delivery` (any transport: a
    kombu or pika callback, a Celery task) inside the app's context, or give
    ``app=``; act on the :class:`~.messages.Result`.
    ``flask_idempotency.events.amqp.ConsumerWorker`` does that for kombu. Calling
    the guard itself runs the bare handler (tests).
    """

    def __init__(self, handler: Handler, options: ConsumerOptions) -> None:
        self.handler = handler
        self.options = options
        self.__name__ = getattr(handler, "__name__", options.name)
        self.__doc__ = getattr(handler, "__doc__", None)

    def __call__(self, delivery: Delivery) -> Any:
        return self.handler(delivery)

    def stored_record(self, returned: Any) -> StoredResponse:
        """What the completed record keeps of the handler's return value, committed
        with its writes and handed back on every duplicate (``Result.stored``).

        A plain consumer keeps only the fact that it ran; a transport whose
        handlers return something (a Celery task's result) overrides this. It runs
        as part of the attempt: raising here fails the attempt like the handler.
        """
        return HANDLED_RECORD

    def worker_losses(self, takeovers: int, delivery: Delivery) -> int:
        """How many earlier attempts at ``delivery`` were lost without finishing, of
        the record's ``takeovers`` (this attempt's takeover included).

        Every attempt that did not complete is taken over once: one that raised
        (its lease ended at once) as much as one whose process died. Here all of
        them count; a transport that knows how many of them raised (Celery's
        ``request.retries``) subtracts those.
        """
        return takeovers

    def gives_up(self, exc: Exception) -> bool:
        """Whether the handler's failure is final whatever ``max_attempts`` says (no
        delivery will follow): its record is then released, as a dead-lettered
        message's is, so a re-run after a fix starts afresh. Never, for a plain
        consumer: its retries are counted by ``max_attempts``."""
        return False

    def handle(
        self,
        delivery: Delivery,
        *,
        app: Flask | None = None,
        dead_letter: DeadLetter | None = None,
    ) -> Result:
        """Run the handler once in effect for ``delivery``; see the module's table.

        ``dead_letter`` copies the message to the dead-letter queue while this
        consumer still holds its claim; without one, a ``DEAD_LETTERED`` result
        leaves that to the caller (a Celery task rejects the message into its
        queue's dead-letter exchange, say).
        """
        app = app if app is not None else current_app._get_current_object()  # type: ignore[attr-defined]
        # A fresh app context: ``g`` (and so ``connection()``) belongs to this message.
        with app.app_context():
            result = self._handle(app, delivery, dead_letter)
        if result.outcome is ConsumerOutcome.DEAD_LETTERED:
            app_state(app).metrics.fanout.dead_lettered(self.options.name, result.reason or "")
        return result

    def _handle(self, app: Flask, delivery: Delivery, dead_letter: DeadLetter | None) -> Result:
        state = app_state(app)
        route = state.options_for(
            route_options(True, ttl=self.options.ttl, lease=self.options.lease)
        )
        key = self.options.key(delivery)
        if not key:
            return self._dead_letter_unclaimed(delivery, "missing_key", dead_letter)
        key = str(key)
        if not key.isascii():  # record_key() takes an ASCII key, as a header is
            key = hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()
        record_key = digests.record_key(f"consumer:{self.options.name}", key)
        with Attempt(state, record_key, delivery.fingerprint(), route) as attempt:
            try:
                decision, existing = attempt.claim()
            except StoreUnavailableError as exc:
                level, what = store_failure(exc)
                log.log(level, "consumer %s: %s: %s", self.options.name, what, exc)
                return Result(ConsumerOutcome.RETRY, self.options.retry_delay, "store_unavailable")
            if isinstance(decision, flow.Replay):
                return Result(ConsumerOutcome.DUPLICATE, stored=decision.response)
            if isinstance(decision, flow.Rejection):
                if decision is flow.Rejection.KEY_REUSED:
                    log.error(
                        "consumer %s: another message under key %s",
                        self.options.name,
                        digests.log_key(record_key),
                    )
                    return self._dead_letter_unclaimed(delivery, "key_reused", dead_letter)
                lease_left = (existing.lease_remaining if existing is not None else None) or 0.0
                delay = min(self.options.busy_delay, max(lease_left, 0.0)) or 0.05
                return Result(ConsumerOutcome.BUSY, delay, "in_progress")
            if attempt.takeover and self.options.max_worker_losses is not None:
                given_up = self._given_up(attempt, delivery, dead_letter)
                if given_up is not None:
                    return given_up
            with bound(attempt):
                try:
                    stored = self.stored_record(self.handler(delivery))
                except Exception as exc:
                    return self._failed(attempt, delivery, exc, dead_letter)
                except BaseException:
                    # Interrupted (SIGTERM, Ctrl-C): not an attempt; the message is
                    # redelivered when the channel closes.
                    attempt.release()
                    raise
            try:
                attempt.complete(stored)
            except LeaseLostError:
                log.warning(
                    "consumer %s: lease lost for key %s; this attempt was rolled back",
                    self.options.name,
                    digests.log_key(record_key),
                )
                return Result(ConsumerOutcome.FENCED, reason="lease_lost")
            except StoreUnavailableError as exc:
                log.warning("consumer %s: completion failed: %s", self.options.name, exc)
                return Result(ConsumerOutcome.RETRY, self.options.retry_delay, "store_unavailable")
            except Exception as exc:  # the session's flush failed: the handler's failure
                return self._failed(attempt, delivery, exc, dead_letter)
            return Result(ConsumerOutcome.HANDLED, stored=stored)

    def _failed(
        self, attempt: Attempt, delivery: Delivery, exc: Exception, dead_letter: DeadLetter | None
    ) -> Result:
        """The handler failed: the attempt is rolled back and closed, and the failure
        counted (retried later, or dead-lettered at ``max_attempts``)."""
        record_key, token = attempt.record_key, attempt.token
        store = attempt.app_state.postgres_store("counting a message's attempts")
        assert record_key is not None and token is not None
        attempt.close()  # before another connection: the pool may be small
        name = self.options.name
        error = f"{type(exc).__name__}: {exc}"[:500]
        try:
            earlier = store.attempts_so_far(record_key, token)
        except StoreUnavailableError:
            # The lease will lapse; the next delivery takes it over and counts it.
            return Result(
                ConsumerOutcome.RETRY, self.options.retry_delay, "handler_failed", error=exc
            )
        if earlier is None:
            return Result(ConsumerOutcome.FENCED, reason="lease_lost", error=exc)
        attempts, limit = earlier + 1, self.options.max_attempts
        log.warning(
            "consumer %s: handler failed on key %s (attempt %d%s): %s",
            name,
            digests.log_key(record_key),
            attempts,
            "" if limit is None else f" of {limit}",
            type(exc).__name__,
        )
        result = Result(
            ConsumerOutcome.DEAD_LETTERED, reason="handler_failed", attempts=attempts, error=exc
        )
        final = (limit is not None and attempts >= limit) or self.gives_up(exc)
        final = final and self._copy_to_dead_letter(dead_letter, delivery, result, error)
        try:  # dead-lettered: released; else its lease ends now, for the next delivery
            (store.release_claim if final else store.fail_attempt)(record_key, token)
        except StoreUnavailableError as failure:  # the lease lapses, with the same effect
            log.warning("consumer %s: could not record the attempt: %s", name, failure)
        if final:
            return result
        # retry_delay doubling with each attempt (attempts >= 1), at most max_retry_delay
        exponent = min(attempts - 1, 30)
        delay = min(self.options.max_retry_delay, self.options.retry_delay * 2**exponent)
        return Result(ConsumerOutcome.RETRY, delay, "handler_failed", attempts=attempts, error=exc)

    def _given_up(
        self, attempt: Attempt, delivery: Delivery, dead_letter: DeadLetter | None
    ) -> Result | None:
        """On a takeover: ``None`` to run the handler, or the result of giving the
        message up because ``max_worker_losses`` earlier attempts were lost (copied
        to the dead-letter queue first, when the caller gave one).

        A message that kills its process every time (a segfault, an OOM kill) never
        raises, so no retry count grows; only the takeovers of its record show it.
        Given up, the handler does not run again and the record is released (as a
        dead-lettered message's is): a re-run after a fix starts from its first
        attempt. If PostgreSQL cannot say how many attempts came before, the handler
        runs: the next takeover checks again.
        """
        limit = self.options.max_worker_losses
        record_key, token = attempt.record_key, attempt.token
        store = attempt.app_state.postgres_store("counting a message's attempts")
        assert limit is not None and record_key is not None and token is not None
        try:
            takeovers = store.attempts_so_far(record_key, token)
        except StoreUnavailableError as exc:
            log.warning("consumer %s: could not count earlier attempts: %s", self.options.name, exc)
            return None
        if takeovers is None:  # taken over again already: not ours to run
            return Result(ConsumerOutcome.FENCED, reason="lease_lost")
        losses = self.worker_losses(takeovers, delivery)
        if losses < limit:
            return None
        attempt.close()  # before another connection: the pool may be small
        result = Result(ConsumerOutcome.DEAD_LETTERED, reason="worker_lost", attempts=losses)
        reason = f"{losses} attempts lost without finishing"
        if not self._copy_to_dead_letter(dead_letter, delivery, result, reason):
            # Still claimed: the lease lapses and the next delivery decides again.
            return Result(ConsumerOutcome.RETRY, self.options.retry_delay, "worker_lost")
        try:
            store.release_claim(record_key, token)
        except StoreUnavailableError as exc:
            # The lease lapses; the next delivery takes over and decides again.
            log.warning("consumer %s: could not release a lost message: %s", self.options.name, exc)
            return Result(ConsumerOutcome.RETRY, self.options.retry_delay, "store_unavailable")
        log.error(
            "consumer %s: key %s: %d earlier attempts were lost without finishing "
            "(max_worker_losses=%d); not run again, its record released",
            self.options.name,
            digests.log_key(record_key),
            losses,
            limit,
        )
        return result

    def _dead_letter_unclaimed(
        self, delivery: Delivery, reason: str, dead_letter: DeadLetter | None
    ) -> Result:
        result = Result(ConsumerOutcome.DEAD_LETTERED, reason=reason)
        if not self._copy_to_dead_letter(dead_letter, delivery, result, reason):
            return Result(ConsumerOutcome.RETRY, self.options.retry_delay, reason)
        return result

    def _copy_to_dead_letter(
        self, dead_letter: DeadLetter | None, delivery: Delivery, result: Result, reason: str
    ) -> bool:
        """Copy ``delivery`` to the dead-letter queue (when the caller gave one);
        False when that failed, and the message must stay where it is."""
        try:
            if dead_letter is not None:
                dead_letter(delivery, result, reason)
        except Exception as exc:  # the broker's error: its class, not its text
            name, error = self.options.name, type(exc).__name__
            log.error("consumer %s: dead-lettering failed: %s", name, error)
            return False
        return True
