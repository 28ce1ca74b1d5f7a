"""When a retried call may be sent again, and how long to wait: no I/O, no HTTP client.

The client half of the protocol: a logical call keeps one key across all its
attempts, so whatever the first attempt did on the server, a retry either
replays its stored answer or runs it for the first time, never twice. That
makes a retry after a dropped answer safe; what is left to decide is which
answers a retry can change. The rules, for the two HTTP clients' adapters
(``requests_adapter``, ``httpx_transport``) alike:

- a connection error or timeout, before or after the request was sent: retry;
- ``409`` from a request still running (``in_progress``, ``lease_lost``,
  Stripe's ``idempotency_key_in_use``), ``408``, ``425``, ``429``, ``503``:
  retry after ``Retry-After`` (capped), else after a backoff;
- another ``5xx``: retry with exponential backoff and full jitter, unless the
  answer says a retry cannot help (``Stripe-Should-Retry: false``, or a final
  code such as ``schema_missing``);
- ``422 key_reused``: raise ``KeyReused``; every other answer is final.

The codes, header names and key rules are the server's own (``errors``,
``profiles``, ``keys``), so the two halves cannot drift apart.

A call ends at whichever comes first of ``max_attempts`` failed attempts and
its ``deadline``; a ``409`` in progress does not count as a failure (the
server is doing the work), only against the deadline, and the waits between
such polls grow as the backoff's do. No retry starts with less than a tenth of
the deadline left: it would most likely end in a timeout, an unknown outcome,
where the answer in hand is a known one.
"""

from __future__ import annotations

import dataclasses
import email.utils
import enum
import hashlib
import json
import math
import random
import re
import time
import uuid
from collections.abc import Callable, Mapping

from .. import errors
from ..digests import log_key
from ..keys import parse_key
from ..profiles import IETF, PROBLEM_TYPE_BASE, SHOULD_RETRY_HEADER, STRIPE
from .budget import RetryBudget

#: Answers that mean "not now", each with the server's ``Retry-After`` when it has one.
RETRY_LATER = frozenset({408, 425, 429, 503})
#: A ``409`` with one of these codes is a request under the same key still running
#: (the last is Stripe's own API's).
IN_PROGRESS_CODES = frozenset(
    {errors.RequestInProgress.error_code, errors.LeaseLost.error_code, "idempotency_key_in_use"}
)
#: ``5xx`` codes that a retry cannot change: the server's set-up or the answer itself.
FINAL_CODES = frozenset(
    error.error_code
    for error in (
        errors.SchemaMissing,
        errors.SchemaOutdated,
        errors.ResponseNotStorable,
        errors.ResponseTooLarge,
    )
)
#: An error body is a few hundred bytes; a larger one is not read for its code.
MAX_ERROR_BODY = 64 * 1024
_DELAY_SECONDS = re.compile(r"[0-9]+")
#: The part of the deadline that must be left for a retry to start.
MIN_ATTEMPT_SHARE = 0.1


class Verdict(enum.Enum):
    """What an answer means for the call it ends or continues."""

    FINAL = "final"
    #: A request under the same key is still running: wait and ask again.
    IN_PROGRESS = "in_progress"
    RETRY = "retry"
    KEY_REUSED = "key_reused"


class KeyReused(Exception):
    """The server already holds this key for a different request (``422 key_reused``).

    Never retried: the same request under the same key would get the same answer.
    ``key`` is the caller's key; the message names it hashed, since messages end up
    in logs. ``response`` is the server's answer (a requests or httpx response).
    """

    def __init__(self, key: str, response: object = None) -> None:
        super().__init__(
            f"Idempotency-Key (sha256 {hash_key(key)}) was already used for a different "
            "request (422 key_reused); use a new key for a new request"
        )
        self.key = key
        self.response = response


