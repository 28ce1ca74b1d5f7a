"""Every statement on the extension's tables, and how its parameters are built.

The one place SQL on ``idempotency_records`` is written: the request path
(``request.py``), the store's maintenance (``postgres.py``),
the completer and the consumer guard all run these, under the store's
``SET LOCAL`` timeouts and client-side deadline.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any

from .base import StoredResponse

LEASE_LOST_SQLSTATE = "IK409"
#: The row-mode claim's INSERT of a key another claimer inserted since its read
#: (migration 0012): the claim is asked again.
UNIQUE_VIOLATION = "23505"

#: Seconds past the statement timeout after which the client stops waiting for any
#: answer and shuts the connection down (see ``watchdog.py``).
CLIENT_DEADLINE_GRACE = 1.0

#: Row mode's claim: takes the key, or reads the record that holds it, in one
#: statement (migration 0012 has the function and why it reads first). The
#: columns: claimed, state, fingerprint, status, headers, body, seconds of lease
#: and of TTL left, the recovery points of a dead holder taken over, and whether
#: a live record was taken over. No row: the record appeared or vanished under
#: it, and the caller asks again. The recovery payload is NULL except for routes
#: that declare ``recover=`` (``recovery.py``). A dead holder is "of the same
#: request" when its fingerprint is ours compared the way it was written
#: (``fingerprint.matches``): byte for byte, or, for a record a release before
#: 0.3.0 wrote (32 bytes), against the v0 digest inside our v1 fingerprint (the
#: function's ``as_written_before``, :func:`written_before` in Python), so a
#: worker that died on the previous release is taken over by this one.
#: The store's lock timeout and whether the claim may commit asynchronously are
#: written into the text (``Statements.build``): the function sets them for
#: itself, so no ``SET LOCAL`` is parsed and run before it, and a replay is this
#: one statement.
CLAIM = (
    "SELECT * FROM idempotency_claim_v2("
    "%(key)s, %(fp)s, %(token)s::bigint, %(lease)s::float8, %(ttl)s::float8, %(recovery)s::bytea, "
    "{lock_timeout}, {async_commit})"
)

#: Row mode's completion: fills the processing row in with the answer, fenced by
#: the lock token (``IK409`` once taken over; the transaction then aborts and the
#: ``COMMIT`` after it never runs). It changes no column an index names, so
#: PostgreSQL updates the row on its page: a HOT update (migration 0009). The
#: lock timeout is an argument, as the claim's (migration 0012).
COMPLETE = (
    "SELECT idempotency_complete_v2(%s, %s::bigint, %s::smallint, %s::jsonb, %s, {lock_timeout})"
)

#: ``claim_mode = "transaction"`` (migrations 0005 and 0007): the business
#: transaction opens with the claim, under two advisory locks, in one round trip;
#: the completed record is inserted by the view's own COMMIT. No processing row,
#: no lease. Advisory locks and reads work on a read-only server (a hot standby,
#: one with ``default_transaction_read_only``), so the claim function first
#: checks ``transaction_read_only`` and raises SQLSTATE 25006 there, before
#: anything is claimed or any view runs (a 503, and the connection is replaced),
#: as the row-mode claim's INSERT does.
CLAIM_IN_TRANSACTION = "BEGIN;\nSELECT * FROM idempotency_claim_in_transaction_rw(%s, %s, %s)"
INSERT_COMPLETED = (
    "SELECT idempotency_insert_completed_v2("
    "%s, %s, %s, %s::smallint, %s::jsonb, %s, {lock_timeout})"
)

RELEASE = "DELETE FROM idempotency_records WHERE record_key = %s AND lock_token = %s"
#: End our lease at once and keep the record (its lock token cleared): the release
#: of a record that holds committed recovery points (migration 0006), and the
#: completer's "cannot tell yet" hand-back. For the release:
#: those phases' writes are committed, so the record is kept with them and only
#: our lease ends, at once. The next identical request, or ``flask idempotency
#: recover``, takes it over and resumes after the last phase instead of redoing it.
END_LEASE = """
UPDATE idempotency_records SET lock_token = NULL, lease_expires_at = now()
 WHERE record_key = %s AND lock_token = %s AND state = 'processing'
