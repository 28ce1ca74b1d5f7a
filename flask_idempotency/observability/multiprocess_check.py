"""Say so when Prometheus metrics are served by one of several workers, each alone.

Without prometheus-client's multiprocess mode every worker of a multi-process
server keeps its own figures, and a scrape shows whichever worker answered it:
the counters jump back and forth and nothing looks wrong. This check logs an
ERROR once in each such process and sets the
``flask_idempotency_metrics_multiprocess_misconfigured`` gauge to 1, so an alert
can catch it. It knows gunicorn only (:func:`~flask_idempotency.workers.gunicorn_workers`);
under another multi-process server (uWSGI, mod_wsgi) it stays silent.
"""

from __future__ import annotations

import logging
import os
import threading

from ..workers import gunicorn_workers
from .table_stats import MULTIPROC_ENV

log = logging.getLogger("flask_idempotency.observability")

_lock = threading.Lock()
#: The process that last logged (a forked worker logs again; its parent's log is not its own).
_logged_in: int | None = None


def misconfigured(multiprocess: bool) -> bool:
    """Whether this process is one of several gunicorn workers exporting only its own
    figures (``multiprocess``: prometheus-client's mode); logs an ERROR once per process."""
    global _logged_in
    if multiprocess:
        return False
    workers = gunicorn_workers()
    if workers is None or workers < 2:
        return False
    with _lock:
        if _logged_in == os.getpid():
            return True
        _logged_in = os.getpid()
    reason = (
        f"{MULTIPROC_ENV} is set but prometheus_client was imported before it was"
        if os.environ.get(MULTIPROC_ENV)
        else f"{MULTIPROC_ENV} is not set"
    )
    log.error(
        "Prometheus metrics are served by one of gunicorn's %d workers without "
        "prometheus-client's multiprocess mode (%s): each scrape shows only the figures "
        "of the worker that answers it. Add to gunicorn.conf.py: from "
        "flask_idempotency.gunicorn import child_exit, on_exit, on_starting, "
        "post_worker_init (docs: observability).",
        workers,
        reason,
    )
    return True
