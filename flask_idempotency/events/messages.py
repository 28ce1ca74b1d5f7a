"""What a consumer and its transport say to each other: the message as a handler
sees it (:class:`Delivery`), what the guard decided (:class:`Result`, whose
:class:`ConsumerOutcome` tells the transport to ack or requeue) and the options
``@idempotency.consumer`` takes.

Apart from ``consumer.py`` because they change for another reason: a transport
(kombu, Celery, an application's own) is written against these, while the
guard's claim, run and settle change with the attempt lifecycle.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

from ..route_options import seconds
from ..store.base import StoredResponse


class ConsumerOutcome(enum.Enum):
    HANDLED = "handled"
    DUPLICATE = "duplicate"
    BUSY = "busy"
    FENCED = "fenced"
    RETRY = "retry"
    DEAD_LETTERED = "dead_lettered"

    @property
    def acknowledge(self) -> bool:
        """Whether the transport acknowledges the delivery (else: requeue after ``delay``)."""
        return self not in (ConsumerOutcome.BUSY, ConsumerOutcome.RETRY)


@dataclasses.dataclass(frozen=True)
class Result:
    outcome: ConsumerOutcome
    #: Seconds before the delivery is requeued (``BUSY`` and ``RETRY``).
    delay: float = 0.0
    #: Why it was dead-lettered or retried (``handler_failed``, ``key_reused``, ...).
    reason: str | None = None
    #: Attempts of this message so far, this one included (when the handler ran).
    attempts: int = 0
    #: The completed record: the one this attempt stored (``HANDLED``) or found
    #: (``DUPLICATE``); what
    #: :meth:`~flask_idempotency.events.consumer.ConsumerGuard.stored_record` made of a
    #: return value.
    stored: StoredResponse | None = None
    #: The handler's exception, when it raised (``RETRY`` or ``DEAD_LETTERED`` with
    #: ``handler_failed``): a transport with a retry policy of its own re-raises it.
    error: Exception | None = None


@dataclasses.dataclass(frozen=True)
class Delivery:
    """One message as a handler sees it, whatever the transport."""

    #: The message id (the event id for events from the relay).
    id: str | None
    #: The event type (the AMQP ``type`` property, or the envelope's ``type``).
    type: str | None
    #: The event's data (the envelope's ``data``), else the whole decoded body.
    payload: Any
    #: The emitting record's derived key (``digests.derived_key(record, "events")``).
    derived_key: str | None = None
    headers: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    redelivered: bool = False
    #: The decoded body as received (the whole envelope for relay events).
    body: Any = None

    @classmethod
    def from_body(
        cls,
        body: Any,
        *,
        message_id: str | None = None,
        type: str | None = None,
        headers: Mapping[str, Any] | None = None,
        redelivered: bool = False,
    ) -> Delivery:
        """From a decoded body; a relay envelope (``{"id", "type", "data", ...}``) is
        unwrapped, and its id is the fallback message id."""
        payload, derived_key = body, None
        if isinstance(body, dict) and "data" in body and "id" in body:
            message_id, type = message_id or str(body["id"]), type or body.get("type")
            payload, derived_key = body["data"], body.get("derived_key")
        return cls(message_id, type, payload, derived_key, dict(headers or {}), redelivered, body)

    def fingerprint(self) -> bytes:
        """What "the same message" means: its canonical JSON body (a re-publish of
        the same event is identical; another message under a reused id is not)."""
        try:
            canonical = json.dumps(self.body, sort_keys=True, separators=(",", ":"))
        except (TypeError, ValueError):
            canonical = repr(self.body)
        return hashlib.sha256(canonical.encode("utf-8", "surrogateescape")).digest()


Handler = Callable[[Delivery], Any]
KeyFunc = Callable[[Delivery], str | None]
#: Copies a message to the dead-letter queue (confirmed); raising means it was not.
DeadLetter = Callable[[Delivery, Result, str], None]


def message_id_key(delivery: Delivery) -> str | None:
    return delivery.id


@dataclasses.dataclass(frozen=True)
class ConsumerOptions:
    name: str
    key: KeyFunc = message_id_key
    #: Attempts before a failing message is dead-lettered (the N of the README);
    #: ``None``: no limit (a Celery task's retries are Celery's to count).
    max_attempts: int | None = 5
    #: ``None``: the app's ``IDEMPOTENCY_LEASE`` / ``IDEMPOTENCY_TTL``.
    lease: float | None = None
    ttl: float | None = None
    #: Backoff after a failed attempt: ``retry_delay * 2**(attempt - 1)``, capped.
    retry_delay: float = 1.0
    max_retry_delay: float = 60.0
    #: Longest wait before a delivery held by another consumer is tried again.
    busy_delay: float = 1.0
    #: Earlier attempts lost without finishing (their process died, or outlived its
    #: lease) after which a takeover gives the message up instead of running it
    #: (:meth:`ConsumerGuard.worker_losses`); ``None``: no such limit.
    #: ``@idempotency.consumer`` sets it to ``max_attempts``: every attempt counts.
    max_worker_losses: int | None = None


def consumer_options(
    name: str,
    *,
    key: KeyFunc | None,
    max_attempts: int | None,
    lease: float | timedelta | None,
    ttl: float | timedelta | None,
    retry_delay: float | timedelta,
    max_retry_delay: float | timedelta,
    busy_delay: float | timedelta,
    max_worker_losses: int | None = None,
) -> ConsumerOptions:
    if not name or not isinstance(name, str):
        raise ValueError("an idempotency consumer needs a name (it scopes its records)")
    if key is not None and not callable(key):
        raise ValueError("idempotency consumer option key= must be callable")
    for option, count in (("max_attempts", max_attempts), ("max_worker_losses", max_worker_losses)):
        if count is None:
            continue  # no limit
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"idempotency consumer option {option}= must be an integer >= 1")
    option = "idempotency consumer option "
    return ConsumerOptions(
        name=name,
        key=key or message_id_key,
        max_attempts=max_attempts,
        lease=seconds(option + "lease", lease),
        ttl=seconds(option + "ttl", ttl),
        retry_delay=seconds(option + "retry_delay", retry_delay) or 1.0,
        max_retry_delay=seconds(option + "max_retry_delay", max_retry_delay) or 60.0,
        busy_delay=seconds(option + "busy_delay", busy_delay) or 1.0,
        max_worker_losses=max_worker_losses,
    )
