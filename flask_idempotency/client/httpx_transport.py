"""The client half for ``httpx``: transports, sync and async, around httpx's own.

A transport sees each request once per ``client.send()`` (redirects aside),
so it is where one logical call lives: the key set or made there is kept by
every attempt. httpx's own ``retries=`` only reconnects; these retry after a
request was sent too, which the key makes safe.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

import httpx

from .hooks import CallEvent, report
from .policy import Call, RetryPolicy, check_key, new_key

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})
#: What a retry can get past: timeouts, broken or refused connections and
#: answers cut short. Not a ``LocalProtocolError`` or an unsupported URL.
RETRIED = (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError)
#: Where the outcome (a ``CallOutcome``) is found: ``response.extensions``.
OUTCOME = "idempotency"


def _begin(request: httpx.Request, policy: RetryPolicy) -> Call:
    """The call for ``request``: its key (its own header's, else a new one) set on it."""
    key = None
    if request.method.upper() not in SAFE_METHODS:
        given = request.headers.get(policy.key_header)
        key = check_key(given) if given else new_key()
        request.headers[policy.key_header] = key
    return Call(policy, key)


def _timed(request: httpx.Request, call: Call) -> httpx.Request:
    """``request`` with each of its timeouts cut to what is left of the deadline."""
    left = call.attempt_timeout(None)
    timeouts = dict(request.extensions.get("timeout") or {})
    for name in ("connect", "read", "write", "pool"):
        given = timeouts.get(name)
        timeouts[name] = left if given is None else min(given, left)
    request.extensions = {**request.extensions, "timeout": timeouts}
    return request


def _read_here(call: Call, response: httpx.Response) -> bool:
    """Whether to read the body inside the retry loop: an error's (its code decides),
    and a keyed call's whole answer, so that one cut short is asked for again under
    its key (httpx would read it after the transport returned, past any retry). A
    safe method's answer (a download, say) stays streamed."""
    return call.key is not None or response.status_code >= 400


def _settled(
    call: Call, response: httpx.Response, hooks: Sequence[Callable[[CallEvent], None]]
) -> httpx.Response:
    outcome = call.outcome(response.status_code, response.headers)
    kind = "gave_up" if outcome.exhausted else "done"
    report(
        hooks,
        call,
        kind,
        response.request.method,
        str(response.request.url),
        status=outcome.status,
        replayed=outcome.replayed,
    )
    response.extensions = {**response.extensions, OUTCOME: outcome}
    return response


class IdempotentTransport(httpx.BaseTransport):
    """``httpx.Client(transport=IdempotentTransport())``: one key per call, retried
    by ``policy``. ``transport`` is the one that sends (an ``httpx.HTTPTransport``
    by default: give your own for TLS or connection limits, which httpx reads from
    the transport, not the client, once one is given)."""

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
        call = _begin(request, self.policy)
        request.read()  # a streamed body becomes bytes: every attempt sends it whole
        url = str(request.url)
        while True:
            try:
                response = self.transport.handle_request(_timed(request, call))
                if _read_here(call, response):
                    response.read()
            except RETRIED as error:
                wait = call.after_error(error)
                if wait is None:
                    report(self.hooks, call, "gave_up", request.method, url, error=error)
                    raise
                report(self.hooks, call, "retry", request.method, url, error=error, wait=wait)
                time.sleep(wait)
                continue
            response.request = request
            body = response.content if response.status_code >= 400 else None
            wait = call.after_answer(response.status_code, response.headers, body, response)
            if wait is None:
                return _settled(call, response, self.hooks)
            report(
                self.hooks,
                call,
                "retry",
                request.method,
                url,
                status=response.status_code,
                wait=wait,
            )
            response.close()
            time.sleep(wait)

    def close(self) -> None:
        self.transport.close()


class AsyncIdempotentTransport(httpx.AsyncBaseTransport):
    """``IdempotentTransport`` for ``httpx.AsyncClient``; waits with ``asyncio.sleep``."""

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
        call = _begin(request, self.policy)
        await request.aread()
        url = str(request.url)
        while True:
            try:
                response = await self.transport.handle_async_request(_timed(request, call))
                if _read_here(call, response):
                    await response.aread()
            except RETRIED as error:
                wait = call.after_error(error)
                if wait is None:
                    report(self.hooks, call, "gave_up", request.method, url, error=error)
                    raise
                report(self.hooks, call, "retry", request.method, url, error=error, wait=wait)
                await asyncio.sleep(wait)
                continue
            response.request = request
            body = response.content if response.status_code >= 400 else None
            wait = call.after_answer(response.status_code, response.headers, body, response)
            if wait is None:
                return _settled(call, response, self.hooks)
            report(
                self.hooks,
                call,
                "retry",
                request.method,
                url,
                status=response.status_code,
                wait=wait,
            )
            await response.aclose()
            await asyncio.sleep(wait)

    async def aclose(self) -> None:
        await self.transport.aclose()