@dataclasses.dataclass(frozen=True)
class CallOutcome:
    """What happened to one logical call, readable on its response."""

    #: The key every attempt sent (``None`` for a safe method, which sends none).
    key: str | None
    #: Requests sent, the first included.
    attempts: int
    #: ``True`` or ``False`` when the server said (``Idempotent-Replayed``,
    #: ``Idempotency-Replayed``); ``None`` when it did not (a plain server, or an
    #: ``ietf`` profile's first answer, which carries no marker).
    replayed: bool | None
    #: The final answer's status; ``None`` when the call ended on an error.
    status: int | None
    #: Why each retry was made, in order (``"status 503"``, ``"ReadTimeout"``...).
    reasons: tuple[str, ...] = ()
    #: Set when the call stopped while a retry could still have helped:
    #: ``"attempts"``, ``"deadline"``, ``"budget"`` (the policy's shared
    #: ``RetryBudget`` was spent), or ``"body"`` (a streamed request body, which
    #: cannot be sent twice).
    exhausted: str | None = None


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """How persistent one logical call is. The defaults suit a payment API call."""

    #: Failed attempts a call may make, the first included (``409`` in progress
    #: answers do not count: they wait within the deadline).
    max_attempts: int = 4
    #: Seconds from a call's start after which no attempt starts and each
    #: attempt's timeout is cut to what is left.
    deadline: float = 30.0
    #: First backoff ceiling; it doubles per failure up to ``backoff_max``. Full
    #: jitter: the wait is uniform in ``[0, ceiling]``, so clients spread out.
    backoff_base: float = 0.5
    backoff_max: float = 8.0
    #: The longest ``Retry-After`` honoured as such; a longer one waits this long.
    retry_after_cap: float = 10.0
    #: The header the key goes in (the server's ``IDEMPOTENCY_KEY_HEADER``).
    key_header: str = "Idempotency-Key"
    #: Retries shared by every call of this policy (``budget.RetryBudget``); without
    #: one, only each call's own limits apply.
    budget: RetryBudget | None = None

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        for name in ("deadline", "backoff_base", "backoff_max", "retry_after_cap"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and 0 <= value < math.inf):
                raise ValueError(f"{name} must be a finite number of seconds >= 0: {value!r}")
        if self.deadline <= 0:
            raise ValueError("deadline must be > 0")

    def ceiling(self, failures: int) -> float:
        """The longest wait after the ``failures``-th failure: doubling, capped."""
        return min(self.backoff_max, self.backoff_base * 2.0 ** max(failures - 1, 0))

    def backoff(self, failures: int, rng: Callable[[float, float], float]) -> float:
        """The wait after the ``failures``-th failure: full jitter under its ceiling."""
        return rng(0.0, self.ceiling(failures))


def within(given: float | None, left: float) -> float:
    """One of the caller's timeouts (``None``: none) cut to ``left`` seconds."""
    return left if given is None else min(given, left)


def new_key() -> str:
    """A fresh key for a call whose caller gave none: a UUID4, kept across its retries."""
    return str(uuid.uuid4())


def check_key(key: str) -> str:
    """``key`` if the server would take it as it is sent (``keys.parse_key``, with no
    surrounding blanks): a ``ValueError`` now beats a ``400 invalid_key`` later."""
    try:
        accepted = isinstance(key, str) and key == key.strip(" \t") and parse_key(key) is not None
    except errors.InvalidKey:
        accepted = False
    if not accepted:
        raise ValueError("an idempotency key is 1 to 255 visible ASCII characters, one value")
    return key


def hash_key(key: str) -> str:
    """A short label for logs and metrics (the server's ``log_key`` of the key's
    SHA-256): enough to correlate, nothing to replay."""
    return log_key(hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest())


def error_code(content_type: str | None, body: bytes | None) -> str | None:
    """The error's ``code`` in either profile's body: ``{"error": {"code"}}``
    (``stripe``), or problem details' ``code`` or ``type`` (``ietf``)."""
    if not body or len(body) > MAX_ERROR_BODY or "json" not in (content_type or "").lower():
        return None
    try:
        document = json.loads(body)
    except ValueError:
        return None
    if not isinstance(document, dict):
        return None
    nested = document.get("error")
    code = nested.get("code") if isinstance(nested, dict) else document.get("code")
    if isinstance(code, str):
        return code
    problem_type = document.get("type")
    if isinstance(problem_type, str) and problem_type.startswith(PROBLEM_TYPE_BASE):
        return problem_type[len(PROBLEM_TYPE_BASE) :]
    return None


def retry_after_seconds(value: str | None, now: Callable[[], float] = time.time) -> float | None:
    """``Retry-After`` as seconds from now (RFC 9110 §10.2.3: delay-seconds or an
    HTTP-date); ``None`` when absent or unreadable."""
    if value is None:
        return None
    value = value.strip()
    if _DELAY_SECONDS.fullmatch(value):
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    return max(0.0, when.timestamp() - now())


def classify(status: int, headers: Mapping[str, str], code: str | None) -> Verdict:
    """What an answer means for its call (see the module's docstring)."""
    if status == errors.KeyReused.code and code == errors.KeyReused.error_code:
        return Verdict.KEY_REUSED
    if (headers.get(SHOULD_RETRY_HEADER) or "").strip().lower() == "false":
        return Verdict.FINAL
    if status == 409:  # a plain server's 409 is a conflict a retry cannot change
        return Verdict.IN_PROGRESS if code in IN_PROGRESS_CODES else Verdict.FINAL
    if status in RETRY_LATER:
        return Verdict.RETRY
    if status >= 500:
        return Verdict.FINAL if code in FINAL_CODES else Verdict.RETRY
    return Verdict.FINAL


