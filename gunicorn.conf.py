"""gunicorn settings for the payments API: ``gunicorn -c gunicorn.conf.py wsgi:app``.

Every value comes from the environment so one file serves a laptop, a container
and the end-to-end tests; ``GUNICORN_CMD_ARGS`` still overrides any of them.
"""

from __future__ import annotations

import multiprocessing
import os
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


_processor_timeout = _number("PROCESSOR_TIMEOUT_SECONDS", 10.0)

bind = [_bind(os.environ)]
workers = int(_number("WEB_CONCURRENCY", _default_workers()))
worker_class = os.environ.get("GUNICORN_WORKER_CLASS", "").strip() or "gthread"
# Threads let a worker serve other requests while one waits on the card processor.
threads = int(_number("GUNICORN_THREADS", 4))
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
