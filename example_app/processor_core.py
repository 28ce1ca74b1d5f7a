"""The fake card processor's behaviour: idempotent charges, a ledger and fault switches.

It knows nothing of HTTP or Flask so that the HTTP service (``processor.py``) and the
in-process client (``processor_client.py``) share one implementation: the example app
then behaves the same whether its processor runs beside it or inside it.

The state lives in memory, in one process. That is the point of a fake (tests read the
ledger directly), and it is why the HTTP service must run with a single worker.
"""

from __future__ import annotations

import json
import secrets
import threading
from dataclasses import asdict, dataclass
from typing import Literal, get_args

from example_app.processor_protocol import (
    GARBAGE,
    IN_PROGRESS,
    INTERNAL_ERROR,
    MISMATCH,
    NOT_FOUND,
    ChargeParams,
    InvalidChargeRequest,
    ProcessorAnswer,
    check_key,
    json_answer,
    parse_charge_params,
)

FailureMode = Literal["500", "timeout", "garbage", "after_charge_500"]
FAILURE_MODES: tuple[FailureMode, ...] = get_args(FailureMode)

CallOutcome = Literal[
    "charged", "declined", "replayed", "in_progress", "mismatch", "failed", "invalid"
]

# A "timeout" failure hangs this long before answering 500: longer than the app's
# default processor timeout (10 s) and idempotency lease (30 s), so from the client's
# side it really is a timeout. reset() wakes a hanging call at once.
DEFAULT_HANG_SECONDS = 60.0

DECLINING_SOURCE_PREFIX = "tok_decline"


@dataclass(frozen=True)
class LedgerEntry:
    """One call as the processor saw it; ``charged`` says whether money moved."""

    seq: int
    key: str | None
    params: ChargeParams | None
    status: int
    outcome: CallOutcome
    payment_id: str | None
    charged: bool

    def to_json(self) -> dict[str, object]:
        data = asdict(self)
        data["params"] = None if self.params is None else self.params.to_json()
        return data


@dataclass
class _KeyRecord:
    params: ChargeParams
    answer: ProcessorAnswer | None = None  # None while the first call is deciding


