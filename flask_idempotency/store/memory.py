"""``IDEMPOTENCY_DATABASE_URL = "memory://"``: the records in this process's memory.

For unit tests and local development, the way Flask-Limiter offers
``memory://``: no PostgreSQL to start, the same answers as the PostgreSQL
store within one process (claims, ``409`` while running, ``422`` for a reused
key, byte-for-byte replays, TTL expiry, leases, takeover and fencing, scopes,
nothing stored for a 5xx). Not for production: the records live and die with
the process, two processes would each answer the same key as new, and there is
no transaction for a view's own writes (``idempotency.connection()`` raises).

All state sits behind one lock; every operation is a few dictionary steps
under it, so a threaded server sees each claim, completion and release as
atomic, as PostgreSQL's single statements are. The store refuses to run in a
process other than the one that created it (``one_process.py``).
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Sequence
from typing import Any, NoReturn

from . import one_process, schema
from .base import (
    Claimed,
    ClaimResult,
    Existing,
    LeaseHold,
    LeaseLostError,
    State,
    StoredResponse,
)
from .sql import new_token

#: Claims between two sweeps of expired records: each sweep reads every record once,
#: so its cost per claim stays constant however many records there are.
SWEEP_EVERY = 1024


def is_memory_url(url: str | None) -> bool:
    """Whether ``url`` selects the in-memory store."""
    return url is not None and url.strip().lower() == "memory://"


def no_connection(*args: Any) -> NoReturn:
    """What every database-only entry point does under ``memory://``."""
    raise RuntimeError(
        "IDEMPOTENCY_DATABASE_URL is memory://: there is no database connection or "
        "transaction (idempotency.connection(), transaction(), emit() and db= need "
        "PostgreSQL); keep the view's own writes elsewhere, or use a PostgreSQL URL"
    )


@dataclasses.dataclass
class _Record:
    fingerprint: bytes
    state: State
    token: int | None
    created_at: float
    expires_at: float
    lease_expires_at: float | None
    response: StoredResponse | None = None
    phases: list[tuple[str, Any]] = dataclasses.field(default_factory=list)


class MemoryStore:
    """The records of one process, behind one lock, on the monotonic clock, which
    tests move (:meth:`advance`) instead of sleeping."""

    #: Requests hold no pooled connection: nothing to size or observe.
    pool = None
    claim_mode = "row"
    #: No transaction outside a request either; and nothing for the commands that
    #: read or change records (``cli.target`` answers for them under ``memory://``).
    transaction = info = unlock = purge = count_expired = no_connection

    def __init__(self) -> None:
        self._offset = 0.0
        self._lock = threading.Lock()
        self._records: dict[bytes, _Record] = {}
        self._claims_since_sweep = 0
        self._guard = one_process.Guard("IDEMPOTENCY_DATABASE_URL = memory://")
        #: Never a problem: there is no schema to forget (``schema.py``).
        self.schema = schema.SchemaWatch(lambda: None)

    def _clock(self) -> float:
        return time.monotonic() + self._offset

    def advance(self, seconds: float) -> None:
        """Move this store's clock ``seconds`` forward: a test expires leases and
        records this way instead of sleeping past them."""
        with self._lock:
            self._offset += seconds

    def _sweep(self, now: float) -> None:
        """Forget expired records now and then (under the lock): nothing else would in
        a development server that runs for days, since no command reaches its memory."""
        self._claims_since_sweep += 1
        if self._claims_since_sweep >= SWEEP_EVERY:
            self._claims_since_sweep = 0
            self._records = {k: r for k, r in self._records.items() if r.expires_at > now}

    def _held(self, record_key: bytes, token: int | None) -> _Record | None:
        """Our processing record under ``token`` (under the lock), else ``None``."""
        record = self._records.get(record_key)
        if record is None or record.token != token or record.state != "processing":
            return None
        return record

    def begin(self) -> MemoryRequest:
        self._guard.check()
        return MemoryRequest(self)

    def renew(self, holds: Sequence[LeaseHold]) -> int:
        """The lease keeper's renewal: the same rule as PostgreSQL's ``RENEW``."""
        count = 0
        with self._lock:
            now = self._clock()
            for hold in holds:
                record = self._held(hold.record_key, hold.token)
                if record is not None:
                    record.lease_expires_at = now + hold.lease
                    record.expires_at = max(record.expires_at, now + hold.lease)
                    count += 1
        return count

    def prepare_renewals(self) -> None:
        """Nothing to open."""

    def migrate(self, extra_dirs: Sequence[str] = ()) -> list[str]:
        """No schema: nothing to apply, nothing pending."""
        return []

    pending_migrations = migrate

    def ping(self) -> None:
        """Always answers (in the process that created it)."""
        self._guard.check()

    def stats(self) -> dict[str, float]:
        with self._lock:
            now = self._clock()
            live = [r.state for r in self._records.values() if r.expires_at > now]
            return {
                "processing": live.count("processing"),
                "completed": live.count("completed"),
                "expired": len(self._records) - len(live),
            }

    def close(self) -> None:
        with self._lock:
            self._records.clear()


