"""The server's worker processes as the extension sees them.

Two questions, asked from inside a worker: does each thread of it find a
database connection (each in-flight idempotent request holds one of the
extension's pool from its claim to its completion, so a gthread worker with
more threads than ``IDEMPOTENCY_DATABASE_OPTIONS["pool_size"]`` makes the extra
requests queue, then answer ``503``), and how many worker processes serve the
app (per-process figures such as Prometheus' need adding up when there are
several). gunicorn's hooks that use them are in :mod:`flask_idempotency.gunicorn`;
this module imports no server and runs anywhere.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import traceback
from collections.abc import Iterator
from types import FrameType
from typing import Any

from flask import Flask

from .state import find_app_state

log = logging.getLogger("flask_idempotency")


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


def check_pool_size(app: Flask, threads: int, log: Any = log) -> bool:
    """Warn (and return False) if fewer connections than ``threads`` serve requests;
    ``log``: anything with a ``warning(msg, *args)`` (gunicorn's worker log)."""
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


def gunicorn_workers() -> int | None:
    """How many worker processes the gunicorn running this process keeps, or ``None``
    when this process is not gunicorn's (or it cannot tell).

    gunicorn publishes no such figure to its workers, but its arbiter is on their
    stack: a worker is forked inside ``Arbiter.spawn_worker`` and runs its whole
    life under that call, and with ``preload_app`` the master imports the app under
    ``Arbiter.setup``. So the arbiter is found as the ``self`` of a frame of this
    thread or of the main thread (where a gthread worker's loop runs). Under gevent
    or eventlet, asked from a request's greenlet, the main stack is not reachable:
    ``None``, as for a server that is not gunicorn (uWSGI, waitress, mod_wsgi).
    """
    if not os.environ.get("SERVER_SOFTWARE", "").startswith("gunicorn/"):
        return None  # set by gunicorn's arbiter, inherited by its workers
    arbiter_class = getattr(sys.modules.get("gunicorn.arbiter"), "Arbiter", None)
    if arbiter_class is None:
        return None
    for frame in _stacks():
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, arbiter_class):
            return int(getattr(candidate, "num_workers", None) or candidate.cfg.workers)
    return None


def _stacks() -> Iterator[FrameType]:
    """Every frame of this thread's stack, then of the main thread's."""
    yield from (frame for frame, _ in traceback.walk_stack(None))
    main = sys._current_frames().get(threading.main_thread().ident or 0)
    if main is not None:
        yield from (frame for frame, _ in traceback.walk_stack(main))
