"""An attempt's claim decision, as pure functions over plain values.

``decide`` turns what the store (or cache) said into one of a closed set of
outcomes (run, replay, refuse), and ``retry_after_seconds`` says when a refused
duplicate may come back. Neither does I/O nor touches Flask, so every row of the
contract's table for a claim is testable alone. How a finished attempt is settled
(store its answer or release the claim) is asked of the answer itself, in
``engine.Attempt.capture``: whether the route keeps its status, then its size.
"""

from __future__ import annotations

import dataclasses
import enum
import math

from .fingerprint import matches
from .store.base import Claimed, ClaimResult, StoredResponse

#: Run the view: the claim is ours under ``token``; resume after ``phases``, the
#: recovery points a dead holder of the same request committed (``phases.py``).
#: The store's answer is the decision as it stands.
Proceed = Claimed


@dataclasses.dataclass(frozen=True)
class Replay:
    """Answer with the stored response; the view does not run."""

    response: StoredResponse


class Rejection(enum.Enum):
    """Answer with an error, for this reason; the view does not run."""

    KEY_REUSED = "key_reused"
    IN_PROGRESS = "in_progress"


Decision = Proceed | Replay | Rejection


def decide(result: ClaimResult, fingerprint: bytes) -> Decision:
    """A different request under a known key is a 422 before anything else (even
    while the first is still running); then a finished record replays and a running
    one is a 409."""
    if isinstance(result, Claimed):
        return result
    if not matches(result.fingerprint, fingerprint):  # the way the record was written
        return Rejection.KEY_REUSED
    if result.state == "completed" and result.response is not None:
        return Replay(result.response)
    return Rejection.IN_PROGRESS


class Settlement(enum.Enum):
    COMPLETE = "complete"  # store the answer, commit the business transaction
    RELEASE = "release"  # roll back, delete the claim: a retry runs again
    TOO_LARGE = "too_large"  # would have been stored but cannot be: roll back, 500


def retry_after_seconds(configured: int, lease_remaining: float | None) -> int:
    """Whole seconds for a 409: the configured hint, never past the lease's end
    (when a takeover becomes possible), and at least one."""
    if lease_remaining is None or lease_remaining <= 0:
        return max(1, configured)
    return max(1, min(configured, math.ceil(lease_remaining)))
