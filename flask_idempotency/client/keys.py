"""Which key a call sends, and keys for the calls a claimed request makes downstream.

``idempotency.derived_key(purpose)`` gives the same key for the same purpose
in every attempt at a record, which is what makes a retried view safe to call
out again. Used for two calls in one attempt, it would make the second call
look like a retry of the first (the downstream service would replay the first
answer, or refuse); ``purpose_key`` refuses that instead. And a call made from
a claimed request with no key at all is refused too: a key made up for it would
be a new one in the view's next attempt, a second charge downstream.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

from flask import has_app_context

from .. import digests
from ..engine import Attempt, current_attempt
from ..runtime import SAFE_METHODS
from .policy import check_key, new_key


def _claimed() -> tuple[Attempt, bytes] | None:
    """The running idempotent request's attempt and its key, if this is one."""
    attempt = current_attempt() if has_app_context() else None
    if attempt is None or attempt.record_key is None:
        return None
    return attempt, attempt.record_key


def purpose_key(purpose: str) -> str:
    """The key for this request's downstream call named ``purpose``.

    Needs a running idempotent request with a key (as ``derived_key`` does);
    raises ``ValueError`` when this attempt already used ``purpose``.
    """
    claimed = _claimed()
    if claimed is None:
        raise RuntimeError("purpose_key() needs a running idempotent request with a key")
    attempt, record_key = claimed
    if purpose in attempt.purposes:
        raise ValueError(
            f"purpose {purpose!r} already named a call in this request: "
            "give each downstream call a purpose of its own"
        )
    attempt.purposes.add(purpose)
    return digests.derived_key(record_key, purpose)


def set_call_key(method: str, headers: MutableMapping[str, Any], header: str) -> str | None:
    """The key a call sends, set in its ``headers``: none on a safe method; the
    caller's ``header``, checked; else a new one, except inside a claimed request,
    where it must be ``purpose_key()``'s."""
    if method.upper() in SAFE_METHODS:
        return None
    given = headers.get(header)
    if isinstance(given, bytes):
        given = given.decode("ascii", "replace")
    if given:
        key = check_key(given)
    elif _claimed() is not None:
        raise ValueError(
            "a call from an idempotent request needs the key of its purpose, the same in "
            "every attempt: headers={'Idempotency-Key': purpose_key('...')}"
        )
    else:
        key = new_key()
    headers[header] = key
    return key
