"""The client half's retry rules alone: no HTTP, no clock but the one given."""

from __future__ import annotations

import email.utils
import json
import re

import pytest

from flask_idempotency.client import KeyReused, RetryPolicy
from flask_idempotency.client.policy import (
    Call,
    Verdict,
    check_key,
    classify,
    error_code,
    hash_key,
    new_key,
    replayed,
    retry_after_seconds,
    within,
)
from support.clock import FakeClock

JSON = "application/json"


def stripe(code: str) -> bytes:
    return json.dumps({"error": {"type": "idempotency_error", "code": code}}).encode()


def ietf(code: str, *, with_code: bool = True) -> bytes:
    document = {"type": f"urn:flask-idempotency:error:{code}", "title": code, "status": 409}
    if with_code:
        document["code"] = code
    return json.dumps(document).encode()


@pytest.mark.parametrize(
    ("content_type", "body", "code"),
    [
        (JSON, stripe("in_progress"), "in_progress"),
        ("application/problem+json", ietf("lease_lost"), "lease_lost"),
        ("application/problem+json", ietf("schema_missing", with_code=False), "schema_missing"),
        (JSON, b'{"type": "https://example.com/probs/out-of-credit"}', None),
        (JSON, b"[1, 2]", None),
        (JSON, b"not json", None),
        ("text/html", stripe("in_progress"), None),  # not read: not JSON
        (JSON, b"", None),
        (None, stripe("in_progress"), None),
        (JSON, b'{"error": {"code": 7}}', None),
    ],
)
def test_error_code_reads_both_profiles(
    content_type: str | None, body: bytes, code: str | None
) -> None:
    assert error_code(content_type, body) == code


def test_error_code_ignores_a_huge_body() -> None:
    padded = json.dumps({"error": {"code": "in_progress"}, "pad": "x" * 70_000}).encode()
    assert error_code(JSON, padded) is None


@pytest.mark.parametrize(
    ("status", "headers", "code", "verdict"),
    [
        (201, {}, None, Verdict.FINAL),
        (402, {}, "card_declined", Verdict.FINAL),
        (400, {}, "validation_failed", Verdict.FINAL),
        (404, {}, None, Verdict.FINAL),
        (422, {}, "key_reused", Verdict.KEY_REUSED),
        (422, {}, "validation_failed", Verdict.FINAL),  # a plain validation 422
        (409, {"Retry-After": "1"}, "in_progress", Verdict.IN_PROGRESS),
        (409, {}, "lease_lost", Verdict.IN_PROGRESS),
        (409, {}, "idempotency_key_in_use", Verdict.IN_PROGRESS),  # Stripe's own API
        (409, {}, "duplicate_order", Verdict.FINAL),  # a business conflict
        (409, {}, None, Verdict.FINAL),
        (409, {"Retry-After": "2"}, None, Verdict.FINAL),  # a plain server's conflict
        (408, {}, None, Verdict.RETRY),
        (425, {}, None, Verdict.RETRY),
        (429, {"Retry-After": "3"}, "rate_limited", Verdict.RETRY),
        (503, {"Retry-After": "1"}, "store_unavailable", Verdict.RETRY),
        (500, {}, None, Verdict.RETRY),
        (502, {}, "processor_unavailable", Verdict.RETRY),
        (500, {}, "schema_missing", Verdict.FINAL),
        (500, {}, "schema_outdated", Verdict.FINAL),
        (500, {}, "response_not_storable", Verdict.FINAL),
        (500, {}, "response_too_large", Verdict.FINAL),
        (500, {"Stripe-Should-Retry": "false"}, None, Verdict.FINAL),
        (503, {"Stripe-Should-Retry": " False "}, None, Verdict.FINAL),
        (500, {"Stripe-Should-Retry": "true"}, None, Verdict.RETRY),
        (400, {"Stripe-Should-Retry": "true"}, None, Verdict.FINAL),  # never another 4xx
    ],
)
def test_classify(status: int, headers: dict[str, str], code: str | None, verdict: Verdict) -> None:
    assert classify(status, headers, code) is verdict


