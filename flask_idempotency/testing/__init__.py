"""Test helpers for applications that use flask-idempotency.

``assert_idempotent(url, json=..., headers=...)`` proves through real HTTP that
concurrent duplicates of a request run its view once; ``serve_app(app)`` (or
the ``idempotency_live_server`` fixture) gives it a threaded server to talk to.
The pytest plugin (``pip install 'flask-idempotency[pytest]'``, see
:mod:`flask_idempotency.testing.pytest_plugin`) adds throwaway, migrated
databases built on pytest-postgresql.

The names below are imported on first use, so that loading the pytest plugin
(which imports this package) stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .assertions import assert_idempotent
    from .databases import IdempotencyDatabase
    from .live_server import serve_app

#: What a test calls; what they return (``IdempotencyReport``, ``LiveServer``) is
#: documented in its module.
__all__ = ["IdempotencyDatabase", "assert_idempotent", "serve_app"]

_HOMES = {
    "assert_idempotent": "assertions",
    "IdempotencyDatabase": "databases",
    "serve_app": "live_server",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
