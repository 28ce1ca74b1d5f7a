"""The broker side, through kombu: publishing with confirms, the topology, a consumer loop.

kombu is the ``[events]`` extra: it is imported when one of these is used, so
the library imports without it. RabbitMQ (``amqp://``) is the broker this is
written and tested for. (Without a broker, ``embedded.py`` runs the same relay
and guards in one process.)

Topology: events go to one durable topic exchange (``IDEMPOTENCY_BROKER_OPTIONS["exchange"]``)
with the event type as routing key, persistent, the event id as message id. A
consumer's queue is durable and bound to the types it handles; beside it
``<queue>.dlq`` receives the messages its guard gave up on.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import logging
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from flask import Flask

from .consumer import ConsumerGuard
from .messages import ConsumerOutcome, Delivery, Result
from .outbox import OutboxEvent

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


class BrokerUnavailable(Exception):
    """The broker could not be reached, closed the connection, or refused the channel."""


def _kombu() -> Any:
    try:
        import kombu
    except ImportError as exc:  # pragma: no cover - depends on the installation
        raise RuntimeError("events need kombu: pip install 'flask-idempotency[events]'") from exc
    return kombu


def connect(url: str, *, timeout: float = DEFAULT_TIMEOUT, heartbeat: float | None = None) -> Any:
    """A kombu connection with publisher confirms on every channel, and timeouts."""
    kombu = _kombu()
    options: dict[str, Any] = {}
    if url.split(":", 1)[0] in ("amqp", "amqps", "pyamqp"):
        options = {"confirm_publish": True, "read_timeout": timeout, "write_timeout": timeout}
    return kombu.Connection(
        url, connect_timeout=timeout, heartbeat=heartbeat or 0, transport_options=options
    )


def redact(url: str) -> str:
    """``url`` without its password, for logs."""
    head, sep, tail = url.rpartition("@")
    if not sep or "://" not in head:
        return url
    scheme, _, userinfo = head.partition("://")
    return f"{scheme}://{userinfo.split(':', 1)[0]}:***@{tail}"


def exchange(name: str) -> Any:
    return _kombu().Exchange(name, type="topic", durable=True)


def _broker_errors(conn: Any) -> tuple[type[BaseException], ...]:
    """What "the broker is away or refused us" raises: the transport's own errors,
    socket errors, and kombu's wrapping of a failed connect."""
    wrapped = _kombu().exceptions.OperationalError
    return (*conn.connection_errors, *conn.channel_errors, OSError, wrapped)