def test_retry_after_reads_seconds_and_dates() -> None:
    assert retry_after_seconds(None) is None
    assert retry_after_seconds(" 3 ") == 3.0
    assert retry_after_seconds("soon") is None
    assert retry_after_seconds("-1") is None
    assert retry_after_seconds("\u00b2") is None  # "²".isdigit(), yet no number of seconds
    date = email.utils.formatdate(1_000_030, usegmt=True)
    assert retry_after_seconds(date, now=lambda: 1_000_000) == pytest.approx(30.0)
    assert retry_after_seconds(date, now=lambda: 2_000_000) == 0.0  # a date in the past


def test_replay_marker_in_either_profile() -> None:
    assert replayed({"Idempotent-Replayed": "true"}) is True
    assert replayed({"Idempotent-Replayed": "false"}) is False
    assert replayed({"Idempotency-Replayed": "true"}) is True
    assert replayed({}) is None


def test_keys() -> None:
    assert new_key() != new_key()
    assert check_key(new_key())
    for bad in ("", "a b", "x" * 256, "é", "tab\t", "a,b"):
        with pytest.raises(ValueError):
            check_key(bad)
    assert check_key("x" * 255) and check_key('"quoted"')
    assert hash_key("k") == hash_key("k") != hash_key("K")
    assert re.fullmatch(r"[0-9a-f]{12}", hash_key("k"))


