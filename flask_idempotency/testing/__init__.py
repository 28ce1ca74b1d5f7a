"""Test helpers for applications that use flask-idempotency.

``assert_idempotent(url, json=..., headers=...)`` proves through real HTTP that
concurrent duplicates of a request run its view once; ``serve_app(app)`` (or
the ``idempotency_live_server`` fixture) gives it a threaded server to talk to.
The pytest plugin (``pip install 'flask-idempotency[pytest]'``, see
:mod:`flask_idempotency.testing.pytest_plugin`) adds throwaway, migrated
databases built on pytest-postgresql.

Loading the pytest plugin (which imports this package) stays cheap: these
modules import nothing but the standard library and the package itself;
psycopg2, pytest-postgresql and werkzeug's server wait until a helper runs.
"""

from __future__ import annotations

from .assertions import assert_idempotent
from .databases import IdempotencyDatabase
from .live_server import serve_app

#: What a test calls; what they return (``IdempotencyReport``, ``LiveServer``) is
#: documented in its module.
__all__ = ["IdempotencyDatabase", "assert_idempotent", "serve_app"]
