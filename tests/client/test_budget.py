"""The retry budget shared by many calls: retries stay a fraction of the calls."""

from __future__ import annotations

import httpx
import pytest

from flask_idempotency.client import IdempotentTransport, RetryBudget, RetryPolicy
from flask_idempotency.client.policy import Call
from support.clock import FakeClock
from support.scripted_http import Answer, ScriptedServer


def test_retries_are_a_fraction_of_the_calls_in_the_window_plus_the_reserve() -> None:
    clock = FakeClock()
    budget = RetryBudget(ratio=0.1, per_second=0.2, window=10.0, clock=clock)  # reserve: 2
    for _ in range(30):
        budget.deposit()
    allowed = sum(budget.withdraw() for _ in range(100))
    assert allowed == 5  # 0.1 x 30 calls + 2
    clock.now += 10.0  # the window has passed: its calls and retries are forgotten
    assert [budget.withdraw() for _ in range(3)] == [True, True, False]


def test_an_outage_does_not_multiply_the_load() -> None:
    """1,000 calls that each meet a 503 make at most ratio x calls + reserve retries,
    not the (max_attempts - 1) x 1,000 their own limits would allow."""
    clock = FakeClock()
    policy = RetryPolicy(max_attempts=4, budget=RetryBudget(0.2, 1.0, clock=clock))
    retries = 0
    for _ in range(1000):
        call = Call(policy, "k", clock=clock, rng=lambda low, high: 0.0)
        while call.after_answer(503, {}, None, None) is not None:
            retries += 1
        assert call.exhausted in ("budget", "attempts")
    assert retries == 0.2 * 1000 + 10


def test_in_progress_polls_do_not_draw_on_the_budget() -> None:
    clock = FakeClock()
    policy = RetryPolicy(budget=RetryBudget(ratio=0.0, per_second=0.0, clock=clock))
    call = Call(policy, "k", clock=clock, rng=lambda low, high: low)
    body = b'{"error": {"code": "in_progress"}}'
    headers = {"Content-Type": "application/json", "Retry-After": "1"}
    assert call.after_answer(409, headers, body, None) == 1.0
    assert call.after_answer(503, {}, None, None) is None and call.exhausted == "budget"


@pytest.mark.parametrize("options", [{"ratio": -1}, {"per_second": float("inf")}, {"window": 0}])
def test_bad_budgets_are_refused(options: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        RetryBudget(**options)  # type: ignore[arg-type]


def test_a_spent_budget_returns_the_answer_in_hand() -> None:
    policy = RetryPolicy(backoff_base=0.01, budget=RetryBudget(ratio=0.0, per_second=0.1))
    with ScriptedServer() as server:  # a reserve of one retry in ten seconds
        server.script([Answer(503)] * 3, Answer(201))
        with httpx.Client(transport=IdempotentTransport(policy)) as client:
            first = client.post(server.url + "/pay")
            second = client.post(server.url + "/pay")
    assert first.status_code == 503 and first.extensions["idempotency"].attempts == 2
    assert second.status_code == 503 and second.extensions["idempotency"].exhausted == "budget"
    assert len(server.seen) == 3
