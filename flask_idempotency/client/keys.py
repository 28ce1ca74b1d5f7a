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

from flask import has_app_context

from .. import digests
from ..engine import Attempt, current_attempt
from ..runtime import SAFE_METHODS
from .policy import check_key, new_key


def _claimed() -> Attempt | None:
    """The running idempotent request's attempt, if this is one (and has a key)."""
    attempt = current_attempt() if has_app_context() else None
    return attempt if attempt is not None and attempt.record_key is not None else None


def purpose_key(purpose: str) -> str:
    """The key for this request's downstream call named ``purpose``.

    Needs a running idempotent request with a key (as ``derived_key`` does);
    raises ``ValueError`` when this attempt already used ``purpose``.
    """
    attempt = _claimed()
    if attempt is None or attempt.record_key is None:
        raise RuntimeError("purpose_key() needs a running idempotent request with a key")
    if purpose in attempt.purposes:
        raise ValueError(
            f"purpose {purpose!r} already named a call in this request: "
            "give each downstream call a purpose of its own"
        )
    attempt.purposes.add(purpose)
    return digests.derived_key(attempt.record_key, purpose)


def call_key(method: str, given: str | bytes | None) -> str | None:
    """The key a call sends: none on a safe method; the caller's, checked; else a
    new one, except inside a claimed request, where it must be ``purpose_key()``'s."""
    if method.upper() in SAFE_METHODS:
        return None
    if isinstance(given, bytes):
        given = given.decode("ascii", "replace")
    if given:
        return check_key(given)
    if _claimed() is not None:
        raise ValueError(
            "a call from an idempotent request needs the key of its purpose, the same in "
            "every attempt: headers={'Idempotency-Key': purpose_key('...')}"
        )
    return new_key()