class Publisher:
    """Publishes outbox events to ``exchange_name`` and waits for each confirm.

    ``publish`` answers True when the broker confirmed the message and routed it
    to at least one queue, False when it returned it as unroutable (no queue is
    bound to its type yet: the relay keeps the row and tries again later), and
    raises :class:`BrokerUnavailable` when the broker is away or refused it.
    """

    def __init__(self, url: str, exchange_name: str, *, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.url = url
        self.exchange_name = exchange_name
        self.timeout = timeout
        self._conn: Any = None
        self._producer: Any = None
        self._returned: set[str] = set()

    def _connect(self) -> Any:
        if self._producer is not None:
            return self._producer
        kombu = _kombu()
        conn = connect(self.url, timeout=self.timeout)
        try:
            conn.ensure_connection(max_retries=0)  # fail fast: our backoff retries
            channel = conn.channel()
            exchange(self.exchange_name)(channel).declare()
            self._producer = kombu.Producer(
                channel, exchange=exchange(self.exchange_name), on_return=self._on_return
            )
        except Exception as exc:
            conn.release()
            raise BrokerUnavailable(f"{redact(self.url)}: {type(exc).__name__}: {exc}") from exc
        self._conn = conn
        return self._producer

    def _on_return(self, exc: Any, exchange: Any, routing_key: str, message: Any) -> None:
        properties = getattr(message, "properties", {}) or {}
        self._returned.add(str(properties.get("message_id")))

    def publish(self, event: OutboxEvent) -> bool:
        producer = self._connect()
        try:
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
        except Exception as exc:
            self.close()
            raise BrokerUnavailable(f"publish failed: {type(exc).__name__}: {exc}") from exc
        if event.id in self._returned:
            self._returned.discard(event.id)
            return False
        return True

    def close(self) -> None:
        conn, self._conn, self._producer = self._conn, None, None
        if conn is not None:
            try:
                conn.release()
            except Exception:  # a dead socket: nothing left to close cleanly
                pass


@dataclasses.dataclass(frozen=True)
class Subscription:
    """A guard and the queue it consumes: bound to ``routing_keys`` on ``exchange_name``."""

    guard: ConsumerGuard
    queue: str
    routing_keys: Sequence[str]
    exchange_name: str
    #: Extra queue arguments (both the queue and its ``.dlq``), e.g. ``x-queue-type``.
    queue_arguments: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def dead_letter_queue(self) -> str:
        return self.queue + DEAD_LETTER_SUFFIX

    def declare(self, channel: Any) -> Any:
        """Declare the exchange, the queue with its bindings and its dead-letter
        queue; return the kombu queue to consume."""
        kombu = _kombu()
        ex = exchange(self.exchange_name)
        args = dict(self.queue_arguments)
        bindings = [kombu.binding(ex, routing_key=key) for key in self.routing_keys]
        queue = kombu.Queue(self.queue, bindings=bindings, durable=True, queue_arguments=args)
        dlq = kombu.Queue(self.dead_letter_queue, durable=True, queue_arguments=args)
        ex(channel).declare()
        queue(channel).declare()
        dlq(channel).declare()
        return queue


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


class ConsumerWorker:
    """A plain kombu consumer loop around one or more guards.

    It acknowledges what the guard says to acknowledge (after the commit),
    holds ``BUSY`` and ``RETRY`` deliveries for their delay and then requeues
    them (the broker delivers them again; other messages keep flowing
    meanwhile, up to ``prefetch``), and copies dead-lettered ones to the
    subscription's ``.dlq`` over a connection of its own, with a confirm,
    before acknowledging them. When the broker goes away it reconnects with
    backoff; the deliveries it held go back to the queue with the channel.
    """

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
        self.url = url
        self.subscriptions = list(subscriptions)
        self.prefetch = prefetch
        self.heartbeat = heartbeat
        self.timeout = timeout
        self.backoff = backoff or Backoff()
        #: Deliveries by outcome, plus ``reconnects``, since the worker started.
        self.counts: Counter[str] = Counter()
        self.connected = threading.Event()
        self._delayed: list[tuple[float, int, Any]] = []
        self._seq = itertools.count()
        self._dl_conn: Any = None

    def run(self, stop: threading.Event) -> Counter[str]:
        """Consume until ``stop`` is set; returns the counts."""
        while not stop.is_set():
            try:
                self._consume(stop)
            except BrokerUnavailable as exc:
                self.connected.clear()
                self.counts["reconnects"] += 1
                delay = self.backoff.next()
                log.warning("consumer: broker unavailable (%s); again in %.1f s", exc, delay)
                stop.wait(delay)
        self._close_dead_letter_connection()
        return self.counts

    def _consume(self, stop: threading.Event) -> None:
        kombu = _kombu()
        conn = connect(self.url, timeout=self.timeout, heartbeat=self.heartbeat)
        errors = _broker_errors(conn)
        try:
            try:
                conn.ensure_connection(max_retries=0)  # fail fast: our backoff retries
                channel = conn.channel()
                consumers = []
                for sub in self.subscriptions:
                    queue = sub.declare(channel)
                    consumer = kombu.Consumer(
                        channel,
                        queues=[queue],
                        callbacks=[self._callback(sub)],
                        on_decode_error=self._decode_error(sub),
                        accept=["json"],
                        prefetch_count=self.prefetch,
                    )
                    consumer.consume()
                    consumers.append(consumer)
            except errors as exc:
                raise BrokerUnavailable(f"{redact(self.url)}: {type(exc).__name__}: {exc}") from exc
            self.backoff.reset()
            self.connected.set()
            log.info("consumer: consuming %s", ", ".join(s.queue for s in self.subscriptions))
            while not stop.is_set():
                try:
                    conn.drain_events(timeout=_POLL)
                except TimeoutError:
                    pass
                except errors as exc:
                    raise BrokerUnavailable(f"{type(exc).__name__}: {exc}") from exc
                try:
                    conn.heartbeat_check()
                    self._requeue_due()
                except errors as exc:
                    raise BrokerUnavailable(f"{type(exc).__name__}: {exc}") from exc
        finally:
            self._delayed.clear()  # held deliveries return to the queue with the channel
            try:
                conn.release()
            except Exception:  # already broken: nothing to close cleanly
                pass

    def _callback(self, sub: Subscription) -> Callable[[Any, Any], None]:
        def on_message(body: Any, message: Any) -> None:
            properties = message.properties or {}
            delivery = Delivery.from_body(
                body,
                message_id=properties.get("message_id"),
                type=properties.get("type"),
                headers=message.headers or {},
                redelivered=bool(message.delivery_info.get("redelivered")),
            )

            def dead_letter(delivery: Delivery, result: Result, error: str) -> None:
                self._dead_letter(sub, message, result, error)

            result = sub.guard.handle(delivery, app=self.app, dead_letter=dead_letter)
            self.counts[result.outcome.value] += 1
            if result.outcome.acknowledge:
                message.ack()
            else:
                due = time.monotonic() + result.delay
                heapq.heappush(self._delayed, (due, next(self._seq), message))

        return on_message

    def _decode_error(self, sub: Subscription) -> Callable[[Any, Exception], None]:
        def on_decode_error(message: Any, exc: Exception) -> None:
            log.error("consumer %s: undecodable message: %s", sub.queue, type(exc).__name__)
            result = Result(ConsumerOutcome.DEAD_LETTERED, reason="undecodable")
            self._dead_letter(sub, message, result, f"{type(exc).__name__}"[:500])
            self.counts[ConsumerOutcome.DEAD_LETTERED.value] += 1
            message.ack()

        return on_decode_error

    def _requeue_due(self) -> None:
        now = time.monotonic()
        while self._delayed and self._delayed[0][0] <= now:
            _, _, message = heapq.heappop(self._delayed)
            message.requeue()
            self.counts["requeued"] += 1

    def _dead_letter(self, sub: Subscription, message: Any, result: Result, error: str) -> None:
        """Copy ``message`` to ``sub``'s dead-letter queue and wait for the confirm.

        On a connection of its own: waiting for a confirm on the consuming
        connection would dispatch new deliveries into this one's handling.
        """
        kombu = _kombu()
        if self._dl_conn is None:
            self._dl_conn = connect(self.url, timeout=self.timeout)
        properties = message.properties or {}
        headers = dict(message.headers or {})
        headers.update(
            {
                "x-idempotency-dead-letter-reason": result.reason or "",
                "x-idempotency-attempts": result.attempts,
                "x-idempotency-error": error,
                "x-idempotency-queue": sub.queue,
            }
        )
        try:
            producer = kombu.Producer(self._dl_conn.default_channel)
            producer.publish(
                message.body,
                exchange="",
                routing_key=sub.dead_letter_queue,
                content_type=message.content_type,
                content_encoding=message.content_encoding,
                message_id=properties.get("message_id"),
                type=properties.get("type"),
                headers=headers,
                delivery_mode=2,
                timeout=self.timeout,
                confirm_timeout=self.timeout,
            )
        except Exception:
            self._close_dead_letter_connection()
            raise

    def _close_dead_letter_connection(self) -> None:
        conn, self._dl_conn = self._dl_conn, None
        if conn is not None:
            try:
                conn.release()
            except Exception:  # a dead socket: nothing left to close cleanly
                pass