class FakeProcessor:
    """An idempotent card processor in memory, with switches to make it slow or faulty.

    Thread-safe: one lock guards the state, and no call sleeps while holding it.
    Injected "500", "timeout" and "garbage" failures model a fault in front of the
    processor (a proxy, the network): they neither charge nor claim the key.
    "after_charge_500" lets the processor act, then loses its answer.
    """

    def __init__(self, *, hang_seconds: float = DEFAULT_HANG_SECONDS) -> None:
        self._lock = threading.Lock()
        self._default_hang_seconds = hang_seconds
        self._generation = 0
        self._interrupt = threading.Event()
        self._init_state()

    def _init_state(self) -> None:
        self._keys: dict[str, _KeyRecord] = {}
        self._ledger: list[LedgerEntry] = []
        #: Lookups by key, with the status each got (not in the ledger of calls).
        self._lookups: list[tuple[str, int]] = []
        self._latency = 0.0
        self._failures_left = 0
        self._failure_mode: FailureMode = "500"
        self._hang_seconds = self._default_hang_seconds

    # -- switches ---------------------------------------------------------------

    def set_latency(self, seconds: float) -> None:
        """How long deciding a call takes: the window in which the same key gets 409.

        Answers from a key's history (replay, 409, mismatch) come at once, as from a
        real processor's idempotency cache.
        """
        if seconds < 0:
            raise ValueError("latency must be >= 0")
        with self._lock:
            self._latency = seconds

    def fail_next(self, count: int, mode: FailureMode = "500") -> None:
        """Make the next ``count`` valid calls fail in ``mode`` (replacing any pending)."""
        if count < 0 or mode not in FAILURE_MODES:
            raise ValueError(f"count must be >= 0 and mode one of {FAILURE_MODES}")
        with self._lock:
            self._failures_left, self._failure_mode = count, mode

    def set_hang_seconds(self, seconds: float) -> None:
        """How long a "timeout" failure hangs; only demos need to shorten it."""
        if seconds <= 0:
            raise ValueError("hang_seconds must be > 0")
        with self._lock:
            self._hang_seconds = seconds

    def switches(self) -> dict[str, object]:
        with self._lock:
            return {
                "latency_seconds": self._latency,
                "fail_next": self._failures_left,
                "fail_mode": self._failure_mode,
                "hang_seconds": self._hang_seconds,
            }

    def reset(self) -> None:
        """Forget every key, call and switch, and wake calls that are sleeping."""
        with self._lock:
            self._generation += 1
            self._interrupt.set()
            self._interrupt = threading.Event()
            self._init_state()

    # -- the protocol -----------------------------------------------------------

    def handle_charge(self, key: str | None, body: object) -> ProcessorAnswer:
        """``POST /v1/charges``: the answer for one call, recorded in the ledger."""
        try:
            checked_key = check_key(key)
            params = parse_charge_params(body)
        except InvalidChargeRequest as exc:
            answer = json_answer(400, {"status": "error", "code": exc.code, "message": str(exc)})
            with self._lock:
                self._record(key, None, answer.status, "invalid", None, charged=False)
            return answer

        with self._lock:
            generation, interrupt = self._generation, self._interrupt
            latency, hang = self._latency, self._hang_seconds
            failure: FailureMode | None = None
            if self._failures_left:
                self._failures_left -= 1
                failure = self._failure_mode
        if failure in ("500", "timeout", "garbage"):
            interrupt.wait(hang if failure == "timeout" else latency)
            answer = GARBAGE if failure == "garbage" else INTERNAL_ERROR
            with self._lock:
                if generation == self._generation:
                    self._record(checked_key, params, answer.status, "failed", None, False)
            return answer

        lose_answer = failure == "after_charge_500"
        return self._decide(checked_key, params, latency, generation, interrupt, lose_answer)

    def _decide(
        self,
        key: str,
        params: ChargeParams,
        latency: float,
        generation: int,
        interrupt: threading.Event,
        lose_answer: bool,
    ) -> ProcessorAnswer:
        """Answer from the key's history, or claim the key and charge or decline.

        With ``lose_answer`` the processor still acts (and stores its answer for a
        retry) but sends a 500: the crash-after-charge case a retry must recover from.
        """
        outcome: CallOutcome
        with self._lock:
            record = self._keys.get(key)
            if record is not None:
                if record.params != params:
                    answer, outcome = MISMATCH, "mismatch"
                elif record.answer is None:
                    answer, outcome = IN_PROGRESS, "in_progress"
                else:
                    answer, outcome = record.answer, "replayed"
                payment_id = _payment_id_of(answer)
                sent = INTERNAL_ERROR if lose_answer else answer
                self._record(key, params, sent.status, outcome, payment_id, charged=False)
                return sent
            record = self._keys[key] = _KeyRecord(params)

        interrupt.wait(latency)

        with self._lock:
            if generation != self._generation:
                return INTERNAL_ERROR  # reset() while deciding: this call never happened
            payment_id = "py_" + secrets.token_hex(12)
            if params.source.startswith(DECLINING_SOURCE_PREFIX):
                status, state, outcome = 402, "declined", "declined"
            else:
                status, state, outcome = 200, "succeeded", "charged"
            record.answer = json_answer(status, {"id": payment_id, "status": state})
            sent = INTERNAL_ERROR if lose_answer else record.answer
            self._record(key, params, sent.status, outcome, payment_id, charged=status == 200)
            return sent

    def handle_lookup(self, key: str | None) -> ProcessorAnswer:
        """``GET /v1/charges?idempotency_key=``: the payment made under ``key`` as
        ``200 {"id", "status"}`` (``succeeded`` or ``declined``), ``404`` if none was,
        ``409`` while a call under the key is still deciding. Answered at once, from
        the key's history; the failure switches apply to charges only."""
        try:
            checked_key = check_key(key)
        except InvalidChargeRequest as exc:
            return json_answer(400, {"status": "error", "code": exc.code, "message": str(exc)})
        with self._lock:
            record = self._keys.get(checked_key)
            if record is None:
                answer = NOT_FOUND
            elif record.answer is None:
                answer = IN_PROGRESS
            else:
                payment = json.loads(record.answer.body)
                answer = json_answer(200, {"id": payment["id"], "status": payment["status"]})
            self._lookups.append((checked_key, answer.status))
        return answer

    def _record(
        self,
        key: str | None,
        params: ChargeParams | None,
        status: int,
        outcome: CallOutcome,
        payment_id: str | None,
        charged: bool,
    ) -> None:
        seq = len(self._ledger) + 1
        self._ledger.append(LedgerEntry(seq, key, params, status, outcome, payment_id, charged))

    # -- inspection -------------------------------------------------------------

    def ledger(self) -> list[LedgerEntry]:
        with self._lock:
            return list(self._ledger)

    def lookups(self) -> list[tuple[str, int]]:
        """Every lookup so far: ``(key, status answered)``."""
        with self._lock:
            return list(self._lookups)

    def calls_for(self, key: str) -> int:
        return sum(1 for entry in self.ledger() if entry.key == key)

    def charges_for(self, key: str) -> int:
        """Effective charges under ``key``: the number that must never exceed one."""
        return sum(1 for entry in self.ledger() if entry.key == key and entry.charged)

    def summary(self) -> dict[str, dict[str, int]]:
        """Calls and effective charges per key, for the ledger route and quick asserts."""
        per_key: dict[str, dict[str, int]] = {}
        for entry in self.ledger():
            if entry.key is None:
                continue
            counts = per_key.setdefault(entry.key, {"calls": 0, "charges": 0})
            counts["calls"] += 1
            counts["charges"] += int(entry.charged)
        return per_key


def _payment_id_of(answer: ProcessorAnswer) -> str | None:
    if answer.status not in (200, 402):
        return None
    payment_id = json.loads(answer.body).get("id")
    return payment_id if isinstance(payment_id, str) else None
