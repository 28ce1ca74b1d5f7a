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
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from datetime import datetime, timedelta, timezone
from typing import Any, NoReturn

from . import one_process, schema
from .base import (
    Claimed,
    ClaimResult,
    Existing,
    LeaseHold,
    LeaseLostError,
    RecordInfo,
    State,
    StoredResponse,
)
from .handle import RequestHandle
from .sql import new_token

#: The URL that selects this store.
MEMORY_URL = "memory://"
#: Claims between two sweeps of expired records: each sweep reads every record once,
#: so its cost per claim stays constant however many records there are.
SWEEP_EVERY = 1024

_NO_CONNECTION = (
    "IDEMPOTENCY_DATABASE_URL is memory://: there is no database connection or "
    "transaction (idempotency.connection(), transaction(), emit() and db= need "
    "PostgreSQL); keep the view's own writes elsewhere, or use a PostgreSQL URL"
)


def is_memory_url(url: str | None) -> bool:
    """Whether ``url`` selects the in-memory store."""
    return url is not None and url.strip().lower() == MEMORY_URL


def no_connection() -> NoReturn:
    """What every database-only entry point does under ``memory://``."""
    raise RuntimeError(_NO_CONNECTION)


@dataclasses.dataclass
class _Record:
    fingerprint: bytes
    state: State
    token: int | None
    created_at: float
    expires_at: float
    lease_expires_at: float | None
    response: StoredResponse | None = None
    completed_at: float | None = None
    phases: list[tuple[str, Any]] = dataclasses.field(default_factory=list)