"""
#: A recovery point (``phases.py``): the phase's writes and the record's progress
#: commit together, fenced like the completion (``IK409`` once taken over).
CHECKPOINT = "SELECT idempotency_checkpoint(%s, %s::bigint, %s, %s::jsonb)"

#: Renew every in-flight lease of this process in one statement. A live record
#: never expires under its holder: a view slower than its TTL would otherwise be
#: taken over by any request (an expired record is absent) and deleted by purge.
RENEW = """
UPDATE idempotency_records AS r
   SET lease_expires_at = now() + make_interval(secs => h.lease),
       expires_at = greatest(r.expires_at, now() + make_interval(secs => h.lease))
  FROM unnest(%s::bytea[], %s::bigint[], %s::float8[]) AS h(record_key, token, lease)
 WHERE r.record_key = h.record_key AND r.lock_token = h.token AND r.state = 'processing'
"""

#: Purge in batches so no long lock is held; SKIP LOCKED lets a concurrent
#: purge (or a takeover) proceed without waiting.
PURGE_BATCH = """
WITH doomed AS (
    SELECT record_key FROM idempotency_records
     WHERE expires_at <= now()
     ORDER BY expires_at
     LIMIT %s
     FOR UPDATE SKIP LOCKED
)
DELETE FROM idempotency_records r USING doomed
 WHERE r.record_key = doomed.record_key
RETURNING r.record_key
"""

INFO = """
SELECT state, created_at, expires_at, completed_at, lease_expires_at, status_code, body,
       headers, extract(epoch FROM now() - created_at)::float8, expires_at <= now()
  FROM idempotency_records WHERE record_key = %s
"""
#: Table-wide figures for ``flask idempotency stats``.
STATS = """
SELECT count(*) FILTER (WHERE state = 'processing' AND expires_at > now()),
       count(*) FILTER (WHERE state = 'completed' AND expires_at > now()),
       count(*) FILTER (WHERE expires_at <= now()),
       count(*) FILTER (WHERE state = 'processing' AND lease_expires_at <= now()
                        AND expires_at > now()),
       coalesce(max(extract(epoch FROM now() - created_at))
                FILTER (WHERE state = 'processing'), 0)::float8,
       coalesce(sum(takeovers), 0)
  FROM idempotency_records
"""
UNLOCK = "DELETE FROM idempotency_records WHERE record_key = %s AND state = 'processing'"


# -- the completer (``completer.py``): abandoned attempts of ``recover=`` routes

#: The pass's horizon, on the server's clock: records abandoned before it.
PASS_CUTOFF = "SELECT now() - make_interval(secs => %s)"

#: Take a batch of abandoned records over: each gets one of our lock tokens and a
#: fresh lease, committed at once, so a client's retry now gets ``409`` and any
#: late completion of the dead holder is refused. ``SKIP LOCKED``: completers
#: running side by side take disjoint batches, and the lease is checked again
#: under the row lock, so a record a client's retry just took is left alone.
#: The candidates come from the index of records with ``recovery`` (migration
#: 0009): only ``recover=`` attempts in flight or abandoned, sorted here.
TAKE_OVER = """
WITH candidates AS (
    SELECT record_key, lease_expires_at FROM idempotency_records
     WHERE state = 'processing' AND recovery IS NOT NULL
       AND lease_expires_at <= %(cutoff)s AND expires_at > now()
     ORDER BY lease_expires_at
     LIMIT %(limit)s
     FOR UPDATE SKIP LOCKED
), numbered AS (
    SELECT record_key, lease_expires_at, row_number() OVER () AS n FROM candidates
)
UPDATE idempotency_records AS r
   SET lock_token = (%(tokens)s::bigint[])[numbered.n],
       lease_expires_at = now() + make_interval(secs => %(lease)s),
       expires_at = greatest(r.expires_at, now() + make_interval(secs => %(lease)s)),
       takeovers = r.takeovers + 1
  FROM numbered
 WHERE r.record_key = numbered.record_key
   AND r.state = 'processing' AND r.lease_expires_at <= now()
