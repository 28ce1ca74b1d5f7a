"""The doctor's checks of the server the app runs under: gunicorn's settings
against the pool, and Prometheus' multiprocess directory.

gunicorn's settings are read with gunicorn's own ``Config`` in gunicorn's
order: its defaults, then the configuration file (``--gunicorn-config``, else
the one ``GUNICORN_CMD_ARGS`` names with ``-c``, else ``./gunicorn.conf.py``,
which gunicorn reads when started from this directory), then
``GUNICORN_CMD_ARGS``. The file is run as gunicorn runs it; what it puts in
``os.environ`` is kept aside for the checks and the doctor's own environment
is put back afterwards.
"""

from __future__ import annotations

import dataclasses
import os
import runpy
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .base import Check, Context, fail, ok, warn

#: What gunicorn reads when started without ``-c`` (gunicorn >= 19.7).
DEFAULT_CONFIG = "gunicorn.conf.py"
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
#: Workers that serve one request per greenlet: ``worker_connections`` at once.
ASYNC_WORKERS = ("gevent", "eventlet")


@dataclasses.dataclass(frozen=True)
class Gunicorn:
    """The gunicorn settings that matter here."""

    #: Where they came from: the file and/or ``GUNICORN_CMD_ARGS``.
    source: str
    workers: int
    threads: int
    worker_class: str
    worker_connections: int
    #: The environment once the configuration file ran (what workers inherit).
    environ: Mapping[str, str]
    #: Server hooks the file defines, by name -> the module defining them.
    hooks: Mapping[str, str]

    def concurrency(self) -> tuple[int, str]:
        """Requests one worker serves at once, and what decides it."""
        kind = self.worker_class.rsplit(".", 1)[-1].lower()
        if any(name in kind for name in ASYNC_WORKERS):
            return self.worker_connections, f"worker_connections ({self.worker_class})"
        if kind in ("sync", "syncworker") and self.threads <= 1:
            return 1, "sync worker"
        return self.threads, "threads"


def read_gunicorn(path: str | None, environ: Mapping[str, str]) -> Gunicorn | None:
    """gunicorn's settings, or ``None`` when nothing says the app runs under it."""
    env_args = environ.get("GUNICORN_CMD_ARGS", "")
    default = DEFAULT_CONFIG if Path(DEFAULT_CONFIG).is_file() else None
    if path is None and not env_args and default is None:
        return None
    from gunicorn.config import Config  # only now: gunicorn is the app's, not ours

    cfg = Config()
    try:
        parsed = vars(cfg.parser().parse_args(shlex.split(env_args)))
    except SystemExit:  # argparse's way of saying "bad option": gunicorn would not start
        raise ValueError(f"GUNICORN_CMD_ARGS is not valid for gunicorn: {env_args!r}") from None
    path = path or parsed.get("config") or default
    hooks: dict[str, str] = {}
    after = dict(environ)
    if path is not None:
        namespace, after = _run_config(path)
        for name, value in namespace.items():
            if name in cfg.settings and value is not None:
                cfg.set(name, value)
                if callable(value) and name in _HOOKS:
                    hooks[name] = getattr(value, "__module__", "") or ""
    for name, value in parsed.items():
        if value is not None and name not in ("args", "config"):
            cfg.set(name.lower(), value)
    return Gunicorn(
        source=" + ".join(s for s in (path, env_args and "GUNICORN_CMD_ARGS") if s),
        workers=int(cfg.workers),
        threads=int(cfg.threads),
        worker_class=str(cfg.worker_class_str),
        worker_connections=int(cfg.worker_connections),
        environ=after,
        hooks=hooks,
    )


_HOOKS = ("on_starting", "when_ready", "post_fork", "post_worker_init", "child_exit", "worker_exit")


