"""Keys for the calls a claimed request makes downstream, one per purpose.

``idempotency.derived_key(purpose)`` gives the same key for the same purpose
in every attempt at a record, which is what makes a retried view safe to call
out again. Used for two calls in one attempt, it would make the second call
look like a retry of the first (the downstream service would replay the first
answer, or refuse); ``purpose_key`` refuses that instead.
"""

from __future__ import annotations

from .. import digests
from ..engine import current_attempt


def purpose_key(purpose: str) -> str:
    """The key for this request's downstream call named ``purpose``.

    Needs a running idempotent request with a key (as ``derived_key`` does);
    raises ``ValueError`` when this attempt already used ``purpose``.
    """
    attempt = current_attempt()
    if attempt is None or attempt.record_key is None:
        raise RuntimeError("purpose_key() needs a running idempotent request with a key")
    if purpose in attempt.purposes:
        raise ValueError(
            f"purpose {purpose!r} already named a call in this request: "
            "give each downstream call a purpose of its own"
        )
    attempt.purposes.add(purpose)
    return digests.derived_key(attempt.record_key, purpose)