RETURNING r.record_key, r.fingerprint, r.lock_token, r.recovery, r.phases,
          extract(epoch FROM now() - numbered.lease_expires_at)::float8
"""
#: "Nothing happened" after committed recovery points: their writes stand, so the
#: record stays for a client's retry to resume, and the completer stops trying it.
RELEASE_TO_CLIENT = """
UPDATE idempotency_records SET lock_token = NULL, lease_expires_at = now(), recovery = NULL
 WHERE record_key = %s AND lock_token = %s AND state = 'processing'
"""
#: One more record the completer recovered or released, for ``stats``.
BUMP_RECOVERY_TOTAL = """
INSERT INTO idempotency_recovery_totals AS t (outcome, total, last_at)
VALUES (%s, 1, now())
ON CONFLICT (outcome) DO UPDATE SET total = t.total + 1, last_at = now()
"""
#: ``flask idempotency stats``: abandoned records now, and the completer's totals.
RECOVERY_STATS = """
SELECT count(*), count(*) FILTER (WHERE recovery IS NOT NULL),
       coalesce(max(extract(epoch FROM now() - lease_expires_at)), 0)::float8,
       (SELECT coalesce(sum(total) FILTER (WHERE outcome = 'recovered'), 0)
          FROM idempotency_recovery_totals),
       (SELECT coalesce(sum(total) FILTER (WHERE outcome = 'released'), 0)
          FROM idempotency_recovery_totals)
  FROM idempotency_records
 WHERE state = 'processing' AND lease_expires_at <= now() AND expires_at > now()
"""

# -- the consumer guard (``events/consumer.py``): failed attempts of a message

ATTEMPTS_SO_FAR = """
SELECT takeovers FROM idempotency_records
 WHERE record_key = %s AND lock_token = %s AND state = 'processing'
"""


def timeouts_sql(statement_timeout: float, lock_timeout: float) -> str:
    """``SET LOCAL`` of both timeouts, sent first in the same round trip as the
    extension's maintenance statements (release, lease renewal, recovery points,
    health checks): they end with that statement's transaction."""
    statement_ms = max(1, round(statement_timeout * 1000))
    lock_ms = max(1, round(lock_timeout * 1000)) if lock_timeout > 0 else 0
    return f"SET LOCAL statement_timeout TO {statement_ms};\nSET LOCAL lock_timeout TO {lock_ms};\n"


def lock_timeout_arg(statement_timeout: float, lock_timeout: float) -> str:
    """The lock timeout the request path's functions set for themselves (0012), as
    a SQL literal in milliseconds. Those functions run with no statement timeout
    of their own (it cannot be set for a statement already running): their only
    server-side wait is for a row lock, so ``lock_timeout = 0`` ("wait up to the
    statement timeout") passes the statement timeout, and the client's deadline
    (``watchdog.py``) bounds everything else."""
    seconds = lock_timeout if lock_timeout > 0 else statement_timeout
    return f"'{max(1, round(seconds * 1000))}'"


