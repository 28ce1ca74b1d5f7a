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
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Profile:
    name: str
    #: The header that marks a replay (and, if ``mark_originals``, a first answer).
    replayed_header: str
    #: Whether first answers carry ``<replayed_header>: false``.
    mark_originals: bool
    #: Errors as RFC 9457 problem details instead of the Stripe-like object.
    problem_details: bool


STRIPE = Profile("stripe", "Idempotent-Replayed", mark_originals=True, problem_details=False)
IETF = Profile("ietf", "Idempotency-Replayed", mark_originals=False, problem_details=True)
PROFILES = {profile.name: profile for profile in (STRIPE, IETF)}

#: On a replay whose stored body was omitted (over ``IDEMPOTENCY_MAX_STORED_BODY``).
OMITTED_HEADER = "Idempotency-Body-Omitted"
OMITTED_VALUE = "true"

#: Prefix of a problem's ``type`` member; the error code completes it.
DEFAULT_PROBLEM_TYPE_BASE = "urn:flask-idempotency:error:"
