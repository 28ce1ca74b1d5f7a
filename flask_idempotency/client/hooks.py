"""What a retrying call reports: a log line and an event for metrics, key hashed.

The same rule as the server's logs: a key can replay an answer, so it never
appears raw; its hash is enough to follow one call across its attempts.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from urllib.parse import urlsplit

from .policy import Call, hash_key

log = logging.getLogger("flask_idempotency.client")


@dataclasses.dataclass(frozen=True)
class CallEvent:
    """One step of a call, for a metrics hook.

    ``kind`` is ``"retry"`` (an attempt failed and another follows after
    ``wait`` seconds), ``"done"`` (the call returned an answer) or
    ``"gave_up"`` (it ended on an error, or on a retryable answer with its
    attempts or deadline spent: ``exhausted`` says which).
    """

    kind: str
    method: str
    #: Scheme, host and path: no query string, which may carry secrets.
    target: str
    #: ``hash_key(key)``; ``None`` for a safe method, which sends no key.
    key_hash: str | None
    attempt: int
    status: int | None = None
    error: str | None = None
    wait: float | None = None
    replayed: bool | None = None
    exhausted: str | None = None


def report(
    hooks: Sequence[Callable[[CallEvent], None]],
    call: Call,
    kind: str,
    method: str,
    url: str,
    *,
    status: int | None = None,
    error: BaseException | None = None,
    wait: float | None = None,
    replayed: bool | None = None,
) -> None:
    """Log one step of ``call`` and hand it to every hook (a hook's error is logged)."""
    parts = urlsplit(url)
    event = CallEvent(
        kind=kind,
        method=method,
        target=f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}{parts.path}",
        key_hash=None if call.key is None else hash_key(call.key),
        attempt=call.attempts,
        status=status,
        error=None if error is None else type(error).__name__,
        wait=wait,
        replayed=replayed,
        exhausted=call.exhausted if kind == "gave_up" else None,
    )
    what = event.error or f"status {status}"
    if kind == "retry":
        log.info(
            "%s %s key=%s attempt %d: %s; retrying in %.2f s",
            method, event.target, event.key_hash, event.attempt, what, wait or 0.0,
        )  # fmt: skip
    elif kind == "gave_up":
        log.warning(
            "%s %s key=%s gave up after %d attempts: %s (%s)",
            method, event.target, event.key_hash, event.attempt, what, event.exhausted or "final",
        )  # fmt: skip
    for hook in hooks:
        try:
            hook(event)
        except Exception:
            log.exception("client hook %r failed", hook)