class MemoryStore:
    """The records of one process, behind one lock; ``clock`` is seconds (monotonic)
    so tests can move it instead of sleeping."""

    #: Requests hold no pooled connection: nothing to size or observe.
    pool = None
    claim_mode = "row"

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._base_clock = clock
        self._offset = 0.0
        self._lock = threading.Lock()
        self._records: dict[bytes, _Record] = {}
        self._claims_since_sweep = 0
        self._guard = one_process.Guard("IDEMPOTENCY_DATABASE_URL = memory://")
        #: Never a problem: there is no schema to forget (``schema.py``).
        self.schema = schema.SchemaWatch(lambda: None)

    def _clock(self) -> float:
        return self._base_clock() + self._offset

    def advance(self, seconds: float) -> None:
        """Move this store's clock ``seconds`` forward: a test expires leases and
        records this way instead of sleeping past them."""
        with self._lock:
            self._offset += seconds

    # -- what a request's handle does ---------------------------------------

    def claim(
        self, record_key: bytes, fingerprint: bytes, *, lease: float, ttl: float
    ) -> ClaimResult:
        """The PostgreSQL claim's rules: a new or expired key is ours; a processing
        record of the same request whose lease ran out is taken over (its phases
        kept); anything else is ``Existing``."""
        self._guard.check()
        with self._lock:
            now = self._clock()
            self._sweep(now)
            record = self._records.get(record_key)
            live = record is not None and record.expires_at > now
            if record is not None and live:
                dead_holder = (
                    record.state == "processing"
                    and record.lease_expires_at is not None
                    and record.lease_expires_at <= now
                    and record.fingerprint == fingerprint
                )
                if not dead_holder:
                    return Existing(
                        state=record.state,
                        fingerprint=record.fingerprint,
                        response=record.response,
                        lease_remaining=(
                            record.lease_expires_at - now
                            if record.lease_expires_at is not None
                            else None
                        ),
                        ttl_remaining=record.expires_at - now,
                    )
            phases = list(record.phases) if record is not None and live else []
            token = new_token()
            self._records[record_key] = _Record(
                fingerprint=fingerprint,
                state="processing",
                token=token,
                created_at=now,
                expires_at=now + ttl,
                lease_expires_at=now + lease,
                phases=phases,
            )
            return Claimed(token, tuple(phases), takeover=live)

    def _sweep(self, now: float) -> None:
        """Forget expired records now and then (under the lock): nothing else would in
        a development server that runs for days, since no command reaches its memory."""
        self._claims_since_sweep += 1
        if self._claims_since_sweep < SWEEP_EVERY:
            return
        self._claims_since_sweep = 0
        for key in [k for k, r in self._records.items() if r.expires_at <= now]:
            del self._records[key]

    def _held(self, record_key: bytes, token: int) -> _Record:
        """Our processing record (under the lock), or ``LeaseLostError`` (fencing)."""
        record = self._records.get(record_key)
        if record is None or record.token != token or record.state != "processing":
            raise LeaseLostError()
        return record

    def complete(self, record_key: bytes, token: int, response: StoredResponse) -> None:
        self._guard.check()
        with self._lock:
            record = self._held(record_key, token)
            now = self._clock()
            record.state, record.response, record.completed_at = "completed", response, now
            record.token = record.lease_expires_at = None
            # As migration 0009: the claim's expiry stands unless the view took
            # more than a tenth of the TTL; an answer lives 0.9 TTL after it is stored.
            ttl = record.expires_at - record.created_at
            record.expires_at = max(record.expires_at, now + ttl * 0.9)
            record.phases = []

    def checkpoint(self, record_key: bytes, token: int, phase: str, data: Any) -> None:
        with self._lock:
            self._held(record_key, token).phases.append((phase, data))

    def release(self, record_key: bytes, token: int, *, keep_phases: bool) -> None:
        """Give the claim up: forget the record, or (it has recovery points) end its
        lease at once so the next identical request resumes after them."""
        with self._lock:
            record = self._records.get(record_key)
            if record is None or record.token != token or record.state != "processing":
                return
            if keep_phases and record.phases:
                record.token, record.lease_expires_at = None, self._clock()
            else:
                del self._records[record_key]

    # -- what the app's parts use of a store -----------------------------------

    def begin(self) -> MemoryRequest:
        self._guard.check()
        return MemoryRequest(self)

    def renew(self, holds: Sequence[LeaseHold]) -> int:
        """The lease keeper's renewal: the same rule as PostgreSQL's ``RENEW``."""
        count = 0
        with self._lock:
            now = self._clock()
            for hold in holds:
                record = self._records.get(hold.record_key)
                if record is None or record.token != hold.token or record.state != "processing":
                    continue
                record.lease_expires_at = now + hold.lease
                record.expires_at = max(record.expires_at, now + hold.lease)
                count += 1
        return count

    def prepare_renewals(self) -> None:
        """Nothing to open."""

    def migrate(self, extra_dirs: Sequence[str] = ()) -> list[str]:
        """No schema: nothing to apply."""
        return []

    def pending_migrations(self, extra_dirs: Sequence[str] = ()) -> list[str]:
        return []

    def check_schema_at_start(self) -> None:
        """No schema to check."""

    def ping(self) -> None:
        """Always answers (in the process that created it)."""
        self._guard.check()

    def transaction(self) -> AbstractContextManager[Any]:
        no_connection()

    def count_expired(self) -> int:
        with self._lock:
            now = self._clock()
            return sum(1 for r in self._records.values() if r.expires_at <= now)

    def purge(self, batch_size: int) -> Iterator[list[bytes]]:
        """Forget expired records, ``batch_size`` at a time."""
        while True:
            with self._lock:
                now = self._clock()
                doomed = [k for k, r in self._records.items() if r.expires_at <= now]
                doomed = doomed[:batch_size]
                for key in doomed:
                    del self._records[key]
            if not doomed:
                return
            yield doomed

    def info(self, record_key: bytes) -> RecordInfo | None:
        with self._lock:
            record = self._records.get(record_key)
            if record is None:
                return None
            now = self._clock()
            wall = datetime.now(timezone.utc)

            def at(moment: float | None) -> datetime | None:
                return None if moment is None else wall + timedelta(seconds=moment - now)

            response = record.response
            return RecordInfo(
                state=record.state,
                created_at=wall - timedelta(seconds=now - record.created_at),
                expires_at=wall + timedelta(seconds=record.expires_at - now),
                completed_at=at(record.completed_at),
                lease_expires_at=at(record.lease_expires_at),
                status=response.status if response is not None else None,
                body=response.body if response is not None else None,
                headers=response.headers if response is not None else (),
                age_seconds=now - record.created_at,
                expired=record.expires_at <= now,
            )

    def unlock(self, record_key: bytes) -> bool:
        """End a processing record's lease now (``flask idempotency unlock``)."""
        with self._lock:
            record = self._records.get(record_key)
            if record is None or record.state != "processing":
                return False
            record.token, record.lease_expires_at = None, self._clock()
            return True

    def stats(self) -> dict[str, float]:
        with self._lock:
            now = self._clock()
            live = [r for r in self._records.values() if r.expires_at > now]
            return {
                "processing": sum(1 for r in live if r.state == "processing"),
                "completed": sum(1 for r in live if r.state == "completed"),
                "expired": len(self._records) - len(live),
            }

    def close(self) -> None:
        with self._lock:
            self._records.clear()


class MemoryRequest(RequestHandle):
    """One request's handle on the memory store: the claim, then complete or release.
    There is no transaction: a release forgets the claim, and the view's own writes
    (kept elsewhere) are the view's to undo. The keeper renews the claim's lease
    while the view runs, as in row mode (``holds_lease``)."""

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
        result = self._store.claim(record_key, fingerprint, lease=lease, ttl=ttl)
        if isinstance(result, Claimed):
            self.has_progress = bool(result.phases)
        return result

    def complete(self, record_key: bytes, token: int, response: StoredResponse) -> None:
        """Store the answer; ``LeaseLostError`` if the record was taken over."""
        self._store.complete(record_key, token, response)

    def checkpoint(self, record_key: bytes, token: int, phase: str, data_json: str) -> None:
        self._store.checkpoint(record_key, token, phase, json.loads(data_json))
        self.has_progress = True

    def release(self, record_key: bytes, token: int) -> None:
        self._store.release(record_key, token, keep_phases=self.has_progress)

    def connection(self) -> Any:
        no_connection()

    def count_recovered(self) -> None:
        no_connection()

    def rollback(self) -> None:
        """No transaction to roll back."""

    def commit(self) -> None:
        """No transaction to commit."""

    def close(self) -> None:
        """Nothing held."""
