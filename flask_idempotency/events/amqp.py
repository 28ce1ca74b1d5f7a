"""The broker side, through kombu: publishing with confirms, the topology, a consumer loop.

kombu is the ``[events]`` extra: only this module imports it, and only what talks
to a broker imports this module, so the library imports without it. RabbitMQ
(``amqp://``) is the broker this is written and tested for. (Without a broker,
``relay.EmbeddedEvents`` runs the same relay and guards in one process.)

Topology: events go to one durable topic exchange (``IDEMPOTENCY_BROKER_OPTIONS["exchange"]``)
with the event type as routing key, persistent, the event id as message id. A
consumer's queue is durable and bound to the types it handles; beside it
``<queue>.dlq`` receives the messages its guard gave up on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import heapq
import itertools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from flask import Flask

from .consumer import ConsumerGuard
from .messages import ConsumerOutcome, Delivery, Result
from .outbox import OutboxEvent
from .relay import Backoff, BrokerUnavailable

try:
    import kombu
    from kombu.mixins import ConsumerMixin
    from kombu.utils.url import maybe_sanitize_url
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError("events need kombu: pip install 'flask-idempotency[events]'") from exc

log = logging.getLogger("flask_idempotency.events")

#: Seconds to connect, and to wait for a publisher confirm or any socket read/write:
#: a broker that stops answering (a partition, a hung proxy) is given up on
#: after this and retried, instead of holding the relay's row locks for ever.
DEFAULT_TIMEOUT = 10.0
#: AMQP heartbeat of consumer connections, seconds. A stalled broker is noticed
#: after about two of them. A handler that runs longer than this delays the
#: heartbeats it should send; keep it above the slowest handler.
DEFAULT_HEARTBEAT = 30.0
#: How long the consumer loop blocks reading the socket before it looks at its
#: heartbeats and its delayed requeues.
_POLL = 0.2

DEAD_LETTER_SUFFIX = ".dlq"


def connect(url: str, *, timeout: float = DEFAULT_TIMEOUT, heartbeat: float | None = None) -> Any:
    """A kombu connection with publisher confirms on every channel, and timeouts."""
    options: dict[str, Any] = {}
    if url.split(":", 1)[0] in ("amqp", "amqps", "pyamqp"):
        options = {"confirm_publish": True, "read_timeout": timeout, "write_timeout": timeout}
    return kombu.Connection(
        url, connect_timeout=timeout, heartbeat=heartbeat or 0, transport_options=options
    )


def redact(url: str) -> str:
    """``url`` without its password, for logs."""
    return str(maybe_sanitize_url(url, mask="***"))


def exchange(name: str) -> Any:
    return kombu.Exchange(name, type="topic", durable=True)


class Publisher:
    """Publishes outbox events to ``exchange_name`` and waits for each confirm.

    ``publish`` answers True when the broker confirmed the message and routed it
    to at least one queue, False when it returned it as unroutable (no queue is
    bound to its type yet: the relay keeps the row and tries again later), and
    raises :class:`~.relay.BrokerUnavailable` when the broker is away or refused it.
    A publisher of another kind of message (``celery.TaskPublisher``) overrides
    :meth:`make_producer` and :meth:`send`, and keeps the connection handling.
    """

    def __init__(self, url: str, exchange_name: str, *, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.url = url
        self.exchange_name = exchange_name
        self.timeout = timeout
        self._conn: Any = None
        self._producer: Any = None
        self._returned: set[str] = set()

    def make_producer(self, conn: Any) -> Any:
        """The producer to publish with on ``conn``, just connected (it declares its
        exchange as it first publishes)."""
        return kombu.Producer(
            conn.channel(), exchange=exchange(self.exchange_name), on_return=self._on_return
        )

    def producer(self) -> Any:
        """The producer, connected now if it is not (:class:`~.relay.BrokerUnavailable`
        at once if the broker is away: the relay's backoff retries)."""
        if self._producer is not None:
            return self._producer
        conn = connect(self.url, timeout=self.timeout)
        try:
            conn.ensure_connection(max_retries=0)
            self._producer = self.make_producer(conn)
        except Exception as exc:
            conn.release()
            raise BrokerUnavailable(f"{redact(self.url)}: {type(exc).__name__}: {exc}") from exc
        self._conn = conn
        return self._producer

    def _on_return(self, exc: Any, exchange: Any, routing_key: str, message: Any) -> None:
        properties = getattr(message, "properties", {}) or {}
        self._returned.add(str(properties.get("message_id")))

    def publish(self, event: OutboxEvent) -> bool:
        producer = self.producer()
        try:
            self.send(producer, event)
        except Exception as exc:
            self.close()
            raise BrokerUnavailable(f"publish failed: {type(exc).__name__}: {exc}") from exc
        if event.id in self._returned:
            self._returned.discard(event.id)
            return False
        return True

    def send(self, producer: Any, event: OutboxEvent) -> None:
        """Publish ``event`` with ``producer`` and wait for its confirm; whatever this
        raises is the broker's failure (``publish()`` closes the connection and
        raises :class:`~.relay.BrokerUnavailable`)."""
        producer.publish(
            event.envelope(),
            routing_key=event.type,
            content_type="application/json",
            content_encoding="utf-8",
            message_id=event.id,
            type=event.type,
            timestamp=event.created,
            delivery_mode=2,
            mandatory=True,
            headers={"x-idempotency-derived-key": event.derived_key or ""},
            timeout=self.timeout,
            confirm_timeout=self.timeout,
        )

    def close(self) -> None:
        conn, self._conn, self._producer = self._conn, None, None
        if conn is not None:
            with contextlib.suppress(Exception):  # a dead socket: nothing left to close cleanly
                conn.release()


@dataclasses.dataclass(frozen=True)
class Subscription:
    """A guard and the queue it consumes: bound to ``routing_keys`` on ``exchange_name``."""

    guard: ConsumerGuard
    queue: str
    routing_keys: Sequence[str]
    exchange_name: str

    @property
    def dead_letter_queue(self) -> str:
        return self.queue + DEAD_LETTER_SUFFIX

    def queues(self) -> tuple[Any, Any]:
        """The kombu queue to consume (its bindings declare the exchange with it) and
        its dead-letter queue."""
        ex = exchange(self.exchange_name)
        bindings = [kombu.binding(ex, routing_key=key) for key in self.routing_keys]
        return (
            kombu.Queue(self.queue, bindings=bindings, durable=True),
            kombu.Queue(self.dead_letter_queue, durable=True),
        )


class ConsumerWorker(ConsumerMixin):  # type: ignore[misc]  # kombu is untyped here
    """kombu's consumer loop (its ``ConsumerMixin``) around one or more guards.

    It acknowledges what the guard says to acknowledge (after the commit),
    holds ``BUSY`` and ``RETRY`` deliveries for their delay and then requeues
    them (the broker delivers them again; other messages keep flowing
    meanwhile, up to ``prefetch``), and copies dead-lettered ones to the
    subscription's ``.dlq`` over a connection of its own, with a confirm,
    before acknowledging them. When the broker goes away it reconnects with
    backoff; the deliveries it held go back to the queue with the channel.
    """

    #: Fail fast: :meth:`run` waits out an outage with its own backoff, and its ``stop``.
    connect_max_retries = 0

    def __init__(
        self,
        app: Flask,
        url: str,
        subscriptions: Sequence[Subscription],
        *,
        prefetch: int = 10,
        heartbeat: float = DEFAULT_HEARTBEAT,
        timeout: float = DEFAULT_TIMEOUT,
        backoff: Backoff | None = None,
    ) -> None:
        self.app = app
        #: The mixin's connection: each round of :meth:`run` consumes on a clone of it.
        self.connection = connect(url, timeout=timeout, heartbeat=heartbeat)
        self.subscriptions = list(subscriptions)
        self.prefetch = prefetch
        self.timeout = timeout
        self.backoff = backoff or Backoff()
        #: Deliveries by outcome, plus ``reconnects``, since the worker started.
        self.counts: Counter[str] = Counter()
        self.connected = threading.Event()
        self._stop = threading.Event()
        self._delayed: list[tuple[float, int, Any]] = []
        self._seq = itertools.count()
        # Dead letters go out on a connection of their own: waiting for a confirm on
        # the consuming one would dispatch new deliveries into this one's handling.
        self._dead_letters = kombu.Producer(connect(url, timeout=timeout))

    @property
    def should_stop(self) -> bool:
        """The mixin's flag, read from the ``stop`` event given to :meth:`run`."""
        return self._stop.is_set()

    def run(self, stop: threading.Event) -> Counter[str]:
        """Consume until ``stop`` is set; returns the counts."""
        self._stop = stop
        errors = (
            *self.connection.connection_errors,
            *self.connection.channel_errors,
            OSError,
            kombu.exceptions.OperationalError,  # a failed connect, as kombu raises it
        )
        try:
            while not stop.is_set():
                try:
                    for _ in self.consume(safety_interval=_POLL):
                        pass
                except errors as exc:
                    self.connected.clear()
                    self.counts["reconnects"] += 1
                    delay = self.backoff.next()
                    log.warning(
                        "consumer: broker unavailable (%s: %s); again in %.1f s",
                        type(exc).__name__,
                        exc,
                        delay,
                    )
                    stop.wait(delay)
        finally:
            self._dead_letters.connection.release()
        return self.counts

    # -- the mixin's hooks ---------------------------------------------------------

    def get_consumers(self, consumer: Callable[..., Any], channel: Any) -> list[Any]:
        consumers = []
        for sub in self.subscriptions:
            queue, dead_letter_queue = sub.queues()
            dead_letter_queue(channel).declare()
            consumers.append(
                consumer(
                    queues=[queue],
                    callbacks=[functools.partial(self._on_message, sub)],
                    on_decode_error=functools.partial(self._on_decode_error, sub),
                    accept=["json"],
                    prefetch_count=self.prefetch,
                )
            )
        return consumers

    def on_consume_ready(self, connection: Any, channel: Any, consumers: Any, **kw: Any) -> None:
        self._delayed.clear()  # what an earlier channel held went back with it
        self.backoff.reset()
        self.connected.set()
        log.info("consumer: consuming %s", ", ".join(s.queue for s in self.subscriptions))

    def on_iteration(self) -> None:
        now = time.monotonic()
        while self._delayed and self._delayed[0][0] <= now:
            _, _, message = heapq.heappop(self._delayed)
            message.requeue()
            self.counts["requeued"] += 1

    # -- deliveries ----------------------------------------------------------------

    def _on_message(self, sub: Subscription, body: Any, message: Any) -> None:
        properties = message.properties or {}
        delivery = Delivery.from_body(
            body,
            message_id=properties.get("message_id"),
            type=properties.get("type"),
            headers=message.headers or {},
            redelivered=bool(message.delivery_info.get("redelivered")),
        )
        dead_letter = functools.partial(self._dead_letter, sub, message)
        result = sub.guard.handle(delivery, app=self.app, dead_letter=dead_letter)
        self.counts[result.outcome.value] += 1
        if result.outcome.acknowledge:
            message.ack()
        else:
            due = time.monotonic() + result.delay
            heapq.heappush(self._delayed, (due, next(self._seq), message))

    def _on_decode_error(self, sub: Subscription, message: Any, exc: Exception) -> None:
        log.error("consumer %s: undecodable message: %s", sub.queue, type(exc).__name__)
        result = Result(ConsumerOutcome.DEAD_LETTERED, reason="undecodable")
        self._dead_letter(sub, message, None, result, f"{type(exc).__name__}"[:500])
        self.counts[ConsumerOutcome.DEAD_LETTERED.value] += 1
        message.ack()

    def _dead_letter(
        self, sub: Subscription, message: Any, delivery: Delivery | None, result: Result, error: str
    ) -> None:
        """Copy ``message`` to ``sub``'s dead-letter queue and wait for the confirm
        (reconnecting once if that connection was lost since its last use). The
        copy is the message as received: ``delivery`` (none when it could not be
        decoded) is not needed."""
        properties = message.properties or {}
        self._dead_letters.publish(
            message.body,
            exchange="",
            routing_key=sub.dead_letter_queue,
            content_type=message.content_type,
            content_encoding=message.content_encoding,
            message_id=properties.get("message_id"),
            type=properties.get("type"),
            headers={
                **(message.headers or {}),
                "x-idempotency-dead-letter-reason": result.reason or "",
                "x-idempotency-attempts": result.attempts,
                "x-idempotency-error": error,
                "x-idempotency-queue": sub.queue,
            },
            delivery_mode=2,
            timeout=self.timeout,
            confirm_timeout=self.timeout,
            retry=True,
            retry_policy={"max_retries": 1, "interval_start": 0},
        )
