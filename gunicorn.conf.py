"""gunicorn settings for the payments API: ``gunicorn -c gunicorn.conf.py wsgi:app``.

Every value comes from the environment so one file serves a laptop, a container
and the end-to-end tests; ``GUNICORN_CMD_ARGS`` still overrides any of them.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import urlsplit

from flask_idempotency import gunicorn as idempotency_hooks

# The extension's hooks: Prometheus' multiprocess directory (GET /metrics adds up every
# worker; a dead worker's live gauges dropped) and the pool-against-threads warning.
# on_starting and on_exit below are this file's own, and call the extension's.
from flask_idempotency.gunicorn import child_exit, post_worker_init  # noqa: F401


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


def on_starting(server: Any) -> None:
    """Prepare the metrics directory; without DATABASE_URL, start the embedded PostgreSQL
    here, once, before any worker exists; the workers inherit its URL as DATABASE_URL
    and never start or stop it."""
    idempotency_hooks.on_starting(server)
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
    idempotency_hooks.on_exit(server)
    pid, _, instance = os.environ.get(_STARTED_BY, "").partition(":")
    if pid != str(os.getpid()) or not instance:
        return
    server.log.info("stopping the embedded PostgreSQL in %s", instance)
    if not _embedded().stop_embedded_postgres(instance, wait=30.0):
        server.log.warning("the embedded PostgreSQL in %s was not running", instance)
