"""API conventions the extension speaks: the error format and the replay headers.

Two profiles, chosen with ``IDEMPOTENCY_PROFILE``; statuses are the same in both.

- ``stripe`` (the default): errors are ``{"error": {"type", "code", "message"}}``
  as ``application/json``; every answer the view produced or that replays one
  carries ``Idempotent-Replayed: true|false``, as Stripe's API does.
- ``ietf``: errors are RFC 9457 problem details (``application/problem+json``
  with ``type``, ``title``, ``status``, ``detail`` and a stable ``code``), as in
  draft-ietf-httpapi-idempotency-key-header's examples; only a replay is marked,
  with ``Idempotency-Replayed: true``.

In both, a replay whose body was too large to store says so with
``Idempotency-Body-Omitted: true`` (a name of its own: one header per meaning).

The ``stripe`` profile also sends what Stripe's SDKs read: the answers to a keyed
request (once its scope and body are read) echo its ``Idempotency-Key``, and the
extension's errors that a retry cannot change (its ``400``s, ``422``, and the final ``500``s) carry
``Stripe-Should-Retry: false``, since those SDKs otherwise retry every ``500``.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Profile:
    name: str
    #: The header that marks a replay (and, in the ``stripe`` profile, a first answer).
    replayed_header: str
    #: Stripe's conventions: JSON errors, first answers marked ``false``, the key
    #: echoed and ``Stripe-Should-Retry``. Otherwise the IETF draft's: problem
    #: details, only replays marked.
    stripe: bool


STRIPE = Profile("stripe", "Idempotent-Replayed", stripe=True)
IETF = Profile("ietf", "Idempotency-Replayed", stripe=False)
PROFILES = {profile.name: profile for profile in (STRIPE, IETF)}

#: On a replay whose stored body was omitted (over ``IDEMPOTENCY_MAX_STORED_BODY``).
OMITTED_HEADER = "Idempotency-Body-Omitted"
OMITTED_VALUE = "true"
#: Stripe's SDKs retry a ``409`` or a ``5xx`` unless this says ``false``.
SHOULD_RETRY_HEADER = "Stripe-Should-Retry"

#: Prefix of a problem's ``type`` member, completed by the error code. Not a
#: setting: RFC 9457 asks only that a type be a stable URI, and a URN is one; the
#: ``code`` member is what clients branch on.
PROBLEM_TYPE_BASE = "urn:flask-idempotency:error:"
