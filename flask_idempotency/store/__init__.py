"""Durable storage of idempotency records (PostgreSQL; ``memory://`` for tests)."""

from .base import LeaseLostError, StoredResponse, StoreUnavailableError
from .postgres import PostgresStore

__all__ = ["LeaseLostError", "PostgresStore", "StoreUnavailableError", "StoredResponse"]
