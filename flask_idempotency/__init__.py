"""flask-idempotency: Idempotency-Key support for Flask, PostgreSQL-first.

The first request with a key runs and its response is stored; every retry gets
that response back, byte for byte, and the view never runs twice.
"""

from .errors import (
    IdempotencyError,
    InvalidKey,
    KeyReused,
    LeaseLost,
    MalformedBody,
    MissingKey,
    RequestInProgress,
    ResponseTooLarge,
    StoreUnavailable,
)
from .extension import Idempotency
from .settings import NOT_STORED_STATUSES, Settings, default_should_store

__all__ = [
    "NOT_STORED_STATUSES",
    "Idempotency",
    "IdempotencyError",
    "InvalidKey",
    "KeyReused",
    "LeaseLost",
    "MalformedBody",
    "MissingKey",
    "RequestInProgress",
    "ResponseTooLarge",
    "Settings",
    "StoreUnavailable",
    "default_should_store",
]
