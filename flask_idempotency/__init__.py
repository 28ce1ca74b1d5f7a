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
    SchemaMissing,
    SchemaOutdated,
    ScopeUnavailable,
    StoreUnavailable,
)
from .extension import Idempotency
from .recovery import Abandoned
from .scopes import authorization_scope, default_scope, global_scope, user_scope
from .settings import default_should_store

#: The release; pyproject.toml reads it from here (the one place it is written).
__version__ = "0.2.0"

__all__ = [
    "Abandoned",
    "Idempotency",
    "IdempotencyError",
    "InvalidKey",
    "KeyReused",
    "LeaseLost",
    "MalformedBody",
    "MissingKey",
    "RequestInProgress",
    "ResponseTooLarge",
    "SchemaMissing",
    "SchemaOutdated",
    "ScopeUnavailable",
    "StoreUnavailable",
    "authorization_scope",
    "default_scope",
    "default_should_store",
    "global_scope",
    "user_scope",
]
