"""Recovery points: a view with several external steps commits them one by one.

A single transaction is right for a view with one external call (a charge):
the call uses a derived key, so re-running the whole view after a crash only
makes the processor replay its answer. A view that calls several services in
turn (reserve stock, charge the card, send the confirmation) is different:
the steps before a crash already happened, their local records must not be
written twice, and some services are slow, costly or not idempotent at all.
Those views commit their progress as named phases, as Brandur Leach's
rocket-rides-atomic does with its ``atomic_phase`` and recovery points::

    reservation = idempotency.phase("reserve", lambda: reserve(order))
    payment = idempotency.phase("charge", lambda: charge(order, reservation))

Each step does its external call and writes what came of it on
``idempotency.connection()``; its return value (JSON) is the phase's record.
The step's writes and the record's progress commit together, in one round
trip, fenced by the lock token (``idempotency_checkpoint``): a holder that was
taken over cannot commit a phase any more than it can complete.

On a takeover (a retry after the holder died, or ``flask idempotency
recover``) the view runs from its first line again, and every phase an earlier
attempt committed returns what it recorded instead of running: the view
resumes after its last committed phase. So the code between phases must have
no effects of its own (parsing and validating the request is fine), and a
step that crashed before its commit is run again: give its external call a
derived key (``idempotency.derived_key("reserve")``) so that is harmless.

A record with committed phases is never deleted by a release (a 5xx, an
exception): their writes stand, so it is kept with its lease ended, and the
next identical request resumes it at once; a different request under the key
is then a ``422`` until the TTL.

In ``IDEMPOTENCY_CLAIM_MODE = "transaction"`` nothing is committed before the
view's end, so phases run in the one transaction, without recovery points: a
crash takes all of it back, and a retry runs every step again (under the same
derived keys).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from . import digests
from .errors import LeaseLost, from_store_error
from .store.base import LeaseLostError, StoreUnavailableError

if TYPE_CHECKING:
    from .engine import Attempt

log = logging.getLogger("flask_idempotency.recovery")

T = TypeVar("T")

#: Phase names are stored with the record; they are short identifiers.
MAX_NAME_LENGTH = 100


def run(attempt: Attempt | None, name: str, step: Callable[[], T]) -> Any:
    """``idempotency.phase(name, step)``: the recorded value of the phase ``name``,
    running ``step`` and committing it unless an earlier attempt already did."""
    if attempt is None or (attempt.record_key is not None and attempt.token is None):
        raise RuntimeError("idempotency.phase() needs a running idempotent request")
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_LENGTH:
        raise ValueError(f"a phase name is a str of 1 to {MAX_NAME_LENGTH} characters")
    if name in attempt.phases_reached:
        raise RuntimeError(f"phase {name!r} reached twice in one request: names must be unique")
    attempt.phases_reached.add(name)
    if name in attempt.phases:
        return attempt.phases[name]  # committed by an attempt that was taken over
    value = step()
    try:
        encoded = json.dumps(value, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"phase {name!r} must return JSON: {exc}") from None
    recorded = json.loads(encoded)  # a resumed attempt sees exactly the same value
    retry_after = attempt.app_state.settings.retry_after
    try:
        attempt.checkpoint(name, encoded)
    except LeaseLostError as exc:
        assert attempt.record_key is not None  # (only a claimed record's phase is fenced)
        log.warning(
            "idempotency: lease lost for key %s at phase %r; rolled back",
            digests.log_key(attempt.record_key),
            name,
        )
        raise LeaseLost(retry_after=retry_after) from exc
    except StoreUnavailableError as exc:
        raise from_store_error(exc, retry_after) from exc
    attempt.phases[name] = recorded
    return recorded