@pytest.mark.parametrize(
    "options",
    [
        {"max_attempts": 0},
        {"deadline": 0},
        {"deadline": float("inf")},
        {"backoff_base": -1},
        {"retry_after_cap": float("nan")},
        {"backoff_max": "1"},
    ],
)
def test_policy_refuses_bad_values(options: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        RetryPolicy(**options)  # type: ignore[arg-type]


def make_call(clock: FakeClock, **options: float) -> Call:
    policy = RetryPolicy(**options)  # type: ignore[arg-type]
    return Call(policy, "k", clock=clock, rng=lambda low, high: high)  # the ceiling: no luck


def test_backoff_doubles_to_its_cap_with_full_jitter() -> None:
    clock = FakeClock(100.0)
    call = make_call(clock, max_attempts=10, backoff_base=0.5, backoff_max=3.0, deadline=1000)
    waits = [call.after_error(TimeoutError()) for _ in range(6)]
    assert waits == [0.5, 1.0, 2.0, 3.0, 3.0, 3.0]
    draws: list[tuple[float, float]] = []

    def draw(low: float, high: float) -> float:
        draws.append((low, high))
        return 0.1

    assert Call(RetryPolicy(), "k", rng=draw).after_error(OSError()) == 0.1
    assert draws == [(0.0, 0.5)]


def test_retry_after_is_honoured_and_capped() -> None:
    clock = FakeClock(100.0)
    call = make_call(clock, retry_after_cap=5.0)
    assert call.after_answer(503, {"Retry-After": "2"}, None, None) == 2.0
    assert call.after_answer(429, {"Retry-After": "600"}, None, None) == 5.0
    assert call.reasons == ["status 503", "status 429"]


def test_attempts_run_out() -> None:
    call = make_call(FakeClock(100.0), max_attempts=3)
    assert call.after_answer(500, {}, None, None) is not None
    assert call.after_error(ConnectionResetError()) is not None
    assert call.after_answer(502, {}, None, None) is None
    assert call.exhausted == "attempts"
    assert call.outcome(502, {}).exhausted == "attempts"


def test_in_progress_polls_spend_the_deadline_not_the_attempts_and_slow_down() -> None:
    clock = FakeClock(100.0)
    call = make_call(clock, max_attempts=2, deadline=60.0, backoff_base=0.5, backoff_max=4.0)
    headers = {"Retry-After": "1", "Content-Type": JSON}
    waits = []
    for _ in range(100):  # bounded: a wait of 0 must fail here, not hang
        wait = call.after_answer(409, headers, stripe("in_progress"), None)
        if wait is None:
            break
        waits.append(wait)
        clock.now += wait
    # Retry-After while it is the longer wait, then the backoff's ceiling (this rng's draw).
    assert waits[:4] == [1.0, 1.0, 2.0, 4.0] and set(waits[4:]) == {4.0}
    assert call.failures == 0 and call.exhausted == "deadline" and call.polls == len(waits) + 1
    assert clock.now - 100.0 > 60.0 * 0.85  # polled until near the deadline


def test_in_progress_without_retry_after_is_no_busy_loop() -> None:
    clock = FakeClock(100.0)
    policy = RetryPolicy(deadline=5.0, backoff_base=0.25, backoff_max=2.0)
    call = Call(policy, "k", clock=clock, rng=lambda low, high: low)  # the shortest draw
    polls = 0
    for headers in [{"Retry-After": "0"}, {}] * 50:
        wait = call.after_answer(
            409, {**headers, "Content-Type": JSON}, stripe("in_progress"), None
        )
        if wait is None:
            break
        polls += 1
        clock.now += wait
    # A 5 s deadline, waits of at least half the growing ceiling: polls until near it.
    assert 4 <= polls < 12 and call.exhausted == "deadline", polls


def test_a_wait_past_the_deadline_ends_the_call_now() -> None:
    call = make_call(FakeClock(100.0), deadline=3.0, retry_after_cap=10.0)
    assert call.after_answer(503, {"Retry-After": "5"}, None, None) is None
    assert call.exhausted == "deadline"


def test_no_retry_starts_with_a_sliver_of_the_deadline_left() -> None:
    """A retry with 0.1 s left would end in a timeout (outcome unknown) where the
    503 in hand says plainly that nothing was done: it is returned instead."""
    clock = FakeClock(100.0)
    call = make_call(clock, deadline=10.0)
    clock.now += 8.5
    assert call.after_answer(503, {"Retry-After": "0"}, None, None) == 0.0  # 1.5 s left
    clock.now += 0.6
    assert call.after_answer(503, {"Retry-After": "0"}, None, None) is None  # 0.9 s left
    assert call.exhausted == "deadline"


def test_the_outcome_rides_on_the_error_a_call_ends_with() -> None:
    call = make_call(FakeClock(100.0))
    call.begin_attempt()
    error = TimeoutError("read timed out")
    assert call.gave_up(error) is error
    assert error.idempotency.key == "k" and error.idempotency.attempts == 1  # type: ignore[attr-defined]


def test_each_attempt_is_cut_to_what_is_left_of_the_deadline() -> None:
    clock = FakeClock(100.0)
    call = make_call(clock, deadline=10.0)
    assert call.begin_attempt() == 10.0
    assert within(None, 10.0) == 10.0
    clock.now += 8.0
    left = call.begin_attempt()
    assert within(5.0, left) == 2.0
    assert within(1.0, call.begin_attempt()) == 1.0
    assert call.attempts == 3


def test_key_reused_raises_naming_the_key_hashed() -> None:
    call = make_call(FakeClock(100.0))
    answer = object()
    with pytest.raises(KeyReused) as raised:
        call.after_answer(422, {"Content-Type": JSON}, stripe("key_reused"), answer)
    assert raised.value.key == "k" and raised.value.response is answer
    assert hash_key("k") in str(raised.value)
    assert call.attempts == 0 and call.failures == 0


def test_a_body_sent_once_is_never_retried() -> None:
    call = Call(RetryPolicy(), "k", resendable=False)
    assert call.after_answer(503, {"Retry-After": "0"}, None, None) is None
    assert call.after_error(TimeoutError()) is None
    assert call.exhausted == "body"
