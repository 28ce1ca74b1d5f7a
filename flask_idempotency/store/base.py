"""The storage interface, in domain words, and the records it hands back.

The decision logic (``flow.py``) and the Flask layer (``extension.py``) only
see these types; driver errors are translated at the store's boundary into
:class:`StoreUnavailableError` (the caller fails closed).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from datetime import datetime
from typing import Any, Literal, Protocol

State = Literal["processing", "completed"]


class StoreUnavailableError(Exception):
    """The database could not be reached or failed: the request must not run."""


class BreakerOpenError(StoreUnavailableError):
    """Refused without trying PostgreSQL: the store's circuit breaker is open (or
    opened while the request waited for a connection). The breaker logs its
    opening once; each request it refuses is no news of its own."""


class SchemaMismatchError(StoreUnavailableError):
    """The database answers but lacks the extension's schema, or part of it.

    A skipped deployment step (``flask idempotency migrate``), not an outage:
    retrying cannot help, so the Flask layer answers it as a non-retryable
    ``500`` (``schema_missing`` / ``schema_outdated``), not ``503``. It is a
    ``StoreUnavailableError`` so that every caller that fails closed on an
    outage (the completer, the consumer, the CLI) fails closed on it too.
    """

    def __init__(self, detail: str = "", *, missing: bool = True) -> None:
        super().__init__(detail)
        #: No schema at all (never migrated), rather than an older one.
        self.missing = missing
        self.detail = detail


class LeaseLostError(Exception):
    """Our claim was taken over after its lease expired: our completion is refused."""


@dataclasses.dataclass(frozen=True)
class StoredResponse:
    """A response as data (never a pickled object): status, headers, body bytes."""

    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes


@dataclasses.dataclass(frozen=True)
class Claimed:
    """We own the key: run the view, then complete or release with ``token``."""

    token: int
    #: The recovery points a dead holder of this request committed, in order, as
    #: ``(name, data)`` pairs: the view resumes after them (``phases.py``).
    phases: tuple[tuple[str, Any], ...] = ()
    #: The record was a live one whose holder's lease had run out (not a new or
    #: expired key): this claim took a dead holder's attempt over.
    takeover: bool = False


@dataclasses.dataclass(frozen=True)
class Existing:
    """Someone else owns (or owned) the key."""

    state: State
    fingerprint: bytes
    response: StoredResponse | None
    #: Seconds until a processing record's lease ends (may be negative).
    lease_remaining: float | None = None
    #: Seconds until the record expires (for caching a completed response).
    ttl_remaining: float | None = None


ClaimResult = Claimed | Existing


def phases_of(column: Any) -> tuple[tuple[str, Any], ...]:
    """The recovery points a record's ``phases`` column holds, in order."""
    return tuple((str(name), data) for name, data in column or ())


@dataclasses.dataclass(frozen=True)
class LeaseHold:
    """One in-flight claim, as the lease keeper renews it."""

    record_key: bytes
    token: int
    lease: float


@dataclasses.dataclass(frozen=True)
class RecordInfo:
    """What ``flask idempotency show`` prints about one record."""

    state: State
    created_at: datetime
    expires_at: datetime
    completed_at: datetime | None
    lease_expires_at: datetime | None
    status: int | None
    body: bytes | None
    headers: tuple[tuple[str, str], ...]
    age_seconds: float
    expired: bool


class Store(Protocol):
    """What the lease keeper needs of a durable store (``lease.py``)."""

    def renew(self, holds: Sequence[LeaseHold]) -> int:
        """Renew ``holds`` on a connection that no request holds (the keeper's own)."""
        ...

    def prepare_renewals(self) -> None:
        """Open the renewal connection ahead of time (best effort, never raises)."""
        ...


@dataclasses.dataclass(frozen=True)
class Taken:
    """An abandoned record the completer took over (``PostgresStore.take_over``)."""

    record_key: bytes
    fingerprint: bytes
    token: int
    #: What the route's claim kept for recovery (``recovery.capture``).
    recovery: bytes
    phases: tuple[tuple[str, Any], ...]
    abandoned_seconds: float
