"""One log event per request outcome, on the ``flask_idempotency.requests`` logger.

Levels follow what an on-call engineer acts on:

- ``DEBUG``: the normal course of things: an answer stored or replayed, an
  attempt released, a keyless or safe-method pass-through, and requests refused
  for their own input before anything was claimed (``missing_key``,
  ``invalid_key``, ``missing_scope``, ``malformed_body``, ``body_too_large``);
- ``INFO``: concurrency worth knowing about: a duplicate while the first was
  running (``in_progress``), a key reused with another request, a takeover of a
  dead holder's record, a lease lost to such a takeover;
- ``WARNING``: PostgreSQL failed and the request was refused (``store_unavailable``);
  one the store's open circuit breaker refused without trying is ``INFO``: the
  breaker logs its opening and closing itself;
  a request refused for a missing or outdated schema is ``INFO``: the store logs
  that problem itself, once, as an ``ERROR`` naming the command that fixes it
  (``flask_idempotency.store``), rather than once per request;
- ``ERROR``: an answer that should have been stored could not be (``not_storable``).

Each record carries the event's fields as ``extra`` attributes (``route``,
``method``, ``outcome``, ``source``, ``status``, ``takeover``, ``key_digest``,
``scope_digest``, ``duration_ms``, ``claim_ms``, ``completion_ms``, ``error``),
so a JSON formatter gets them as fields. Never the raw key, the scope or a body.

The other parts log on loggers of their own (``flask_idempotency.store``,
``.cache``, ``.lease``, ``.events``), so a flapping Redis can be silenced alone::

    logging.getLogger("flask_idempotency.cache").setLevel(logging.ERROR)
"""

from __future__ import annotations

import logging
from typing import Any

from .observer import RequestEvent, RequestOutcome

log = logging.getLogger("flask_idempotency.requests")

#: Each outcome's level: DEBUG but for those listed.
LEVELS: dict[RequestOutcome, int] = {
    **dict.fromkeys(RequestOutcome, logging.DEBUG),
    RequestOutcome.IN_PROGRESS: logging.INFO,
    RequestOutcome.KEY_REUSED: logging.INFO,
    RequestOutcome.LEASE_LOST: logging.INFO,
    RequestOutcome.SCHEMA_MISSING: logging.INFO,
    RequestOutcome.SCHEMA_OUTDATED: logging.INFO,
    RequestOutcome.STORE_UNAVAILABLE: logging.WARNING,
    RequestOutcome.NOT_STORABLE: logging.ERROR,
}

#: A takeover is worth an INFO line even when its request then went well.
TAKEOVER_LEVEL = logging.INFO

#: A request the store's open circuit breaker refused without trying PostgreSQL:
#: the breaker logged its opening as a WARNING (``flask_idempotency.store``); a
#: frozen server under load would otherwise write a WARNING per request.
BREAKER_REFUSAL_LEVEL = logging.INFO


def log_event(event: RequestEvent, level: int) -> None:
    """Write ``event`` at ``level`` (the caller checked the level is enabled)."""
    parts = [f"idempotency: {event.outcome.value}"]
    if event.source is not None:
        parts.append(f"from {event.source}")
    if event.takeover:
        parts.append("(took over a record whose lease had expired)")
    parts.append("%s %s")
    args: list[Any] = [event.method, event.route]
    duration = None if event.duration is None else event.duration * 1000
    optional = (("-> %d", event.status), ("key %s", event.key_digest), ("in %.1f ms", duration))
    for text, value in optional:
        if value is not None:
            parts.append(text)
            args.append(value)
    message = " ".join(parts)
    if event.error is not None:
        message += ": %s"
        args.append(event.error)
    # The event as LogRecord attributes (none of them clash with logging's own).
    extra = {
        "route": event.route,
        "method": event.method,
        "outcome": event.outcome.value,
        "source": event.source,
        "status": event.status,
        "takeover": event.takeover,
        "key_digest": event.key_digest,
        "scope_digest": event.scope_digest,
        "duration_ms": _ms(event.duration),
        "claim_ms": _ms(event.claim_duration),
        "completion_ms": _ms(event.completion_duration),
        "error": event.error,
    }
    log.log(level, message, *args, extra=extra)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)
