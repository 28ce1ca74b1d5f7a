"""The test harness's public surface: throwaway servers, proxy, HTTP helper.

Import from here (``from support.servers import ThrowawayPostgres``); the
modules behind it are split by server only to keep each one short.
"""

from __future__ import annotations

from collections.abc import Callable

from ._procs import free_port
from .databases import (
    check_postgres,
    check_redis,
    flush_redis,
    redact,
    truncate_public_tables,
)
from .gunicorn_server import GunicornServer, child_pids
from .http_client import HttpResponse, HttpSession, http_request
from .postgres_server import ThrowawayPostgres
from .redis_server import ThrowawayRedis, redis_answers
from .tcp_proxy import TcpProxy

# Types of the factory fixtures in conftest.py, for annotating test arguments.
ProxyFactory = Callable[..., TcpProxy]
"""``tcp_proxy(url)`` or ``tcp_proxy(host, port)`` -> a started TcpProxy."""

GunicornFactory = Callable[..., GunicornServer]
"""``gunicorn_server(wsgi_app, **GunicornServer options)`` -> a started server."""

__all__ = [
    "GunicornFactory",
    "GunicornServer",
    "HttpResponse",
    "HttpSession",
    "ProxyFactory",
    "TcpProxy",
    "ThrowawayPostgres",
    "ThrowawayRedis",
    "check_postgres",
    "check_redis",
    "child_pids",
    "flush_redis",
    "free_port",
    "http_request",
    "redact",
    "redis_answers",
    "truncate_public_tables",
]
