"""The embedded path: the relay hands events straight to the guards, in one process.

For development and deployments without a broker: the same outbox rows, the
same :class:`~.relay.Relay` loop (``SKIP LOCKED`` batches, marked published
after delivery) and the same consumer guards; only the broker is left out.
Delivering an event is calling each matching guard in this process, inside the
relay's batch transaction, so a crash mid-handler leaves the event pending
(the relay's transaction dies with the process) and the guard's claim lapses
with its lease: the next relay, here or in another process, delivers it
again, and the guard takes the claim over. A guard that answers "later"
(``BUSY``, ``RETRY``) defers the event with the relay's backoff; one that gives
up (``DEAD_LETTERED``) has its event marked published and logged, as there is
no dead-letter queue here.

No kombu needed. Several processes may each run one (gunicorn workers): the
relays' batches split the outbox between them.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Sequence

from flask import Flask

from ..state import app_state
from .consumer import ConsumerGuard
from .messages import ConsumerOutcome, Delivery
from .outbox import OutboxEvent
from .relay import DEFAULT_POLL_INTERVAL, Relay

log = logging.getLogger("flask_idempotency.events")


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
        body = json.loads(event.envelope())
        delivery = Delivery.from_body(body, message_id=event.id, type=event.type)
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
    """A daemon thread relaying the app's outbox to ``routes``: (guard, topic patterns)."""

    def __init__(
        self,
        app: Flask,
        routes: Sequence[tuple[ConsumerGuard, Sequence[str]]],
        *,
        poll_interval: float = DEFAULT_POLL_INTERVAL,
        batch_size: int = 20,
    ) -> None:
        store = app_state(app).store
        self.relay = Relay(
            store,
            DirectPublisher(app, routes),
            batch_size=batch_size,
            poll_interval=poll_interval,
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
