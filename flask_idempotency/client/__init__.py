"""The client half: HTTP calls that keep their ``Idempotency-Key`` across retries.

``pip install flask-idempotency[client]``. The retry rules live in ``policy``
(no HTTP library); ``IdempotentSession``/``IdempotentAdapter`` are for
``requests``, ``IdempotentTransport``/``AsyncIdempotentTransport`` for ``httpx``,
each imported on first use so that either library alone is enough.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .budget import RetryBudget
from .hooks import CallEvent
from .keys import purpose_key
from .policy import CallOutcome, KeyReused, RetryPolicy

if TYPE_CHECKING:
    from .httpx_transport import AsyncIdempotentTransport, IdempotentTransport
    from .requests_adapter import IdempotentAdapter, IdempotentSession

__all__ = [
    "AsyncIdempotentTransport",
    "CallEvent",
    "CallOutcome",
    "IdempotentAdapter",
    "IdempotentSession",
    "IdempotentTransport",
    "KeyReused",
    "RetryBudget",
    "RetryPolicy",
    "purpose_key",
]

_LAZY = {
    "IdempotentAdapter": "requests_adapter",
    "IdempotentSession": "requests_adapter",
    "IdempotentTransport": "httpx_transport",
    "AsyncIdempotentTransport": "httpx_transport",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