def replayed(headers: Mapping[str, str]) -> bool | None:
    """The server's replay marker, in either profile; ``None`` when it sent none."""
    for name in (STRIPE.replayed_header, IETF.replayed_header):
        value = headers.get(name)
        if value is not None:
            return value.strip().lower() == "true"
    return None


@dataclasses.dataclass
class Call:
    """One logical call's retry state, driven by an adapter's send loop:
    ``begin_attempt()``, send, then ``after_answer()`` or ``after_error()``,
    which return the seconds to wait before the next attempt, or ``None``: done."""

    policy: RetryPolicy
    key: str | None
    #: ``False`` for a body that cannot be sent twice: the call makes one attempt.
    resendable: bool = True
    clock: Callable[[], float] = time.monotonic
    rng: Callable[[float, float], float] = random.uniform
    started: float = dataclasses.field(init=False)
    attempts: int = 0
    failures: int = 0
    #: ``409`` in progress answers so far: their waits grow like the backoff's.
    polls: int = 0
    reasons: list[str] = dataclasses.field(default_factory=list)
    exhausted: str | None = None

    def __post_init__(self) -> None:
        self.started = self.clock()
        if self.policy.budget is not None:
            self.policy.budget.deposit()

    def remaining(self) -> float:
        return self.started + self.policy.deadline - self.clock()

    def begin_attempt(self) -> float:
        """Count an attempt and return the seconds left of the deadline, which
        bound each of its timeouts (``within``)."""
        self.attempts += 1
        return max(self.remaining(), 0.001)

    def after_answer(
        self, status: int, headers: Mapping[str, str], body: bytes | None, response: object
    ) -> float | None:
        """The wait before retrying this answer, or ``None`` to return it."""
        verdict = classify(status, headers, error_code(headers.get("Content-Type"), body))
        if verdict is Verdict.KEY_REUSED and self.key is not None:
            raise KeyReused(self.key, response)
        if verdict in (Verdict.FINAL, Verdict.KEY_REUSED):
            return None
        asked = retry_after_seconds(headers.get("Retry-After"))
        if asked is not None:
            asked = min(asked, self.policy.retry_after_cap)
        if verdict is Verdict.IN_PROGRESS:
            # Polling a running request: never faster than the backoff's ceiling
            # allows (a missing or zero Retry-After would make it a busy loop).
            self.polls += 1
            ceiling = self.policy.ceiling(self.polls)
            wait = max(asked or 0.0, self.rng(ceiling / 2, ceiling))
            return self._retry(f"status {status}", counted=False, wait=wait)
        return self._retry(f"status {status}", counted=True, wait=asked)

    def after_error(self, error: BaseException) -> float | None:
        """The wait before retrying after a connection error or timeout, or
        ``None``: re-raise it."""
        return self._retry(type(error).__name__, counted=True, wait=None)

    def _retry(self, reason: str, *, counted: bool, wait: float | None) -> float | None:
        if not self.resendable:
            self.exhausted = "body"
            return None
        if counted:
            self.failures += 1
            if self.failures >= self.policy.max_attempts:
                self.exhausted = "attempts"
                return None
        if wait is None:
            wait = self.policy.backoff(max(self.failures, 1), self.rng)
        if wait + self.policy.deadline * MIN_ATTEMPT_SHARE > self.remaining():
            self.exhausted = "deadline"
            return None
        if counted and self.policy.budget is not None and not self.policy.budget.withdraw():
            self.exhausted = "budget"
            return None
        self.reasons.append(reason)
        return wait

    def gave_up(self, error: BaseException) -> BaseException:
        """``error``, the call's last, with the outcome attached as
        ``error.idempotency`` (the key to call again with, the attempts made)."""
        try:
            error.idempotency = self.outcome(None, None)  # type: ignore[attr-defined]
        except AttributeError:  # an exception type with __slots__
            pass
        return error

    def outcome(self, status: int | None, headers: Mapping[str, str] | None) -> CallOutcome:
        return CallOutcome(
            key=self.key,
            attempts=self.attempts,
            replayed=None if headers is None else replayed(headers),
            status=status,
            reasons=tuple(self.reasons),
            exhausted=self.exhausted,
        )
