"""Durable storage of idempotency records (PostgreSQL)."""

from .base import (
    Claimed,
    ClaimResult,
    Existing,
    LeaseHold,
    LeaseLostError,
    RecordInfo,
    Store,
    StoredResponse,
    StoreUnavailableError,
)
from .postgres import PostgresStore

__all__ = [
    "Claimed",
    "ClaimResult",
    "Existing",
    "LeaseHold",
    "LeaseLostError",
    "PostgresStore",
    "RecordInfo",
    "Store",
    "StoreUnavailableError",
    "StoredResponse",
]
