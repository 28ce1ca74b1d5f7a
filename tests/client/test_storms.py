"""The retrying client (``flask_idempotency.client``) through a proxy that fails a third
of its requests, against the real stack.

A storm sends many logical calls, each with a key of its own, and the proxy fails
requests at random in the three ways a network can (``Fault``): the request never
arrives, the answer is lost after the server acted, the answer comes too late. The
client must get every call a ``201`` in the end, and the server must have run each
call once: one processor charge and one charge row per call, and the answer the
client holds names that charge. Counted at the sources of truth (the processor's
ledger and the charges table), never from the answers alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import random
import time
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import requests
from reliability.figures import Figures
from reliability.stack import Stack

from flask_idempotency.client import (
    AsyncIdempotentTransport,
    CallOutcome,
    IdempotentSession,
    IdempotentTransport,
    KeyReused,
    RetryPolicy,
)
from support.tcp_proxy import Fault, ScriptedFaults, TcpProxy
from support.waiting import wait_until

pytestmark = pytest.mark.reliability

#: Twelve attempts, not the usual handful: each attempt is faulted with probability
#: 1/3, so a call fails all of n attempts with probability 3**-n, and the storms make
#: about 550 calls a run. At n = 8 one run in twelve would see a call spend its whole
#: budget on faults; at n = 12, one in a thousand. The deadline is never reached.
POLICY = RetryPolicy(
    max_attempts=12, deadline=60.0, backoff_base=0.05, backoff_max=1.0, retry_after_cap=5.0
)
#: Per attempt. The app answers a charge in milliseconds, so it is mostly a ``HOLD``
#: that meets it; each hold costs a client thread this long, so it sets the storms'
#: pace. A busy machine may let a real answer miss it too, which is one more retry.
ATTEMPT_TIMEOUT = 1.0
#: Longer than ``ATTEMPT_TIMEOUT``: a held answer always ends in the client's timeout.
HOLD_SECONDS = 3.0
FAULT_RATE = 1 / 3
CLIENT_THREADS = 8
REQUESTS_CALLS = 300
HTTPX_CALLS = 200
ASYNC_CALLS = 50
#: The slow call's processor latency: longer than one ``Retry-After`` (1 s), so its
#: duplicate is answered ``409 in_progress`` at least once before the replay.
SLOW_SECONDS = 2.5
#: Per attempt for the slow call and its duplicate: they must outwait the processor.
SLOW_TIMEOUT = 10.0
#: The app's ``Retry-After`` on a ``409 in_progress`` (IDEMPOTENCY_RETRY_AFTER's default).
RETRY_AFTER = 1.0


class Schedule:
    """The proxy's schedule: each request faulted with probability ``rate``, the three
    faults equally likely, from a seeded generator (the proxy calls it one request at
    a time, so the sequence is the seed's); counts the requests it was asked about."""

    def __init__(self, seed: int, rate: float = FAULT_RATE) -> None:
        self.rng = random.Random(seed)
        self.rate = rate
        self.requests = 0

    def __call__(self) -> Fault | None:
        self.requests += 1
        if self.rng.random() >= self.rate:
            return None
        return self.rng.choice(list(Fault))


def charge_body(customer: str, amount: int) -> dict[str, Any]:
    return {"amount": amount, "currency": "usd", "customer": customer, "source": "tok_visa"}


def auth(api_key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"}


@dataclasses.dataclass(frozen=True)
class Result:
    """One logical call as the client ended it."""

    customer: str
    amount: int
    status: int
    body: dict[str, Any]
    outcome: CallOutcome
    seconds: float


def result(
    customer: str, amount: int, response: requests.Response | httpx.Response, started: float
) -> Result:
    """The call's ``Result``, its outcome where each library's response carries it."""
    outcome: CallOutcome
    if isinstance(response, httpx.Response):
        outcome = response.extensions["idempotency"]
    else:
        outcome = response.idempotency  # type: ignore[attr-defined]
    body = response.json()
    return Result(customer, amount, response.status_code, body, outcome, time.monotonic() - started)


@dataclasses.dataclass(frozen=True)
class Storm:
    results: list[Result]
    seconds: float
    #: Requests the proxy saw (each an attempt) and the faults it applied, this storm's.
    requests_seen: int
    faults: Counter[Fault]


def run_storm(proxy: TcpProxy, seed: int, send: Callable[[], list[Result]]) -> Storm:
    """``send`` the storm's calls through ``proxy`` under a seeded schedule."""
    schedule = Schedule(seed)
    before = proxy.faults
    proxy.inject(schedule, hold_seconds=HOLD_SECONDS)
    started = time.monotonic()
    try:
        results = send()
    finally:
        proxy.inject(None)
    seconds = time.monotonic() - started
    return Storm(results, seconds, schedule.requests, proxy.faults - before)


def in_threads(
    calls: Iterable[tuple[str, int]], call: Callable[[str, int], Result]
) -> list[Result]:
    with ThreadPoolExecutor(CLIENT_THREADS, thread_name_prefix="client") as pool:
        return list(pool.map(lambda args: call(*args), calls))


def customers(prefix: str, count: int) -> list[tuple[str, int]]:
    """``(customer, amount)`` for ``count`` calls: a customer stands for a call's key."""
    return [(f"{prefix}{i}", 1000 + i) for i in range(count)]


def charges_by_customer(stack: Stack, prefix: str) -> dict[str, list[tuple[str, str]]]:
    """``customer -> [(charge id, payment id)]`` from the charges table."""
    rows = stack.query(
        "SELECT customer, id, payment_id FROM charges WHERE customer LIKE %s ORDER BY seq",
        (prefix.replace("_", r"\_") + "%",),
    )
    found: dict[str, list[tuple[str, str]]] = {}
    for customer, charge_id, payment_id in rows:
        found.setdefault(customer, []).append((charge_id, payment_id))
    return found


def ledger_by_customer(stack: Stack, prefix: str) -> dict[str, list[dict[str, Any]]]:
    found: dict[str, list[dict[str, Any]]] = {}
    for entry in stack.ledger():
        customer = str((entry.get("params") or {}).get("customer", ""))
        if customer.startswith(prefix):
            found.setdefault(customer, []).append(entry)
    return found


def assert_charged_once(stack: Stack, prefix: str, results: list[Result]) -> None:
    """Each call's answer names the one charge row of its customer, and that row the
    one payment the processor made for it, in one call; nobody else was charged."""
    rows = charges_by_customer(stack, prefix)
    ledger = ledger_by_customer(stack, prefix)
    assert set(rows) == set(ledger) == {r.customer for r in results}, "charged someone else"
    for result in results:
        customer = result.customer
        assert len(rows[customer]) == 1, f"{customer}: {len(rows[customer])} charge rows"
        calls = ledger[customer]
        assert len(calls) == 1, f"{customer}: the processor was called {len(calls)} times"
        assert calls[0]["charged"], f"{customer}: {calls[0]['outcome']}"
        charge_id, payment_id = rows[customer][0]
        assert calls[0]["payment_id"] == payment_id, customer
        body = result.body
        assert body["id"] == charge_id, f"{customer}: the answer is not the stored charge"
        assert (body["customer"], body["amount"]) == (customer, result.amount)


def assert_storm(stack: Stack, prefix: str, storm: Storm) -> None:
    results = storm.results
    failed = [(r.customer, r.status, r.outcome) for r in results if r.status != 201]
    assert not failed, f"calls that did not end in 201: {failed[:5]}"
    assert_charged_once(stack, prefix, results)
    assert len({r.outcome.key for r in results}) == len(results), "a key made twice"
    # A key of its own per call: a replay can only answer a retry, and only after
    # the server acted on an attempt whose answer was lost.
    assert all(r.outcome.replayed is not None for r in results)
    lone_replays = [r.customer for r in results if r.outcome.replayed and r.outcome.attempts == 1]
    assert not lone_replays, f"replayed on a first attempt: {lone_replays[:5]}"
    assert any(r.outcome.replayed for r in results), "no answer was a replay"
    assert any(r.outcome.attempts > 1 for r in results), "no call was retried"
    assert all(storm.faults[fault] > 0 for fault in Fault), storm.faults
    # Every attempt the client counted is one request the proxy saw: no retry hidden
    # below the client's count (urllib3's, httpcore's), none counted and not sent.
    assert sum(r.outcome.attempts for r in results) == storm.requests_seen


def report(figures: Figures, storm: Storm) -> None:
    results = storm.results
    attempts = [r.outcome.attempts for r in results]
    reasons = Counter(reason for r in results for reason in r.outcome.reasons)
    figures(
        calls=len(results),
        attempts=sum(attempts),
        retried_calls=sum(n > 1 for n in attempts),
        most_attempts=max(attempts),
        replays=sum(bool(r.outcome.replayed) for r in results),
        faults={fault.value: storm.faults[fault] for fault in Fault},
        retry_reasons=dict(reasons.most_common()),
        slowest_call_seconds=round(max(r.seconds for r in results), 1),
        seconds=round(storm.seconds, 1),
    )


def test_requests_storm_charges_each_call_once(
    stack: Stack, proxy: TcpProxy, api_key: str, run_id: str, figures: Figures
) -> None:
    # One session shared by every thread, as an app's module-level session is under
    # a threaded server: a call's key and retry state live in its own send().
    session = IdempotentSession(policy=POLICY)
    url = proxy.url + "/v1/charges"

    def call(customer: str, amount: int) -> Result:
        started = time.monotonic()
        response = session.post(
            url, json=charge_body(customer, amount), headers=auth(api_key), timeout=ATTEMPT_TIMEOUT
        )
        return result(customer, amount, response, started)

    try:
        storm = run_storm(
            proxy, seed=40, send=lambda: in_threads(customers(run_id, REQUESTS_CALLS), call)
        )
    finally:
        session.close()
    report(figures, storm)
    assert_storm(stack, run_id, storm)


def test_httpx_storm_charges_each_call_once(
    stack: Stack, proxy: TcpProxy, api_key: str, run_id: str, figures: Figures
) -> None:
    client = httpx.Client(
        transport=IdempotentTransport(policy=POLICY), timeout=ATTEMPT_TIMEOUT, headers=auth(api_key)
    )
    url = proxy.url + "/v1/charges"

    def call(customer: str, amount: int) -> Result:
        started = time.monotonic()
        response = client.post(url, json=charge_body(customer, amount))
        return result(customer, amount, response, started)

    with client:
        storm = run_storm(
            proxy, seed=41, send=lambda: in_threads(customers(run_id, HTTPX_CALLS), call)
        )
    report(figures, storm)
    assert_storm(stack, run_id, storm)


def test_async_httpx_storm_charges_each_call_once(
    stack: Stack, proxy: TcpProxy, api_key: str, run_id: str, figures: Figures
) -> None:
    url = proxy.url + "/v1/charges"

    async def storm_calls() -> list[Result]:
        transport = AsyncIdempotentTransport(policy=POLICY)
        async with httpx.AsyncClient(
            transport=transport, timeout=ATTEMPT_TIMEOUT, headers=auth(api_key)
        ) as client:

            async def call(customer: str, amount: int) -> Result:
                started = time.monotonic()
                response = await client.post(url, json=charge_body(customer, amount))
                return result(customer, amount, response, started)

            return list(
                await asyncio.gather(*(call(c, a) for c, a in customers(run_id, ASYNC_CALLS)))
            )

    storm = run_storm(proxy, seed=42, send=lambda: asyncio.run(storm_calls()))
    report(figures, storm)
    assert_storm(stack, run_id, storm)


def test_duplicate_waits_out_a_running_call_then_gets_its_replay(
    stack: Stack, proxy: TcpProxy, api_key: str, run_id: str, figures: Figures
) -> None:
    """A second client with the same key, while the first call is still at the
    processor: ``409 in_progress`` with ``Retry-After``, honoured, then the replay."""
    customer, key = f"{run_id}slow", f"slow-{run_id}"
    session = IdempotentSession(policy=POLICY)

    def call() -> Result:
        started = time.monotonic()
        response = session.post(
            proxy.url + "/v1/charges",
            json=charge_body(customer, 1500),
            headers={**auth(api_key), "Idempotency-Key": key},
            timeout=SLOW_TIMEOUT,
        )
        return result(customer, 1500, response, started)

    already = stack.record_states()["processing"]

    def processing() -> bool:
        return stack.record_states()["processing"] > already

    stack.control(latency_seconds=SLOW_SECONDS)
    try:
        with ThreadPoolExecutor(2) as pool:
            slow = pool.submit(call)
            wait_until(processing, 10, "the first call to claim its key")
            duplicate = pool.submit(call).result()
            first = slow.result()
    finally:
        stack.control(latency_seconds=0)
        session.close()
    figures(
        first_seconds=round(first.seconds, 1),
        duplicate_seconds=round(duplicate.seconds, 1),
        duplicate_attempts=duplicate.outcome.attempts,
        duplicate_reasons=list(duplicate.outcome.reasons),
    )
    assert (first.status, first.outcome.replayed, first.outcome.attempts) == (201, False, 1)
    assert (duplicate.status, duplicate.outcome.replayed) == (201, True)
    assert duplicate.outcome.attempts > 1
    # Retry-After honoured: a second between attempts, so no more of them than the
    # first call's run leaves room for (a backoff of 0.05 s would make dozens).
    waits = duplicate.outcome.attempts - 1
    assert duplicate.seconds >= waits * RETRY_AFTER
    assert duplicate.outcome.attempts <= first.seconds / RETRY_AFTER + 2
    assert duplicate.outcome.key == first.outcome.key == key
    assert set(duplicate.outcome.reasons) == {"status 409"}, duplicate.outcome.reasons
    assert duplicate.body == first.body
    assert_charged_once(stack, run_id, [first])


@pytest.mark.parametrize("library", ["requests", "httpx"])
def test_reused_key_raises_after_one_attempt(
    stack: Stack, proxy: TcpProxy, api_key: str, run_id: str, library: str
) -> None:
    """The same key for a different request (another amount): ``KeyReused`` at once,
    never retried, and nothing charged for it."""
    customer, key = f"{run_id}reused", f"reused-{run_id}"
    url = proxy.url + "/v1/charges"
    counter = ScriptedFaults()  # faults nothing, counts the requests
    with contextlib.ExitStack() as closing:
        if library == "requests":
            session = closing.enter_context(IdempotentSession(policy=POLICY))
            post: Callable[..., requests.Response | httpx.Response] = functools.partial(
                session.post, timeout=ATTEMPT_TIMEOUT
            )
        else:
            transport = IdempotentTransport(policy=POLICY)
            post = closing.enter_context(
                httpx.Client(transport=transport, timeout=ATTEMPT_TIMEOUT)
            ).post

        def send(amount: int) -> int:
            headers = {**auth(api_key), "Idempotency-Key": key}
            return post(url, json=charge_body(customer, amount), headers=headers).status_code

        assert send(1000) == 201
        proxy.inject(counter)
        with pytest.raises(KeyReused) as reused:
            send(2000)
    assert reused.value.key == key
    assert counter.calls == 1, f"the reused key was sent {counter.calls} times"
    answer = reused.value.response
    assert isinstance(answer, requests.Response | httpx.Response)
    assert answer.status_code == 422
    assert json.loads(answer.content)["error"]["code"] == "key_reused"
    rows = charges_by_customer(stack, run_id)
    assert [len(ids) for ids in rows.values()] == [1]
    assert [len(calls) for calls in ledger_by_customer(stack, run_id).values()] == [1]
