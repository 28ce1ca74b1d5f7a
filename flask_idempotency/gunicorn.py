"""gunicorn's hooks for an app that uses the extension: one import in gunicorn.conf.py.

::

    # gunicorn.conf.py
    from flask_idempotency.gunicorn import child_exit, on_exit, on_starting, post_worker_init

(or ``from flask_idempotency.gunicorn import *``, which imports those four names).
They do two jobs:

- **Prometheus across workers.** prometheus-client's multiprocess mode adds up
  every worker's figures, whichever worker answers the scrape: each writes its
  values to files in ``PROMETHEUS_MULTIPROC_DIR``. ``on_starting`` (in the master,
  before any worker is forked) empties the directory you set of an earlier run's
  files, or makes a fresh one when you set none; ``child_exit`` drops a dead
  worker's live gauges (``mark_process_dead``), its counters stay; ``on_exit``
  removes the directory it made. Without prometheus-client they do nothing.
- **The pool against the threads.** ``post_worker_init`` logs a WARNING when a
  worker has more threads than the extension's pool has connections
  (:func:`check_worker`).

gunicorn reads one function per hook name. If your gunicorn.conf.py has a hook
of its own with one of these names, call ours from it instead of importing the
name::

    from flask_idempotency import gunicorn as idempotency_hooks

    def on_starting(server):
        idempotency_hooks.on_starting(server)
        ...  # yours

With ``preload_app = True`` the master imports the app, and so prometheus-client,
before ``on_starting`` runs: set ``PROMETHEUS_MULTIPROC_DIR`` in the environment
instead (``on_starting`` still empties it). ``on_starting`` logs an ERROR when
it finds prometheus-client imported too early.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from .workers import check_pool_size as check_pool_size  # documented here too (api.md)
from .workers import check_worker as check_worker

__all__ = ["child_exit", "on_exit", "on_starting", "post_worker_init"]

#: The variable prometheus-client's multiprocess mode reads when it is imported.
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
#: ``<pid>:<made|kept>:<directory>``: the master that prepared the directory, and
#: whether it made it (and so removes it on exit) or kept the one it was given. In
#: the environment, not a global: a HUP re-reads gunicorn.conf.py.
_PREPARED_ENV = "FLASK_IDEMPOTENCY_METRICS_DIR_PREPARED"


def on_starting(server: Any) -> None:
    """Prepare the Prometheus multiprocess directory (master, before the fork)."""
    directory = prepare_metrics_dir()
    if directory is None:
        return
    server.log.info("prometheus multiprocess directory: %s", directory)
    # Imported here, with the variable set, rather than first in child_exit: gunicorn
    # calls child_exit from its SIGCHLD handler, and two workers dying together would
    # re-enter a half-done import there (an ImportError that stops the master).
    import prometheus_client.multiprocess  # noqa: F401

    from .observability.prometheus import multiprocess_mode

    if not multiprocess_mode():
        server.log.error(
            "flask_idempotency: prometheus_client was imported before %s was set "
            "(preload_app?): each worker will export only its own figures. Set %s in "
            "the environment gunicorn starts with.",
            MULTIPROC_ENV,
            MULTIPROC_ENV,
        )


def child_exit(server: Any, worker: Any) -> None:
    """A worker is gone (ended, killed or replaced): drop its live gauges (claims in
    flight, pool use) from the sums; its counters stay, so no request it counted is lost."""
    directory = os.environ.get(MULTIPROC_ENV, "").strip()
    if directory and _has_prometheus_client():
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(worker.pid, directory)  # type: ignore[no-untyped-call]


def on_exit(server: Any) -> None:
    """Remove the directory ``on_starting`` made (never one you set)."""
    remove_metrics_dir()


def post_worker_init(worker: Any) -> None:
    """Warn when the worker's threads outnumber the pool's connections."""
    check_worker(worker)


def prepare_metrics_dir() -> Path | None:
    """``$PROMETHEUS_MULTIPROC_DIR`` emptied of an earlier run's files (their counters
    would be added to this run's), or a fresh directory made and exported there.

    ``None`` without prometheus-client. Runs once per master: a second call (a
    reloaded gunicorn.conf.py) leaves the directory and the workers' files alone."""
    if not _has_prometheus_client():
        return None
    directory = os.environ.get(MULTIPROC_ENV, "").strip()
    pid, how, prepared = _prepared()
    if directory and pid == os.getpid() and prepared == directory:
        return Path(directory)
    how = "kept" if directory else "made"
    if not directory:
        directory = os.environ[MULTIPROC_ENV] = tempfile.mkdtemp(prefix="prometheus-multiproc-")
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    # prometheus-client's files, and the table statistics the workers share there.
    for stale in [*path.glob("*.db"), *path.glob("flask_idempotency_table_stats.*")]:
        stale.unlink(missing_ok=True)
    os.environ[_PREPARED_ENV] = f"{os.getpid()}:{how}:{directory}"
    return path


def remove_metrics_dir() -> None:
    """Remove the directory this process made in :func:`prepare_metrics_dir`."""
    pid, how, directory = _prepared()
    if pid == os.getpid() and how == "made" and directory:
        shutil.rmtree(directory, ignore_errors=True)
        os.environ.pop(_PREPARED_ENV, None)


def _prepared() -> tuple[int | None, str, str]:
    """What :data:`_PREPARED_ENV` says: the master's pid, made or kept, the directory."""
    pid, _, rest = os.environ.get(_PREPARED_ENV, "").partition(":")
    how, _, directory = rest.partition(":")
    return (int(pid) if pid.isdigit() else None), how, directory


def _has_prometheus_client() -> bool:
    return importlib.util.find_spec("prometheus_client") is not None
