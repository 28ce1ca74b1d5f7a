"""gunicorn settings for the payments API: ``gunicorn -c gunicorn.conf.py wsgi:app``.

Every value comes from the environment so one file serves a laptop, a container
and the end-to-end tests; ``GUNICORN_CMD_ARGS`` still overrides any of them.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
import shutil
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import urlsplit


def _bind(environ: os._Environ[str]) -> str:
    """``GUNICORN_BIND``, else every interface on ``$PORT`` (PaaS style), else loopback."""
    explicit = environ.get("GUNICORN_BIND", "").strip()
    if explicit:
        return explicit
    port = environ.get("PORT", "").strip()
    if port:
        return f"0.0.0.0:{port}"
    return "127.0.0.1:8000"


def _number(name: str, default: float) -> float:
    """A positive number from the environment; a bad one falls back here and the app,
    which reads the same variable, refuses it with a clear message."""
    try:
        value = float(os.environ.get(name, "") or default)
    except ValueError:
        return default
    return value if value > 0 else default


def _default_workers() -> int:
    # gunicorn's rule of thumb, capped: each worker holds its own database pool, and
    # beyond a handful the workers only queue on PostgreSQL.
    return min(2 * multiprocessing.cpu_count() + 1, 8)


def _default_pool_size() -> int:
    from flask_idempotency.settings import Settings

    return int(Settings.pool_size)


_processor_timeout = _number("PROCESSOR_TIMEOUT_SECONDS", 10.0)

bind = [_bind(os.environ)]
workers = int(_number("WEB_CONCURRENCY", _default_workers()))
worker_class = os.environ.get("GUNICORN_WORKER_CLASS", "").strip() or "gthread"
# Threads let a worker serve other requests while one waits on the card processor.
threads = int(_number("GUNICORN_THREADS", 4))
# Every in-flight idempotent request holds a pooled connection from its claim to its
# completion: unless it is set, the pool covers the threads (the app reads it).
if not os.environ.get("IDEMPOTENCY_POOL_SIZE", "").strip():
    os.environ["IDEMPOTENCY_POOL_SIZE"] = str(max(threads, _default_pool_size()))
# A request may legitimately wait a whole processor timeout; kill a worker only when
# it is stuck well beyond that (its claim then lapses with the lease and is retried).
timeout = int(_number("GUNICORN_TIMEOUT", _processor_timeout + 20))
# On shutdown, let a charge waiting on the processor finish and commit rather than
# leave a half-done request for the lease to clean up.
graceful_timeout = int(_number("GUNICORN_GRACEFUL_TIMEOUT", _processor_timeout + 5))
keepalive = 5
# No preload: the app (its PostgreSQL pool, Redis client and lease-renewal thread)
# is built in each worker after the fork, never shared across processes.
preload_app = False
# gunicorn >= 25.1 opens a per-user control socket ($HOME/.gunicorn/gunicorn.ctl);
# several servers on one host (blue/green, tests, the benchmark) would take it from
# each other, and this deployment does not use it.
control_socket_disable = True


def post_worker_init(worker: Any) -> None:
    """Warn in the log when a worker has more threads than idempotency pool connections
    (each in-flight request holds one); imported here, in the worker, not the master."""
    from flask_idempotency.gunicorn import check_worker

    check_worker(worker)


def when_ready(server: Any) -> None:
    """Say where the API listens and how to try it."""
    for listener in server.LISTENERS:
        address = str(listener)
        server.log.info("payments API listening on %s (%d workers)", address, server.num_workers)
        if not address.startswith("http"):
            continue
        parts = urlsplit(address)
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(parts.hostname or "", parts.hostname)
        netloc = f"[{host}]:{parts.port}" if host and ":" in host else f"{host}:{parts.port}"
        server.log.info(
            "try: curl -i http://%s/v1/charges -H 'Authorization: Bearer sk_test_demo' "
            "-H 'Idempotency-Key: demo-1' -H 'Content-Type: application/json' "
            '-d \'{"amount": 1500, "currency": "usd", "customer": "cus_demo", '
            '"source": "tok_visa"}\'',
            netloc,
        )


# -- the embedded PostgreSQL (DATABASE_URL unset): the master's, not the workers' ----------

#: The example app's instance folder, where the embedded PostgreSQL keeps its data: the
#: app's default (``instance/`` next to the package), or ``$EXAMPLE_INSTANCE_PATH``.
_HERE = Path(__file__).resolve().parent
#: ``<pid>:<instance folder>`` of the master that started the embedded PostgreSQL, and
#: so stops it on exit. In the environment, not a global: a HUP re-reads this file.
_STARTED_BY = "EXAMPLE_EMBEDDED_POSTGRES_STARTED_BY"


def _embedded() -> ModuleType:
    """example_app/embedded.py alone: importing the example_app package would load the
    app's modules into the master, and workers forked later would not re-import them."""
    spec = importlib.util.spec_from_file_location(
        "example_app_embedded", _HERE / "example_app" / "embedded.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- Prometheus' multiprocess directory: GET /metrics adds up every worker ----------------

#: prometheus-client's multiprocess mode: each worker writes its metrics to files here
#: and the one answering GET /metrics reads them all. It must be set before any worker
#: (or the master) imports prometheus_client, so in the master, before the fork.
_METRICS_DIR = "PROMETHEUS_MULTIPROC_DIR"
#: ``<pid>:<directory>`` of the master that created the directory, and removes it on exit.
_METRICS_DIR_CREATED_BY = "EXAMPLE_METRICS_DIR_CREATED_BY"


def _prepare_metrics_dir(server: Any) -> None:
    """$PROMETHEUS_MULTIPROC_DIR emptied of an earlier run's files (their counters would
    be added to this run's), or a fresh directory of this master's own."""
    directory = os.environ.get(_METRICS_DIR, "").strip()
    if directory:
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        for stale in [*path.glob("*.db"), *path.glob("flask_idempotency_table_stats.*")]:
            stale.unlink(missing_ok=True)
    else:
        directory = tempfile.mkdtemp(prefix="gunicorn-metrics-")
        os.environ[_METRICS_DIR] = directory
        os.environ[_METRICS_DIR_CREATED_BY] = f"{os.getpid()}:{directory}"
    server.log.info("prometheus multiprocess directory: %s", directory)


def child_exit(server: Any, worker: Any) -> None:
    """A worker is gone: drop its live gauges (in-flight claims, pool use) from the sums;
    its counters stay, so no request it counted is lost."""
    directory = os.environ.get(_METRICS_DIR, "").strip()
    if directory and importlib.util.find_spec("prometheus_client") is not None:
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(worker.pid, directory)  # type: ignore[no-untyped-call]


def _remove_metrics_dir() -> None:
    pid, _, directory = os.environ.get(_METRICS_DIR_CREATED_BY, "").partition(":")
    if pid == str(os.getpid()) and directory:
        shutil.rmtree(directory, ignore_errors=True)


def on_starting(server: Any) -> None:
    """Prepare the metrics directory; without DATABASE_URL, start the embedded PostgreSQL
    here, once, before any worker exists; the workers inherit its URL as DATABASE_URL
    and never start or stop it."""
    _prepare_metrics_dir(server)
    if os.environ.get("DATABASE_URL", "").strip():
        return
    embedded = _embedded()
    instance = os.environ.get("EXAMPLE_INSTANCE_PATH", "").strip() or str(_HERE / "instance")
    running_before = embedded.embedded_postgres_pid(instance)
    os.environ["DATABASE_URL"] = embedded.embedded_database_url(instance)
    if running_before is None:
        os.environ[_STARTED_BY] = f"{os.getpid()}:{instance}"
        server.log.info("started the embedded PostgreSQL in %s", instance)
    else:
        server.log.info(
            "using the embedded PostgreSQL already running in %s (pid %d); left running on exit",
            instance,
            running_before,
        )


def on_exit(server: Any) -> None:
    """Stop the embedded PostgreSQL if this master started it (Ctrl-C, SIGTERM).

    gunicorn runs this in the master only: a worker exiting or being replaced never
    stops the database the others use."""
    _remove_metrics_dir()
    pid, _, instance = os.environ.get(_STARTED_BY, "").partition(":")
    if pid != str(os.getpid()) or not instance:
        return
    server.log.info("stopping the embedded PostgreSQL in %s", instance)
    if not _embedded().stop_embedded_postgres(instance, wait=30.0):
        server.log.warning("the embedded PostgreSQL in %s was not running", instance)
