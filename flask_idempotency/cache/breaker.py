"""The Redis cache's circuit breaker: the package's one (``flask_idempotency.circuit``).

Each failing Redis call costs up to the socket timeout; once the breaker is open
requests skip Redis and go straight to PostgreSQL, which is what they would do on
a cache miss anyway.
"""

from __future__ import annotations

from ..circuit import BreakerState, CircuitBreaker, Transition

__all__ = ["BreakerState", "CircuitBreaker", "Transition"]