class MemoryRequest:
    """One request's handle on the memory store: the claim, then complete or release,
    each a few dictionary steps under the store's lock. There is no transaction: a
    release forgets the claim, and the view's own writes (kept elsewhere) are the
    view's to undo. The keeper renews the claim's lease while the view runs, as in
    row mode (``holds_lease``)."""

    #: The keeper renews the claim's lease, as in row mode.
    holds_lease = True
    #: Set by the engine as on a PostgreSQL handle; here the record's own recovery
    #: points (resumed by the claim, or committed since) decide a release.
    has_progress = False
    #: No connection or transaction (``idempotency.connection()`` raises).
    connection = count_recovered = no_connection

    def __init__(self, store: MemoryStore) -> None:
        self._store = store

    def claim(
        self,
        record_key: bytes,
        fingerprint: bytes,
        *,
        lease: float,
        ttl: float,
        recovery: bytes | None = None,
    ) -> ClaimResult:
        """The PostgreSQL claim's rules: a new or expired key is ours; a processing
        record of the same request whose lease ran out is taken over (its phases
        kept); anything else is ``Existing``."""
        store = self._store
        store._guard.check()
        with store._lock:
            now = store._clock()
            store._sweep(now)
            record = store._records.get(record_key)
            live = record is not None and record.expires_at > now
            phases: list[tuple[str, Any]] = []
            if record is not None and live:
                lease_end = record.lease_expires_at
                if not (
                    record.state == "processing"
                    and lease_end is not None
                    and lease_end <= now
                    and record.fingerprint == fingerprint
                ):
                    return Existing(
                        record.state,
                        record.fingerprint,
                        record.response,
                        lease_remaining=None if lease_end is None else lease_end - now,
                        ttl_remaining=record.expires_at - now,
                    )
                phases = list(record.phases)  # a dead holder's: resumed
            token = new_token()
            store._records[record_key] = _Record(
                fingerprint, "processing", token, now, now + ttl, now + lease, phases=phases
            )
        return Claimed(token, tuple(phases), takeover=live)

    def complete(self, record_key: bytes, token: int, response: StoredResponse) -> None:
        """Store the answer; ``LeaseLostError`` if the record was taken over."""
        self._store._guard.check()
        with self._store._lock:
            record = self._store._held(record_key, token)
            if record is None:
                raise LeaseLostError()
            now = self._store._clock()
            record.state, record.response = "completed", response
            record.token = record.lease_expires_at = None
            # As migration 0009: the claim's expiry stands unless the view took
            # more than a tenth of the TTL; an answer lives 0.9 TTL after it is stored.
            ttl = record.expires_at - record.created_at
            record.expires_at = max(record.expires_at, now + ttl * 0.9)
            record.phases = []

    def checkpoint(self, record_key: bytes, token: int, phase: str, data_json: str) -> None:
        with self._store._lock:
            record = self._store._held(record_key, token)
            if record is None:
                raise LeaseLostError()
            record.phases.append((phase, json.loads(data_json)))

    def release(self, record_key: bytes, token: int) -> None:
        """Give the claim up: forget the record, or (it has recovery points) end its
        lease at once so the next identical request resumes after them."""
        with self._store._lock:
            record = self._store._held(record_key, token)
            if record is not None and record.phases:
                record.token, record.lease_expires_at = None, self._store._clock()
            elif record is not None:
                del self._store._records[record_key]

    def rollback(self) -> None:
        """No transaction to roll back."""

    commit = close = rollback
