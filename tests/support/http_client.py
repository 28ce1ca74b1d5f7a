"""A small HTTP client on ``http.client`` for tests against real servers.

Enough to drive gunicorn from tests without a ``requests`` dependency, and
deliberately plain: it never retries, never follows redirects and never
reconnects behind the caller's back, because a hidden retry is exactly the
thing idempotency tests must control themselves.
"""

from __future__ import annotations

import http.client
import json as jsonlib
from collections.abc import Mapping
from typing import Any, NamedTuple
from urllib.parse import urlsplit

from .lifecycle import ClosesOnExit


class HttpResponse(NamedTuple):
    """``(status, headers, body)``; headers look up case-insensitively."""

    status: int
    headers: http.client.HTTPMessage
    body: bytes

    def json(self) -> Any:
        return jsonlib.loads(self.body)


def _prepare(
    headers: Mapping[str, str] | None, body: bytes | str | None, json: Any
) -> tuple[dict[str, str], bytes | None]:
    sent = dict(headers or {})
    if json is not None:
        if body is not None:
            raise TypeError("pass body or json, not both")
        body = jsonlib.dumps(json)
        if not any(name.lower() == "content-type" for name in sent):
            sent["Content-Type"] = "application/json"
    if isinstance(body, str):
        body = body.encode()
    return sent, body


def _split(url: str) -> tuple[str, int, str]:
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"only http:// URLs are supported, not {url!r}")
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return parts.hostname, parts.port or 80, target


def _exchange(
    conn: http.client.HTTPConnection,
    method: str,
    target: str,
    headers: dict[str, str],
    body: bytes | None,
) -> HttpResponse:
    conn.request(method, target, body=body, headers=headers)
    with conn.getresponse() as response:
        return HttpResponse(response.status, response.headers, response.read())


def http_request(
    method: str,
    url: str,
    headers: Mapping[str, str] | None = None,
    body: bytes | str | None = None,
    *,
    json: Any = None,
    timeout: float = 10.0,
) -> HttpResponse:
    """One request on a fresh connection, closed afterwards.

    ``json`` (any JSON value but None) is encoded as the body, with
    ``Content-Type: application/json`` unless ``headers`` set one.
    """
    host, port, target = _split(url)
    sent, payload = _prepare(headers, body, json)
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        return _exchange(conn, method, target, sent, payload)
    finally:
        conn.close()


class HttpSession(ClosesOnExit):
    """Keep-alive requests to one server over a single connection.

    If the server closes the connection, the next request fails instead of
    being silently resent on a new one; call ``reconnect()`` to go on.
    """

    def __init__(self, base_url: str, *, timeout: float = 10.0) -> None:
        host, port, _ = _split(base_url)
        self.base_url = base_url.rstrip("/")
        self._conn = http.client.HTTPConnection(host, port, timeout=timeout)
        self._conn.auto_open = 0  # no silent reconnects
        self._conn.connect()

    def request(
        self,
        method: str,
        path: str,
        headers: Mapping[str, str] | None = None,
        body: bytes | str | None = None,
        *,
        json: Any = None,
    ) -> HttpResponse:
        _, _, target = _split(self.base_url + path)
        sent, payload = _prepare(headers, body, json)
        return _exchange(self._conn, method, target, sent, payload)

    def reconnect(self) -> None:
        self._conn.close()
        self._conn.connect()

    def close(self) -> None:
        self._conn.close()
