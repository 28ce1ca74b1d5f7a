"""The client half for ``requests``: a transport adapter, and a Session that mounts it.

Retries happen inside ``HTTPAdapter.send``, the documented place for them
(``max_retries`` is urllib3's, which knows nothing of keys and never retries a
``POST``): one ``send`` is one logical call, so the key set or generated there
is kept by every attempt.
"""

from __future__ import annotations

import time
from collections.abc import Callable, MutableMapping, Sequence
from typing import Any

import requests
from requests.adapters import HTTPAdapter
from requests.exceptions import (
    ChunkedEncodingError,
    ConnectionError,
    SSLError,
    Timeout,
)

from .hooks import CallEvent, report
from .policy import Call, RetryPolicy, check_key, new_key

#: Methods HTTP defines as safe: retried the same way, but sent without a key
#: (the server ignores one on them).
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})
#: Failures a retry can get past. Certificate errors cannot; they are
#: ``ConnectionError`` subclasses, so they are named to be let through.
RETRIED = (ConnectionError, Timeout, ChunkedEncodingError)
NOT_RETRIED = (SSLError,)


def _cut(timeout: Any, left: float) -> Any:
    """The caller's ``timeout`` (seconds or ``(connect, read)``) cut to ``left``."""
    if isinstance(timeout, tuple):
        return tuple(left if part is None else min(part, left) for part in timeout)
    if timeout is None or isinstance(timeout, int | float):
        return left if timeout is None else min(timeout, left)
    return timeout  # urllib3's Timeout object: the caller's choice, as it is


class IdempotentAdapter(HTTPAdapter):
    """An ``HTTPAdapter`` that keeps one ``Idempotency-Key`` per call and retries it.

    Mount it (``session.mount("https://", IdempotentAdapter())``) or use
    ``IdempotentSession``. A request's own ``Idempotency-Key`` header is its key;
    without one, a UUID4 is made once per call. Each response carries the
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
        key = None if method in SAFE_METHODS else self._key(request.headers)
        resendable = request.body is None or isinstance(request.body, bytes | str)
        call = Call(self.policy, key, resendable)
        url = request.url or ""
        while True:
            attempt_timeout = _cut(timeout, call.attempt_timeout(None))
            try:
                response = super().send(request, stream=stream, timeout=attempt_timeout, **kwargs)
                body = None if stream and response.status_code < 400 else response.content
            except NOT_RETRIED:
                raise
            except RETRIED as error:
                wait = call.after_error(error)
                if wait is None:
                    report(self.hooks, call, "gave_up", method, url, error=error)
                    raise
                report(self.hooks, call, "retry", method, url, error=error, wait=wait)
                time.sleep(wait)
                continue
            wait = call.after_answer(response.status_code, response.headers, body, response)
            if wait is not None:
                report(
                    self.hooks, call, "retry", method, url, status=response.status_code, wait=wait
                )
                response.close()
                time.sleep(wait)
                continue
            outcome = call.outcome(response.status_code, response.headers)
            kind = "gave_up" if outcome.exhausted else "done"
            report(
                self.hooks,
                call,
                kind,
                method,
                url,
                status=outcome.status,
                replayed=outcome.replayed,
            )
            response.idempotency = outcome  # type: ignore[attr-defined]
            return response

    def _key(self, headers: MutableMapping[str, Any]) -> str:
        """The call's key: the request's own, else a new one, set on the request."""
        given = headers.get(self.policy.key_header)
        if isinstance(given, bytes):
            given = given.decode("ascii", "replace")
        key = check_key(given) if given else new_key()
        headers[self.policy.key_header] = key
        return key


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
