"""What a retrying call reports: a log line and an event for metrics, key hashed.

The same rule as the server's logs: a key can replay an answer, so it never
appears raw; its hash is enough to follow one call across its attempts.
``answered`` and ``failed`` are the adapters' one step after each attempt: the
policy's decision, reported, so that every adapter reports alike.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from urllib.parse import urlsplit

from .policy import Call, CallOutcome, KeyReused, hash_key

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


def answered(
    hooks: Sequence[Callable[[CallEvent], None]],
    call: Call,
    method: str,
    url: str,
    status: int,
    headers: Mapping[str, str],
    body: bytes | None,
    response: object,
) -> float | CallOutcome:
    """``call.after_answer``, reported: the seconds to wait before the next attempt,
    or the call's outcome when this answer is the one returned (``KeyReused`` raised)."""
    try:
        wait = call.after_answer(status, headers, body, response)
    except KeyReused as refused:
        report(hooks, call, "gave_up", method, url, status=status)
        call.gave_up(refused)
        raise
    if wait is not None:
        report(hooks, call, "retry", method, url, status=status, wait=wait)
        return wait
    outcome = call.outcome(status, headers)
    kind = "gave_up" if outcome.exhausted else "done"
    report(hooks, call, kind, method, url, status=status, replayed=outcome.replayed)
    return outcome


def failed(
    hooks: Sequence[Callable[[CallEvent], None]],
    call: Call,
    method: str,
    url: str,
    error: Exception,
    *,
    retryable: bool = True,
) -> float:
    """``call.after_error``, reported: the seconds to wait before the next attempt;
    else ``error`` is raised, the call's outcome on it."""
    wait = call.after_error(error) if retryable else None
    if wait is None:
        report(hooks, call, "gave_up", method, url, error=error)
        raise call.gave_up(error)
    report(hooks, call, "retry", method, url, error=error, wait=wait)
    return wait
