"""The client half for ``requests``: a transport adapter, and a Session that mounts it.

Retries happen inside ``HTTPAdapter.send``, the documented place for them
(``max_retries`` is urllib3's, which knows nothing of keys and never retries a
``POST``): one ``send`` is one logical call, so the key set or generated there
is kept by every attempt.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import requests
from requests.adapters import HTTPAdapter
from requests.exceptions import (
    ChunkedEncodingError,
    ConnectionError,
    SSLError,
    Timeout,
)

from .hooks import CallEvent, answered, failed
from .keys import set_call_key
from .policy import Call, CallOutcome, RetryPolicy, within

#: Failures a retry can get past. Certificate errors cannot; they are
#: ``ConnectionError`` subclasses, so they are named to be let through.
RETRIED = (ConnectionError, Timeout, ChunkedEncodingError)
NOT_RETRIED = (SSLError,)


def _cut(timeout: Any, left: float) -> Any:
    """The caller's ``timeout`` (seconds or ``(connect, read)``) cut to ``left``."""
    if isinstance(timeout, tuple):
        return tuple(within(part, left) for part in timeout)
    if timeout is None or isinstance(timeout, int | float):
        return within(timeout, left)
    return timeout  # urllib3's Timeout object: the caller's choice, as it is


def _check_whole(response: requests.Response) -> None:
    """Raise ``ChunkedEncodingError`` for an answer shorter than its
    ``Content-Length``: urllib3 2 does so itself, urllib3 1.26 (under requests
    below 2.30) hands over what came, and a cut answer would pass for the answer."""
    declared = response.headers.get("Content-Length", "")
    received = response.raw.tell() if hasattr(response.raw, "tell") else None
    if declared.isascii() and declared.isdigit() and received is not None:
        bodiless = response.request.method == "HEAD" or response.status_code in (204, 304)
        if received < int(declared) and not bodiless:
            raise ChunkedEncodingError(f"answer cut short: {received} of {declared} bytes")


class IdempotentAdapter(HTTPAdapter):
    """An ``HTTPAdapter`` that keeps one ``Idempotency-Key`` per call and retries it.

    Mount it (``session.mount("https://", IdempotentAdapter())``) or use
    ``IdempotentSession``. A request's own ``Idempotency-Key`` header is its key;
    without one, a UUID4 is made once per call (but not inside a claimed request:
    there the call needs ``purpose_key()``'s). Each response carries the
    outcome as ``response.idempotency`` (a ``CallOutcome``). A body that cannot
    be sent twice (a generator, a file) is sent once, without retries.
    """

    def __init__(
        self,
        policy: RetryPolicy | None = None,
        *,
        hooks: Sequence[Callable[[CallEvent], None]] = (),
        **adapter_options: Any,
    ) -> None:
        if "max_retries" in adapter_options:
            raise TypeError("max_retries is urllib3's; the retry policy is `policy`")
        super().__init__(**adapter_options)
        self.policy = policy or RetryPolicy()
        self.hooks = tuple(hooks)

    def send(  # type: ignore[override]
        self,
        request: requests.PreparedRequest,
        stream: bool = False,
        timeout: Any = None,
        **kwargs: Any,
    ) -> requests.Response:
        method = (request.method or "GET").upper()
        key = set_call_key(method, request.headers, self.policy.key_header)
        resendable = request.body is None or isinstance(request.body, bytes | str)
        call = Call(self.policy, key, resendable)
        url = request.url or ""
        while True:
            try:
                response = self._attempt(
                    request, stream, _cut(timeout, call.begin_attempt()), kwargs
                )
            except RETRIED as error:  # NOT_RETRIED among them, given up at once
                retryable = not isinstance(error, NOT_RETRIED)
                time.sleep(failed(self.hooks, call, method, url, error, retryable=retryable))
                continue
            body = response.content if response.status_code >= 400 else None
            status, headers = response.status_code, response.headers
            step = answered(self.hooks, call, method, url, status, headers, body, response)
            if isinstance(step, CallOutcome):
                response.idempotency = step  # type: ignore[attr-defined]
                return response
            response.close()
            time.sleep(step)

    def _attempt(
        self, request: requests.PreparedRequest, stream: bool, timeout: Any, options: Any
    ) -> requests.Response:
        """One send; the body read here (an error's always, the rest unless
        ``stream``) so that an answer cut short is retried like a lost one."""
        response = super().send(request, stream=stream, timeout=timeout, **options)
        try:
            if not stream or response.status_code >= 400:
                response.content  # noqa: B018 (reads and keeps the body)
                _check_whole(response)
        except BaseException:
            response.close()
            raise
        return response


class IdempotentSession(requests.Session):
    """A ``requests.Session`` whose ``http://`` and ``https://`` calls go through
    ``IdempotentAdapter``. A call's ``Idempotency-Key`` header is its key; without
    one, a key is made for the call and kept by its retries.

    Inside a claimed Flask request, give a downstream call the key
    ``purpose_key("...")`` so that a retried view sends the same key again.
    """

    def __init__(
        self,
        policy: RetryPolicy | None = None,
        *,
        hooks: Sequence[Callable[[CallEvent], None]] = (),
    ) -> None:
        super().__init__()
        self.policy = policy or RetryPolicy()
        adapter = IdempotentAdapter(self.policy, hooks=hooks)
        self.mount("https://", adapter)
        self.mount("http://", adapter)
