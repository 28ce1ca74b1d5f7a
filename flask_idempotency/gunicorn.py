"""gunicorn helpers: warn when a worker has more threads than database connections.

Each in-flight idempotent request holds one connection of the extension's pool
from its claim to its completion. A gthread worker with more threads than the
pool's size (``IDEMPOTENCY_DATABASE_OPTIONS["pool_size"]``, or db's engine's)
makes the extra requests queue for a connection (and answer ``503`` after the
pool's timeout). In your gunicorn.conf.py::

    from flask_idempotency.gunicorn import post_worker_init  # noqa: F401

or, if you have a ``post_worker_init`` of your own, call
``check_worker(worker)`` from it. The check logs a WARNING (through gunicorn's
logger) when the pool is smaller than ``threads``; it never changes a setting.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from flask import Flask

from .state import find_app_state

log = logging.getLogger("flask_idempotency")


class _Logger(Protocol):
    def warning(self, msg: str, *args: Any) -> None: ...


def find_flask_app(wsgi: Any) -> Flask | None:
    """The Flask app behind a WSGI callable: itself, or one a middleware wraps
    (``.app``, ``.application``, ``.wsgi_app``), a few levels deep."""
    seen: set[int] = set()
    todo = [wsgi]
    while todo:
        candidate = todo.pop()
        if candidate is None or id(candidate) in seen or len(seen) > 20:
            continue
        seen.add(id(candidate))
        if isinstance(candidate, Flask):
            return candidate
        for name in ("app", "application", "wsgi_app", "__self__"):
            todo.append(getattr(candidate, name, None))
    return None


def pool_capacity(app: Flask) -> tuple[int, str] | None:
    """How many requests the app's idempotency pool can serve at once, and the
    setting that decides it; ``None`` if the app does not use the extension."""
    state = find_app_state(app)
    if state is None or state.store.pool is None:  # (memory:// holds no connections)
        return None
    return state.store.pool.capacity()


def check_pool_size(app: Flask, threads: int, log: _Logger = log) -> bool:
    """Warn (and return False) if fewer connections than ``threads`` serve requests."""
    found = pool_capacity(app)
    if found is None:
        return True
    capacity, source = found
    if capacity >= threads:
        return True
    log.warning(
        "idempotency: %s allows %d database connection(s) for %d worker threads; every "
        "in-flight idempotent request holds one, so the others wait for one (and answer 503 "
        "when the pool's timeout passes). Raise it to at least %d "
        "(plus one per idempotency.transaction() a view opens).",
        source,
        capacity,
        threads,
        threads,
    )
    return False


def check_worker(worker: Any) -> bool:
    """``check_pool_size`` for a gunicorn worker: its app and ``cfg.threads``."""
    app = find_flask_app(getattr(worker, "wsgi", None))
    if app is None:
        return True
    threads = int(getattr(worker.cfg, "threads", 1) or 1)
    return check_pool_size(app, threads, getattr(worker, "log", log))


def post_worker_init(worker: Any) -> None:
    """gunicorn's ``post_worker_init`` hook: runs in each worker once its app is loaded."""
    check_worker(worker)