def _run_config(path: str) -> tuple[dict[str, Any], dict[str, str]]:
    """Run a gunicorn configuration file; its names, and the environment it left."""
    saved = dict(os.environ)
    try:
        return runpy.run_path(path, run_name="__config__"), dict(os.environ)  # as it left it
    except SystemExit as exc:  # a file that exits must not end the doctor
        raise RuntimeError(f"{path} exited ({exc.code}) while being read") from None
    finally:
        os.environ.clear()
        os.environ.update(saved)


def gunicorn(ctx: Context) -> Gunicorn | None:
    return ctx.once("gunicorn", lambda: read_gunicorn(ctx.options.gunicorn_config, os.environ))


def pool(ctx: Context) -> Check:
    """Each in-flight idempotent request holds a connection of its worker's pool."""
    capacity = ctx.store.pool.capacity()
    if capacity is None:
        return ok("the pool's size is the application's own (db= or IDEMPOTENCY_POOL)")
    size, source = capacity
    server = gunicorn(ctx)
    if server is None:
        return ok(
            f"{size} connection(s) per process ({source}); no gunicorn settings to compare "
            "with (--gunicorn-config)"
        )
    concurrency, what = server.concurrency()
    if size < concurrency:
        return warn(
            f"{source} = {size} for {concurrency} {what} per worker ({server.source}): "
            "requests past the pool wait for a connection and answer 503 after the pool's "
            "timeout",
            f"set {source} to at least {concurrency} (plus one per idempotency.transaction() "
            "a view opens)",
        )
    return ok(
        f"{size} connection(s) for {concurrency} {what} per worker, {server.workers} "
        f"worker(s) ({server.source})"
    )


def prometheus(ctx: Context) -> Check:
    """Several workers each count their own requests: without prometheus-client's
    multiprocess directory a scrape shows whichever worker answered it."""
    if "idempotency_prometheus" not in ctx.app.extensions:
        return ok("no PrometheusMetrics on this app")
    server = gunicorn(ctx)
    if server is None or server.workers <= 1:
        return ok("one process: its registry holds every count")
    workers, directory = server.workers, server.environ.get(MULTIPROC_ENV, "").strip()
    hooks = "flask_idempotency.gunicorn's hooks"
    if not directory and "flask_idempotency.gunicorn" in server.hooks.values():
        return ok(f"{workers} workers; the multiprocess directory is set up by {hooks}")
    if not directory and "on_starting" in server.hooks:
        return warn(
            f"{workers} workers and {MULTIPROC_ENV} unset here; {server.source}'s "
            "on_starting may set it: otherwise each scrape shows one worker's counts",
            f"set {MULTIPROC_ENV} in the server's environment, or use {hooks}",
        )
    if not directory:
        return fail(
            f"{workers} workers and no {MULTIPROC_ENV}: each scrape shows the counts "
            "of whichever worker answered it",
            f"set {MULTIPROC_ENV} to an empty directory before gunicorn starts (or use "
            f"{hooks} in gunicorn.conf.py)",
        )
    problem = _unwritable(directory)
    if problem:
        return fail(
            f"{MULTIPROC_ENV}={directory} {problem}: workers cannot write their counts",
            f"create it, writable by the server's user, or point {MULTIPROC_ENV} elsewhere",
        )
    if "child_exit" not in server.hooks:
        return warn(
            f"{MULTIPROC_ENV}={directory}, but no child_exit hook: a dead worker's gauges "
            "stay in the sums",
            "call prometheus_client.multiprocess.mark_process_dead(worker.pid) in child_exit",
        )
    return ok(f"{workers} workers share {MULTIPROC_ENV}={directory}")


def _unwritable(directory: str) -> str | None:
    path = Path(directory)
    if path.is_dir():
        return None if os.access(path, os.W_OK | os.X_OK) else "is not writable"
    if path.exists():
        return "is not a directory"
    parent = next((p for p in path.parents if p.exists()), None)
    if parent is None or not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        return "does not exist and cannot be created"
    return None  # created at start-up (mkdir -p): fine