@dataclasses.dataclass(frozen=True)
class Statements:
    """The request path's texts, for one store's settings, each sent as one round
    trip: the claim, completion and completed record are one call each of a schema
    function that sets its own lock timeout; a recovery point, and every other
    statement (a release, a renewal, a health check, maintenance), starts with the
    store's ``SET LOCAL`` :attr:`timeouts`. A request adds only what its
    transaction's state needs: ``BEGIN`` before a completion or a recovery point
    when the view opened none (``COMMIT`` must end a transaction), ``ROLLBACK``
    before a release when it did."""

    claim: str
    complete: str
    insert_completed: str
    checkpoint: str
    #: ``SET LOCAL`` of both timeouts (:func:`timeouts_sql`), sent before the others.
    timeouts: str

    @classmethod
    def build(cls, settings: Any) -> Statements:
        """The texts for ``settings`` (``settings.Settings``: the statement and lock
        timeouts, ``async_claim_commit``)."""
        timeouts = timeouts_sql(settings.statement_timeout, settings.lock_timeout)
        lock = lock_timeout_arg(settings.statement_timeout, settings.lock_timeout)
        async_commit = "true" if settings.async_claim_commit else "false"
        return cls(
            claim=CLAIM.replace("{lock_timeout}", lock).replace("{async_commit}", async_commit),
            complete=COMPLETE.replace("{lock_timeout}", lock) + ";\nCOMMIT",
            insert_completed=INSERT_COMPLETED.replace("{lock_timeout}", lock) + ";\nCOMMIT",
            # The view's transaction so far commits with the recovery point, and the
            # next one opens in the same round trip.
            checkpoint=timeouts + CHECKPOINT + ";\nCOMMIT;\nBEGIN",
            timeouts=timeouts,
        )


def new_token() -> int:
    """A random positive 63-bit fencing token (from ``os.urandom``, as ``secrets``)."""
    return (int.from_bytes(os.urandom(8), "big") >> 1) or 1


def headers_from_json(raw: Any) -> tuple[tuple[str, str], ...]:
    return tuple((str(k), str(v)) for k, v in (raw or ()))


def response_params(response: StoredResponse) -> tuple[int, str, Any]:
    """A stored answer as the completion statements take it: the status, the header
    pairs as a JSON array of arrays (each statement casts it to jsonb), the body."""
    return response.status, json.dumps(response.headers), response.body


def written_before(fingerprint: bytes) -> bytes:
    """The claim function's ``as_written_before`` (migration 0010) in Python
    (``fingerprint.written_before``, which the store's layer may not import)."""
    if len(fingerprint) == 49 and fingerprint[:1] == b"\x01":  # v1, unambiguous
        return fingerprint[1:33]
    return fingerprint


def advisory_locks(record_key: bytes, fingerprint: bytes) -> tuple[int, int]:
    """The request's and the key's advisory lock ids: signed 64-bit digests, so
    distinct keys collide with odds of 2**-64 (and then only answer a spurious 409).

    The request's lock is taken on the fingerprint as the previous release wrote
    it (:func:`written_before`), the one its workers lock: a retry that reaches a
    new worker while the same request runs on an old one is a ``409``, never a
    ``422`` that tells the client its request differs. The price: the same bytes
    under another media type, while the first still runs, are a ``409`` too, and
    a ``422`` once it has finished (its stored fingerprint compares in full)."""
    request = hashlib.sha256(record_key + b"\x00" + written_before(fingerprint)).digest()
    return (
        int.from_bytes(request[:8], "big", signed=True),
        int.from_bytes(record_key[:8], "big", signed=True),
    )


#: A background worker (``relay``, ``completer``) reports a run: one row per kind,
#: the last report winning (``heartbeat.py``; ``flask idempotency doctor`` reads it).
HEARTBEAT = """
INSERT INTO idempotency_heartbeats (worker, last_run_at, seen_on) VALUES (%s, now(), %s)
ON CONFLICT (worker) DO UPDATE SET last_run_at = now(), seen_on = EXCLUDED.seen_on
"""
#: Seconds since each kind of worker last reported, by the server's clock.
LAST_RUNS = """
SELECT worker, extract(epoch FROM now() - last_run_at)::float8, seen_on
  FROM idempotency_heartbeats
"""
