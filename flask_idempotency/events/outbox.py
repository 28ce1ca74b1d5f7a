"""The transactional outbox: ``idempotency.emit()`` and the rows the relay reads.

An event is a row of ``idempotency_outbox`` written on the connection of the
transaction that also stores the request's answer (or a consumer's
completion), so it exists exactly when that transaction commits: a released,
rolled-back or fenced attempt leaves nothing, and a replay runs no view and so
emits nothing again. Publishing is the relay's job (``relay.py``), at least
once; consumers recognise a re-publish by the event's id (``consumer.py``).

Where an event is written, innermost first:

* inside ``with idempotency.transaction()``: on that transaction's connection
  (bound in a context variable for the block);
* inside an idempotent request or a consumer's handler: on
  ``idempotency.connection()``, together with the record's completion;
* on an ``optional`` route called without a key: on the same keyless
  transaction, committed only when the answer is one that would be stored.

An event's id is ``evt_`` and 32 hex digits of SHA-256 over its record's key,
the fencing token of the attempt that emitted it and its position in that
attempt. Only one attempt of a record can commit, so the id is unique even
when a key is reused after its TTL; it never changes once written, and every
publish of the row carries it as the message id. An event emitted outside a
record (keyless route, ``transaction()``) gets a random id.
"""

from __future__ import annotations

import contextvars
import dataclasses
import hashlib
import json
import re
import secrets
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

from flask import g

from .. import digests
from ..route_options import seconds

#: ``derived_key`` purpose of the key an event carries (``digests.derived_key``).
DERIVED_KEY_PURPOSE = "events"

#: AMQP routing keys are at most 255 bytes; event types become routing keys.
_EVENT_TYPE = re.compile(r"[A-Za-z0-9_.:\-]{1,255}\Z")

INSERT_EVENT = """
INSERT INTO idempotency_outbox (id, record_key, derived_key, event_type, payload, expires_at)
VALUES (%s, %s, %s, %s, %s::jsonb, now() + make_interval(secs => %s))
"""

#: The relay's batch. ``SKIP LOCKED``: relays running side by side take disjoint
#: batches instead of queueing on each other's row locks; the partial index on
#: ``seq`` holds pending rows only.
CLAIM_BATCH = """
SELECT id, event_type, payload::text, derived_key,
       floor(extract(epoch FROM created_at))::bigint, attempts
  FROM idempotency_outbox
 WHERE published_at IS NULL AND available_at <= now()
 ORDER BY seq
 LIMIT %s
 FOR UPDATE SKIP LOCKED
"""
MARK_PUBLISHED = """
UPDATE idempotency_outbox SET published_at = now(), attempts = attempts + 1
 WHERE id = ANY(%(ids)s)
"""
#: A publish the broker refused or could not route: counted, and left alone for a
#: while that doubles with each attempt (capped), so one event that no queue
#: takes never holds up the rest.
MARK_DEFERRED = """
UPDATE idempotency_outbox
   SET attempts = attempts + 1,
       available_at = now() + make_interval(secs => least(%(cap)s, %(base)s * power(2, attempts)))
 WHERE id = ANY(%(ids)s)
"""
#: Rows a relay took but could not publish because the broker went away: the
#: attempt is counted, and they are free for the next try at once.
MARK_ATTEMPTED = "UPDATE idempotency_outbox SET attempts = attempts + 1 WHERE id = ANY(%(ids)s)"

PURGE_BATCH = """
WITH doomed AS (
    SELECT id FROM idempotency_outbox
     WHERE published_at IS NOT NULL AND expires_at <= now()
     ORDER BY expires_at
     LIMIT %s
     FOR UPDATE SKIP LOCKED
)
DELETE FROM idempotency_outbox o USING doomed WHERE o.id = doomed.id
"""
#: Every figure of the outbox in one pass: ``due`` is what a relay would take now
#: (pending and not deferred), ``expired`` what a purge would delete.
COUNTS = """
SELECT count(*) FILTER (WHERE published_at IS NULL),
       count(*) FILTER (WHERE published_at IS NOT NULL),
       coalesce(max(extract(epoch FROM now() - created_at))
                FILTER (WHERE published_at IS NULL), 0)::float8,
       count(*) FILTER (WHERE published_at IS NULL AND available_at <= now()),
       count(*) FILTER (WHERE published_at IS NOT NULL AND expires_at <= now())
  FROM idempotency_outbox
"""


@dataclasses.dataclass(frozen=True)
class OutboxEvent:
    """One row as the relay publishes it."""

    id: str
    type: str
    #: The payload's JSON text, as PostgreSQL normalised it (the same on every publish).
    payload_json: str
    derived_key: str | None
    #: Unix seconds of the emission.
    created: int
    attempts: int

    def envelope(self) -> bytes:
        """The message body: ``{"id", "type", "created", "derived_key", "data"}``,
        byte for byte the same on every publish of the row."""
        head = dict(id=self.id, type=self.type, created=self.created, derived_key=self.derived_key)
        text = json.dumps(head, separators=(",", ":"))  # ``data`` goes in as PostgreSQL wrote it
        return f'{text[:-1]},"data":{self.payload_json}}}'.encode()


