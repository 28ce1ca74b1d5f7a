"""The relay: publishes pending outbox rows to the broker, then marks them published.

One batch is one PostgreSQL transaction: take up to ``batch_size`` pending rows
``FOR UPDATE SKIP LOCKED`` (so relays running side by side take disjoint
batches), publish each and wait for the broker's confirm, then mark the
confirmed ones published and commit. Hence:

* a relay that dies between a publish and the commit leaves its rows pending
  (its transaction dies with its connection); the next batch publishes them
  again under the same message id: at least once, never lost. Consumers
  recognise the re-publish (``consumer.py``);
* a broker that goes away mid-batch: what it confirmed is marked, the rest
  stays pending (its attempt counted), and the relay waits with exponential
  backoff before it reconnects;
* a message the broker returns as unroutable (no queue bound to its type yet)
  is kept and deferred with a backoff of its own, so it holds up no other;
* PostgreSQL unreachable: the same backoff.

The embedded path (:class:`EmbeddedEvents`) is this relay without a broker, for
development and deployments without one: the same outbox rows, the same
``SKIP LOCKED`` batches marked published after delivery, and the same consumer
guards. Delivering an event is calling each matching guard in this process,
inside the relay's batch transaction, so a crash mid-handler leaves the event
pending (the relay's transaction dies with the process) and the guard's claim
lapses with its lease: the next relay, here or in another process, delivers it
again, and the guard takes the claim over. A guard that answers "later"
(``BUSY``, ``RETRY``) defers the event with the relay's backoff; one that gives
up (``DEAD_LETTERED``) has its event marked published and logged, as there is
no dead-letter queue here. No kombu needed. Several processes may each run one
(gunicorn workers): the relays' batches split the outbox between them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from flask import Flask

from ..state import app_state
from ..store import driver, schema
from ..store.base import StoreUnavailableError
from ..store.errors import store_failure
from ..store.heartbeat import Heartbeat
from . import outbox
from .messages import ConsumerOutcome, Delivery
from .outbox import OutboxEvent

if TYPE_CHECKING:
    from .consumer import ConsumerGuard

log = logging.getLogger("flask_idempotency.events")

#: Rows per batch: one transaction, its row locks held while they are published.
DEFAULT_BATCH_SIZE = 100
#: Seconds between looks at an empty outbox.
DEFAULT_POLL_INTERVAL = 0.5
#: Deferral of an unroutable event: 1 s, doubling with each attempt, at most 5 min.
DEFER_BASE = 1.0
DEFER_CAP = 300.0


class BrokerUnavailable(Exception):
    """The broker could not be reached, closed the connection, or refused the channel."""


class EventPublisher(Protocol):
    """The broker side of a relay (``amqp.Publisher``, ``celery.TaskPublisher``, the
    embedded path's): ``publish`` answers whether the event was routed, or raises
    :class:`BrokerUnavailable`."""

    def publish(self, event: OutboxEvent) -> bool: ...

    def close(self) -> None: ...


class Backoff:
    """Exponential backoff with jitter: ``initial``, doubling to ``maximum``."""

    def __init__(self, initial: float = 0.2, maximum: float = 10.0) -> None:
        self.initial = initial
        self.maximum = maximum
        self._next = initial

    def reset(self) -> None:
        self._next = self.initial

    def next(self) -> float:
        delay = self._next
        self._next = min(self.maximum, self._next * 2)
        return delay * random.uniform(0.8, 1.2)


@dataclasses.dataclass
class RelayStats:
    published: int = 0
    #: Returned as unroutable (or refused) and deferred.
    deferred: int = 0
    batches: int = 0
    #: Rounds that failed for an outage (broker or PostgreSQL) and were retried.
    outages: int = 0


class Relay:
    def __init__(
        self,
        store: Any,
        publisher: EventPublisher,
        *,
        batch_size: int = DEFAULT_BATCH_SIZE,
        poll_interval: float = DEFAULT_POLL_INTERVAL,
        backoff: Backoff | None = None,
    ) -> None:
        if batch_size < 1:
            raise ValueError("the relay's batch size must be at least 1")
        self.store = store
        self.publisher = publisher
        self.batch_size = batch_size
        self.poll_interval = poll_interval
        self.backoff = backoff or Backoff()
        self.stats = RelayStats()
        #: "The relay ran": what ``flask idempotency doctor`` reads to say it is alive.
        self.heartbeat = Heartbeat(store, "relay")

    @classmethod
    def for_app(cls, app: Flask, publisher: EventPublisher, **options: Any) -> Relay:
        """A relay over ``app``'s outbox (the extension's store), publishing with
        ``publisher``; ``options`` as for the constructor."""
        return cls(app_state(app).store, publisher, **options)

    def relay_batch(self) -> int:
        """Publish one batch; return how many rows it took (0: nothing pending).

        Raises :class:`~flask_idempotency.events.relay.BrokerUnavailable` or
        ``StoreUnavailableError`` after committing what the broker did confirm
        (``SchemaMismatchError`` when the database has no outbox).
        """
        error: BrokerUnavailable | None = None
        with self.store.transaction() as conn:
            try:
                events = outbox.claim_batch(conn, self.batch_size)
            except driver.ERRORS as exc:
                # No outbox table: a skipped migrate, named (and waited out) as such,
                # not an UndefinedTable that ends the relay.
                if (problem := schema.mismatch(exc)) is None:
                    raise
                raise problem from exc
            if not events:
                return 0
            published: list[str] = []
            deferred: list[str] = []
            for index, event in enumerate(events):
                try:
                    routed = self.publisher.publish(event)
                except BrokerUnavailable as exc:
                    error = exc
                    outbox.mark(conn, outbox.MARK_ATTEMPTED, [e.id for e in events[index:]])
                    break
                (published if routed else deferred).append(event.id)
            outbox.mark(conn, outbox.MARK_PUBLISHED, published)
            outbox.mark(conn, outbox.MARK_DEFERRED, deferred, base=DEFER_BASE, cap=DEFER_CAP)
        self.stats.batches += 1
        self.stats.published += len(published)
        self.stats.deferred += len(deferred)
        if deferred:
            log.warning("relay: %d event(s) unroutable (no queue bound); deferred", len(deferred))
        if error is not None:
            raise error
        return len(events)

    def run(
        self,
        stop: threading.Event | None = None,
        *,
        once: bool = False,
        on_batch: Callable[[int], None] | None = None,
    ) -> RelayStats:
        """Relay until ``stop`` is set; with ``once``, until nothing is pending, and an
        outage raises instead of waiting (cron runs it again). ``on_batch`` is told
        the size of each committed batch (the CLI's progress)."""
        stop = stop or threading.Event()
        try:
            while not stop.is_set():
                try:
                    taken = self.relay_batch()
                except (BrokerUnavailable, StoreUnavailableError) as exc:
                    self.publisher.close()
                    if once:
                        raise
                    self.stats.outages += 1
                    delay = self.backoff.next()
                    level, _ = store_failure(exc)  # a broker outage is a WARNING too
                    log.log(level, "relay: %s; retrying in %.1f s", exc, delay)
                    stop.wait(delay)
                    continue
                self.backoff.reset()
                self.heartbeat.beat()
                if taken and on_batch is not None:
                    on_batch(taken)
                # A full batch: more may be waiting. Else done (once), or wait for more
                # (``wait`` answers True when ``stop`` was set meanwhile).
                if taken < self.batch_size and (once or stop.wait(self.poll_interval)):
                    break
        finally:
            self.publisher.close()
        return self.stats


# -- the embedded path ------------------------------------------------------------


def topic_matches(pattern: str, routing_key: str) -> bool:
    """AMQP topic matching: ``*`` is one dot-separated word, ``#`` zero or more."""

    def match(p: list[str], k: list[str]) -> bool:
        if not p:
            return not k
        if p[0] == "#":
            return any(match(p[1:], k[i:]) for i in range(len(k) + 1))
        if not k:
            return False
        return (p[0] == "*" or p[0] == k[0]) and match(p[1:], k[1:])

    return match(pattern.split("."), routing_key.split("."))


class DirectPublisher:
    """An :class:`~.relay.EventPublisher` that runs the matching guards instead of
    publishing: "confirmed" when every one of them is done with the event."""

    def __init__(self, app: Flask, routes: Sequence[tuple[ConsumerGuard, Sequence[str]]]) -> None:
        self.app = app
        self.routes = [(guard, tuple(patterns)) for guard, patterns in routes]

    def publish(self, event: OutboxEvent) -> bool:
        # The envelope carries the event's id and type: the delivery's.
        delivery = Delivery.from_body(json.loads(event.envelope()))
        done = True
        for guard, patterns in self.routes:
            if not any(topic_matches(p, event.type) for p in patterns):
                continue
            result = guard.handle(delivery, app=self.app)
            if result.outcome is ConsumerOutcome.DEAD_LETTERED:
                log.error(
                    "consumer %s gave up on event %s (%s); no dead-letter queue "
                    "on the embedded path",
                    guard.options.name,
                    event.id,
                    result.reason,
                )
            elif not result.outcome.acknowledge:
                done = False
        return done

    def close(self) -> None:
        pass


class EmbeddedEvents:
    """A daemon thread relaying the app's outbox to ``routes``: (guard, topic patterns),
    without a broker (the module's last paragraph)."""

    def __init__(
        self,
        app: Flask,
        routes: Sequence[tuple[ConsumerGuard, Sequence[str]]],
        *,
        poll_interval: float = DEFAULT_POLL_INTERVAL,
        batch_size: int = 20,
    ) -> None:
        self.relay = Relay.for_app(
            app, DirectPublisher(app, routes), batch_size=batch_size, poll_interval=poll_interval
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="idempotency-embedded-events", daemon=True
        )

    def start(self) -> EmbeddedEvents:
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            self.relay.run(self._stop)
        except Exception:  # never silently: this thread is the whole event flow
            log.exception("embedded events: the relay stopped")

    def run(self) -> None:
        """Relay in the calling thread until :meth:`stop` (a foreground service)."""
        self.relay.run(self._stop)

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
