"""The client half for ``httpx``: transports, sync and async, around httpx's own.

A transport sees each request once per ``client.send()`` (redirects aside),
so it is where one logical call lives: the key set or made there is kept by
every attempt. httpx's own ``retries=`` only reconnects; these retry after a
request was sent too, which the key makes safe.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import anyio
import httpx

from .hooks import CallEvent, answered, failed
from .keys import set_call_key
from .policy import Call, CallOutcome, KeyReused, RetryPolicy, within

#: What a retry can get past: timeouts, broken or refused connections and
#: answers cut short. Not a ``LocalProtocolError`` or an unsupported URL.
RETRIED = (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError)
#: Where the outcome (a ``CallOutcome``) is found: ``response.extensions``.
OUTCOME = "idempotency"

Hooks = Sequence[Callable[[CallEvent], None]]


def _timed(request: httpx.Request, call: Call) -> httpx.Request:
    """``request`` with each of its timeouts cut to what is left of the deadline."""
    left = call.begin_attempt()
    timeouts = dict(request.extensions.get("timeout") or {})
    for name in ("connect", "read", "write", "pool"):
        timeouts[name] = within(timeouts.get(name), left)
    request.extensions = {**request.extensions, "timeout": timeouts}
    return request


def _read_here(call: Call, response: httpx.Response) -> bool:
    """Whether to read the body inside the retry loop: an error's (its code decides),
    and a keyed call's whole answer, so that one cut short is asked for again under
    its key (httpx would read it after the transport returned, past any retry). A
    safe method's answer (a download, say) stays streamed."""
    return call.key is not None or response.status_code >= 400


def _as_read(response: httpx.Response, raw: bytes, request: httpx.Request) -> httpx.Response:
    """A fresh response over the bytes read, still encoded as sent: the client reads
    and closes it as any other (its ``elapsed``, its event hooks)."""
    return httpx.Response(
        response.status_code,
        headers=response.headers,
        stream=httpx.ByteStream(raw),
        extensions=response.extensions,
        request=request,
    )


def _error_body(response: httpx.Response, raw: bytes | None) -> bytes | None:
    """An error's body, decoded, for its code (a throwaway response: the one
    returned stays unread)."""
    if raw is None or response.status_code < 400:
        return None
    copy = httpx.Response(
        response.status_code, headers=response.headers, stream=httpx.ByteStream(raw)
    )
    try:
        return copy.read()
    except httpx.DecodingError:
        return None


def _decide(
    call: Call, response: httpx.Response, raw: bytes | None, hooks: Hooks, request: httpx.Request
) -> float | None:
    """The wait before the next attempt, or ``None``: ``response`` is returned, its
    outcome in its extensions (``hooks.answered``)."""
    method, url, status = request.method, str(request.url), response.status_code
    body = _error_body(response, raw)
    try:
        step = answered(hooks, call, method, url, status, response.headers, body, response)
    except KeyReused:
        response.read()  # in memory already: the error's answer, readable as it is
        raise
    if isinstance(step, CallOutcome):
        response.extensions = {**response.extensions, OUTCOME: step}
        return None
    return step


class IdempotentTransport(httpx.BaseTransport):
    """``httpx.Client(transport=IdempotentTransport())``: one key per call, retried
    by ``policy``. ``transport`` is the one that sends (an ``httpx.HTTPTransport``
    by default). Give your own for TLS settings, connection limits or a proxy:
    httpx reads them from the transport, not the client, once one is given."""

    def __init__(
        self,
        policy: RetryPolicy | None = None,
        *,
        transport: httpx.BaseTransport | None = None,
        hooks: Sequence[Callable[[CallEvent], None]] = (),
    ) -> None:
        self.policy = policy or RetryPolicy()
        self.transport = transport or httpx.HTTPTransport()
        self.hooks = tuple(hooks)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        call = Call(
            self.policy, set_call_key(request.method, request.headers, self.policy.key_header)
        )
        request.read()  # a streamed body becomes bytes: every attempt sends it whole
        while True:
            raw = None
            try:
                response = self.transport.handle_request(_timed(request, call))
                if _read_here(call, response):
                    try:
                        raw = b"".join(response.iter_raw())
                    finally:
                        response.close()
                    response = _as_read(response, raw, request)
            except RETRIED as error:
                time.sleep(failed(self.hooks, call, request.method, str(request.url), error))
                continue
            wait = _decide(call, response, raw, self.hooks, request)
            if wait is None:
                return response
            response.close()
            time.sleep(wait)

    def close(self) -> None:
        self.transport.close()


class AsyncIdempotentTransport(httpx.AsyncBaseTransport):
    """``IdempotentTransport`` for ``httpx.AsyncClient``, under asyncio or trio."""

    def __init__(
        self,
        policy: RetryPolicy | None = None,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        hooks: Sequence[Callable[[CallEvent], None]] = (),
    ) -> None:
        self.policy = policy or RetryPolicy()
        self.transport = transport or httpx.AsyncHTTPTransport()
        self.hooks = tuple(hooks)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        call = Call(
            self.policy, set_call_key(request.method, request.headers, self.policy.key_header)
        )
        await request.aread()
        while True:
            raw = None
            try:
                response = await self.transport.handle_async_request(_timed(request, call))
                if _read_here(call, response):
                    try:
                        raw = b"".join([part async for part in response.aiter_raw()])
                    finally:
                        await response.aclose()
                    response = _as_read(response, raw, request)
            except RETRIED as error:
                await anyio.sleep(failed(self.hooks, call, request.method, str(request.url), error))
                continue
            wait = _decide(call, response, raw, self.hooks, request)
            if wait is None:
                return response
            await response.aclose()
            await anyio.sleep(wait)

    async def aclose(self) -> None:
        await self.transport.aclose()