def event_id(record_key: bytes | None, token: int | None, ordinal: int) -> str:
    """The id of the ``ordinal``-th event of the attempt holding ``token`` on ``record_key``."""
    if record_key is None or token is None:
        return "evt_" + secrets.token_hex(16)
    material = record_key + b"%d:%d" % (token, ordinal)
    return "evt_" + hashlib.sha256(b"outbox\x00" + material).hexdigest()[:32]


def check_event_type(event_type: str) -> None:
    if not isinstance(event_type, str) or not _EVENT_TYPE.match(event_type):
        raise ValueError(
            "an event type is 1 to 255 characters of letters, digits and '_.:-' "
            f"(it becomes the routing key), got {event_type!r}"
        )


@dataclasses.dataclass
class EmitScope:
    """Where events of one transaction come from: its record (if any) and attempt."""

    record_key: bytes | None
    token: int | None
    #: Seconds a published event is kept: the record's TTL unless ``emit(ttl=)``.
    default_ttl: float
    emitted: int = 0

    def emit(self, conn: Any, event_type: str, payload: Any, ttl: float | timedelta | None) -> str:
        check_event_type(event_type)
        # Serialised here, so a payload that is not JSON fails in the view (which
        # then raises and is released), never at commit or in the relay.
        body = json.dumps(payload, separators=(",", ":"), allow_nan=False)
        eid = event_id(self.record_key, self.token, self.emitted)
        key = self.record_key
        derived = None if key is None else digests.derived_key(key, DERIVED_KEY_PURPOSE)
        keep = seconds("an event's ttl", ttl) or self.default_ttl
        with conn.cursor() as cur:
            cur.execute(INSERT_EVENT, (eid, key, derived, event_type, body, keep))
        self.emitted += 1
        return eid


#: The innermost ``transaction()`` block's connection and its scope, if any
#: (``bound_transaction.get()``).
bound_transaction: contextvars.ContextVar[tuple[Any, EmitScope] | None] = contextvars.ContextVar(
    "flask_idempotency_outbox", default=None
)


@contextmanager
def bind(conn: Any, default_ttl: float) -> Iterator[None]:
    """Send ``emit()`` to ``conn`` for the block (``idempotency.transaction()``)."""
    token = bound_transaction.set((conn, EmitScope(None, None, default_ttl)))
    try:
        yield
    finally:
        bound_transaction.reset(token)


def request_scope(record_key: bytes | None, token: int | None, ttl: float) -> EmitScope:
    """The current request's (or consumer handler's) scope, kept on ``g`` so the
    events of one attempt are numbered in order."""
    scope: EmitScope | None = g.get("_idempotency_outbox")
    if scope is None or scope.record_key != record_key or scope.token != token:
        scope = EmitScope(record_key, token, ttl)
        g._idempotency_outbox = scope
    return scope


# -- what the relay and the CLI run -------------------------------------------


def claim_batch(conn: Any, size: int) -> list[OutboxEvent]:
    with conn.cursor() as cur:
        cur.execute(CLAIM_BATCH, (size,))
        rows = cur.fetchall()
    return [OutboxEvent(r[0], r[1], r[2], r[3], int(r[4]), int(r[5])) for r in rows]


def mark(conn: Any, statement: str, ids: Sequence[str], **params: float) -> None:
    """Run one of the ``MARK_*`` statements on the rows ``ids`` (none: nothing to run)."""
    if ids:
        with conn.cursor() as cur:
            cur.execute(statement, {"ids": list(ids), **params})


def purge_batches(store: Any, batch_size: int) -> Iterator[int]:
    """Delete published events past their expiry, a batch per transaction, yielding
    each committed batch's count (the CLI's progress)."""
    while True:
        with store.transaction() as conn, conn.cursor() as cur:
            cur.execute(PURGE_BATCH, (batch_size,))
            count = int(cur.rowcount)
        if count:
            yield count
        if count < batch_size:
            return


def counts(store: Any) -> dict[str, float]:
    """``pending``, ``published``, ``oldest_pending_seconds``, ``due`` (``relay
    --once``'s total) and ``expired`` (``purge``'s): the doctor, table stats, the CLI."""
    with store.transaction() as conn, conn.cursor() as cur:
        cur.execute(COUNTS)
        row = cur.fetchone()
    names = ("pending", "published", "oldest_pending_seconds", "due", "expired")
    return {name: float(value) for name, value in zip(names, row, strict=True)}
