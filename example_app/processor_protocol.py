"""The card processor protocol of CONTRACT §3 as data: what is sent and what comes back.

Both sides live here so that the fake processor (which writes answers) and the clients
(which read them) cannot drift apart, and so the in-process client parses exactly the
bytes the HTTP service would have sent.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import TypeAlias

# The app derives its processor key from scope and client key; real processors cap
# key length too (Stripe at 255), and a cap keeps the in-memory table bounded per call.
MAX_KEY_LENGTH = 255

_PARAM_FIELDS = ("amount", "currency", "customer", "source")


@dataclass(frozen=True)
class ChargeParams:
    """The parameters a key is bound to; a different set under the same key is a mismatch."""

    amount: int
    currency: str
    customer: str
    source: str

    def to_json(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True)
class ProcessorAnswer:
    """What goes back on the wire, kept as bytes so both clients parse the same thing."""

    status: int
    body: bytes
    content_type: str = "application/json"


class InvalidChargeRequest(ValueError):
    """A call the processor refuses before looking at its key's history."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def parse_charge_params(body: object) -> ChargeParams:
    """Validate a charge body strictly, so that a bug in the app shows up as a 400."""
    if not isinstance(body, dict):
        raise InvalidChargeRequest("invalid_request", "the body must be a JSON object")
    unknown = sorted(set(body) - set(_PARAM_FIELDS))
    if unknown:
        raise InvalidChargeRequest("invalid_request", f"unknown fields: {', '.join(unknown)}")
    amount = body.get("amount")
    if not isinstance(amount, int) or isinstance(amount, bool) or amount <= 0:
        raise InvalidChargeRequest("invalid_request", "amount must be a positive integer")
    texts: dict[str, str] = {}
    for name in _PARAM_FIELDS[1:]:
        value = body.get(name)
        if not isinstance(value, str) or not value:
            raise InvalidChargeRequest("invalid_request", f"{name} must be a non-empty string")
        texts[name] = value
    if len(texts["currency"]) != 3 or not (
        texts["currency"].isascii() and texts["currency"].isalpha()
    ):
        raise InvalidChargeRequest("invalid_request", "currency must be 3 ASCII letters")
    return ChargeParams(amount, texts["currency"], texts["customer"], texts["source"])


def check_key(key: str | None) -> str:
    """The key the processor will remember, or the 400 that says why it will not."""
    if not key:
        raise InvalidChargeRequest("missing_idempotency_key", "Idempotency-Key is required")
    if len(key) > MAX_KEY_LENGTH:
        raise InvalidChargeRequest("invalid_idempotency_key", "Idempotency-Key is too long")
    return key


def json_answer(status: int, payload: dict[str, object]) -> ProcessorAnswer:
    return ProcessorAnswer(status, json.dumps(payload).encode())


INTERNAL_ERROR = json_answer(500, {"status": "error", "code": "internal_error"})
IN_PROGRESS = json_answer(409, {"status": "error", "code": "in_progress"})
MISMATCH = json_answer(400, {"status": "error", "code": "idempotency_mismatch"})
# A proxy's error page served with 200: the body a client must not mistake for a charge.
GARBAGE = ProcessorAnswer(200, b"<html><body>502 Bad Gateway</body></html>", "text/html")


# -- what the app reads: a closed set of outcomes, matched with isinstance or `match` --


@dataclass(frozen=True)
class Charged:
    """Money moved; ``payment_id`` (``py_…``) belongs on the app's charge row."""

    payment_id: str


@dataclass(frozen=True)
class Declined:
    """A final answer (the app's 402, stored for replay); no money moved."""

    payment_id: str


@dataclass(frozen=True)
class ProcessorUnavailable:
    """Anything else: the outcome is unknown, so the app answers 502 and stores nothing."""

    reason: str  # for logs only: the app's answer is the same 502 whatever it says


ChargeOutcome: TypeAlias = Charged | Declined | ProcessorUnavailable


@dataclass(frozen=True)
class NoPayment:
    """A lookup's ``404``: no charge was ever made under that key (the processor never
    saw the call, or refused it before acting)."""


#: What ``GET /v1/charges?idempotency_key=`` tells: the payment made under the key
#: (``Charged``/``Declined``), none (``NoPayment``), or nothing certain (a call under
#: the key still running, an error, no answer: ``ProcessorUnavailable``).
LookupOutcome: TypeAlias = Charged | Declined | NoPayment | ProcessorUnavailable

NOT_FOUND = json_answer(404, {"status": "error", "code": "not_found"})


def outcome_from_answer(status: int, body: bytes) -> ChargeOutcome:
    """Read a processor answer strictly: only the protocol's exact shapes count."""
    if status not in (200, 402):
        code = _error_code(body) if status == 400 else None
        return ProcessorUnavailable(f"processor answered {status}" + (f" {code}" if code else ""))
    expected = "succeeded" if status == 200 else "declined"
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError):
        return ProcessorUnavailable(f"processor answered {status} with a body that is not JSON")
    if not isinstance(payload, dict) or payload.get("status") != expected:
        return ProcessorUnavailable(f"processor answered {status} without status {expected!r}")
    payment_id = payload.get("id")
    if not isinstance(payment_id, str) or not payment_id.startswith("py_"):
        return ProcessorUnavailable(f"processor answered {status} without a py_ id")
    return Charged(payment_id) if status == 200 else Declined(payment_id)


def lookup_from_answer(status: int, body: bytes) -> LookupOutcome:
    """Read a lookup's answer strictly: ``200`` with a payment, ``404``, or unknown."""
    if status == 404:
        return NoPayment()
    if status != 200:
        return ProcessorUnavailable(f"processor answered the lookup with {status}")
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError):
        return ProcessorUnavailable("processor answered the lookup with a body that is not JSON")
    state = payload.get("status") if isinstance(payload, dict) else None
    payment_id = payload.get("id") if isinstance(payload, dict) else None
    if not isinstance(payment_id, str) or not payment_id.startswith("py_"):
        return ProcessorUnavailable("processor answered the lookup without a py_ id")
    if state == "succeeded":
        return Charged(payment_id)
    if state == "declined":
        return Declined(payment_id)
    return ProcessorUnavailable(f"processor answered the lookup with status {state!r}")


def _error_code(body: bytes) -> str | None:
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError):
        return None
    code = payload.get("code") if isinstance(payload, dict) else None
    return code if isinstance(code, str) else None
