"""The response cache interface: copies of completed responses, never claims.

A cache may be wiped or unreachable at any time; it only ever saves a trip to
PostgreSQL. Implementations swallow their own errors (a failure is a miss).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ..store.base import StoredResponse


@dataclasses.dataclass(frozen=True)
class CachedRecord:
    fingerprint: bytes
    response: StoredResponse


class ResponseCache:
    """What the extension asks of a cache; by itself, no cache: every lookup is a
    miss and every request goes to PostgreSQL (the cache without Redis)."""

    def get(self, record_key: bytes) -> CachedRecord | None:
        return None

    def put(
        self, record_key: bytes, fingerprint: bytes, response: StoredResponse, ttl: float
    ) -> None:
        return None

    def evict(self, record_keys: Sequence[bytes]) -> None:
        return None

    def ping(self) -> None:
        """Raise if the cache does not answer (health checks; the request path
        never needs it: a failing cache is a miss)."""
        return None

    def prepare(self) -> None:
        """Read now what the cache needs from PostgreSQL (the database's identity),
        while it answers: a worker whose first request comes during a PostgreSQL
        outage can then still replay from Redis. Best effort, never raises."""
        return None

    def close(self) -> None:
        return None
