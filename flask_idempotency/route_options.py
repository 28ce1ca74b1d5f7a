"""Per-route options of ``@idempotency.required(...)`` and their validation.

The app's settings are validated at ``init_app``; a route's own ``ttl``,
``lease`` and ``wait`` must meet the same rules, and together with the app's
settings the same relation: renewal interval < lease <= TTL. A route whose
TTL is shorter than the app's lease would let any request take over, and
``purge`` delete, a record whose view is still running. Numbers that can be
checked alone fail when the decorator is applied; the relation to the app's
settings fails on the route's first request, before anything is claimed.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from flask import Request

from .settings import CHOICES, FingerprintFunc, ScopeFunc, Settings, ShouldStore

log = logging.getLogger("flask_idempotency.recovery")

#: ``recover=``: ``f(attempt)`` -> what a view may return (the answer to store), or
#: ``None`` ("nothing happened": released). See ``recovery.py``.
RecoverFunc = Callable[[Any], Any]
#: ``recovery_data=``: ``f(request)`` -> JSON that recovery needs beyond the request
#: (say, the principal, which the record only holds hashed).
RecoveryDataFunc = Callable[[Request], Any]


@dataclasses.dataclass(frozen=True)
class RouteOptions:
    """Per-route overrides given to the decorator; ``None`` means the app's setting."""

    required: bool
    ttl: float | None = None
    lease: float | None = None
    wait: float | None = None
    should_store: ShouldStore | None = None
    scope_func: ScopeFunc | None = None
    fingerprint_func: FingerprintFunc | None = None
    #: ``"omit_body"`` or ``"reject"`` (``IDEMPOTENCY_OVERSIZE``).
    oversize: str | None = None
    #: How ``flask idempotency recover`` finishes an abandoned attempt (row mode).
    recover: RecoverFunc | None = None
    recovery_data: RecoveryDataFunc | None = None

    def __post_init__(self) -> None:
        """What can be checked alone fails when the decorator is applied."""
        for name in ("should_store", "scope_func", "fingerprint_func", "recover", "recovery_data"):
            if getattr(self, name) is not None and not callable(getattr(self, name)):
                raise ValueError(f"idempotency route option {name}= must be callable")
        if self.recovery_data is not None and self.recover is None:
            raise ValueError(
                "idempotency route option recovery_data= is only kept for recover=: "
                "give the recovery function too"
            )
        choices = CHOICES["oversize"]
        if self.oversize is not None and self.oversize not in choices:
            raise ValueError(
                f"idempotency route option oversize= must be one of {', '.join(choices)}"
            )
        if self.ttl is not None and self.lease is not None and self.lease > self.ttl:
            raise ValueError(
                f"idempotency route option lease= ({self.lease:g} s) must not exceed "
                f"ttl= ({self.ttl:g} s)"
            )

    def effective(self, settings: Settings) -> EffectiveOptions:
        """The route's values, each falling back to the app's setting of its name."""
        values = {}
        for field in dataclasses.fields(EffectiveOptions):
            own = getattr(self, field.name)
            values[field.name] = getattr(settings, field.name) if own is None else own
        return EffectiveOptions(**values)


@dataclasses.dataclass(frozen=True)
class EffectiveOptions:
    """What one route runs with: its own options over the app's settings."""

    ttl: float
    lease: float
    wait: float
    should_store: ShouldStore
    scope_func: ScopeFunc
    fingerprint_func: FingerprintFunc
    oversize: str


def seconds(
    option: str, value: float | timedelta | None, *, allow_zero: bool = False
) -> float | None:
    """A seconds option as a float (``None`` stays ``None``), or ``ValueError``
    naming ``option`` (``"idempotency route option ttl"``...): route, consumer and
    event options alike."""
    if value is None:
        return None
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{option}= must be a number of seconds")
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        qualifier = "0 or more" if allow_zero else "positive"
        raise ValueError(f"{option}= must be {qualifier}, got {value!r}")
    return float(value)


def route_options(required: bool, **options: Any) -> RouteOptions:
    """A route's options as the decorator got them (``ttl``, ``lease`` and ``wait``
    in seconds, as numbers or ``timedelta``), checked when it is applied; the
    others: the callables and ``oversize`` of :class:`RouteOptions`."""
    for name in ("ttl", "lease", "wait"):
        option = f"idempotency route option {name}"
        options[name] = seconds(option, options.get(name), allow_zero=name == "wait")
    return RouteOptions(required, **options)


def check_against_settings(options: RouteOptions, settings: Settings) -> EffectiveOptions:
    """The route's effective options, or ``ValueError`` if they break the relation
    renewal interval < lease <= TTL together with the app's settings."""
    effective = options.effective(settings)
    interval = settings.renew_interval
    if interval > 0 and interval >= effective.lease:
        raise ValueError(
            f"idempotency route lease ({effective.lease:g} s) must be longer than the app's "
            f"IDEMPOTENCY_LEASE_RENEW_INTERVAL ({interval:g} s): the lease would lapse "
            "between renewals and a live request could be taken over"
        )
    if effective.lease > effective.ttl:
        raise ValueError(
            f"idempotency route ttl ({effective.ttl:g} s) must be at least its lease "
            f"({effective.lease:g} s): pass lease= to the decorator as well, or raise ttl="
        )
    if options.recover is not None and settings.claim_mode != "row":
        # Not refused: a deployment switching modes must not lose its payment route.
        # ``flask idempotency recover`` is what refuses (README "Recovery").
        log.error(
            "idempotency: recover=%s has no effect under IDEMPOTENCY_CLAIM_MODE = %r: a dead "
            "attempt leaves no record there, so nothing can be recovered (needs 'row')",
            getattr(options.recover, "__qualname__", repr(options.recover)),
            settings.claim_mode,
        )
    return effective
