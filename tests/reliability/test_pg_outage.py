"""PostgreSQL outage: the database dies mid-load, traffic goes on, the database comes back.

The server is a throwaway one this module owns, stopped the hard way
(``immediate``: open transactions die and the next start runs crash
recovery). While it is down the API must fail closed: ``503
store_unavailable`` (or ``502`` from the processor path, or a Redis replay of
a finished charge), never another 5xx and never a charge taken without a
claim. Once it is back the same gunicorn workers must serve again, and after
every client has retried its key no key may have been charged twice.
"""

from __future__ import annotations

import random
import threading
import time
from collections import defaultdict
from collections.abc import Iterator

import pytest

from support.http_client import http_request
from support.postgres_server import ThrowawayPostgres

from .figures import Figures
from .load import (
    Answer,
    Call,
    LoadLoop,
    charge_body,
    charge_call,
    retry_until_final,
    status_counts,
)
from .stack import Stack, StackOptions, running_stack

pytestmark = pytest.mark.reliability

LEASE = 4.0
PROCESSOR_TIMEOUT = 2.0
#: Requests are waiting on the processor when the database dies.
PROCESSOR_LATENCY = 0.2
THREADS = 8
#: Each client pauses between requests: fast 503s would otherwise flood the test with
#: thousands of keys to retry afterwards.
PAUSE = 0.05
BEFORE = 2.0
OUTAGE = 4.0
#: How long the API may take to serve again once PostgreSQL accepts connections.
RECOVERY_LIMIT = 10.0
AFTER = 2.0
#: Long enough for a replacement worker to import the app and try to reach PostgreSQL.
WORKER_BOOT = 2.5

#: What the API may answer at any time in this test: a charge (new or replayed),
#: a fail-closed 503, or a 502 when the processor path failed.
ALLOWED = {(201, None), (503, "store_unavailable"), (502, "processor_unavailable")}


@pytest.fixture(scope="module")
def pg_server() -> Iterator[ThrowawayPostgres]:
    with ThrowawayPostgres() as server:
        yield server


@pytest.fixture(scope="module")
def outage_stack(pg_server: ThrowawayPostgres, stack_redis_url: str) -> Iterator[Stack]:
    options = StackOptions(workers=3, lease_seconds=LEASE, processor_timeout=PROCESSOR_TIMEOUT)
    with running_stack(pg_server.dsn, stack_redis_url, options) as stack:
        yield stack


class Traffic:
    """New keys and replays of finished ones, the way many clients would send them."""

    def __init__(self, api_key: str, run_id: str) -> None:
        self.api_key = api_key
        self.run_id = run_id
        self.calls: dict[str, Call] = {}
        self.finished: list[str] = []
        self._lock = threading.Lock()
        self._rng = random.Random(7)

    def next_call(self) -> Call:
        with self._lock:
            if self.finished and self._rng.random() < 0.3:
                return self.calls[self._rng.choice(self.finished)]
            n = len(self.calls)
            key = f"pg-{self.run_id}{n}"
            self.calls[key] = charge_call(
                self.api_key, key, charge_body(700 + n, f"{self.run_id}{n}")
            )
            return self.calls[key]

    def on_answer(self, answer: Answer) -> None:
        if answer.status == 201 and answer.replayed == "false":
            with self._lock:
                self.finished.append(answer.call.tag)


def test_postgres_outage_fails_closed_and_recovers_without_restart(
    outage_stack: Stack,
    pg_server: ThrowawayPostgres,
    api_key: str,
    run_id: str,
    figures: Figures,
) -> None:
    stack = outage_stack
    stack.control(latency_seconds=PROCESSOR_LATENCY)
    traffic = Traffic(api_key, run_id)
    connections = stack.connections()
    workers_before = stack.app.worker_pids()
    loop = LoadLoop(
        connections, traffic.next_call, threads=THREADS, on_answer=traffic.on_answer, pause=PAUSE
    ).start()
    try:
        time.sleep(BEFORE)
        pg_server.stop("immediate")
        down_at = time.monotonic()
        # Calls already past their claim may still reach the processor; after this
        # no processor call may start until PostgreSQL is back.
        time.sleep(PROCESSOR_LATENCY + 0.5)
        ledger_quiet_from = len(stack.ledger())
        health_during = http_request("GET", stack.url + "/healthz", timeout=10).status
        # A worker dies while the database is away (OOM, a bug): its replacement must
        # boot without PostgreSQL, and gunicorn must not give up on the whole server.
        victim = workers_before[0]
        killed_at = time.monotonic()
        stack.app.kill_worker(victim)
        replacement = set(stack.app.wait_for_workers(exclude=[victim])) - set(workers_before)
        replaced_at = time.monotonic()
        time.sleep(WORKER_BOOT)
        master_survived = stack.app.running
        time.sleep(max(0.0, OUTAGE - (time.monotonic() - down_at)))
        ledger_quiet_to = len(stack.ledger())
        up_at = time.monotonic()
        pg_server.start()
        back_at = time.monotonic()
        recovered_at = _wait_for_fresh_charge(loop, back_at)
        time.sleep(AFTER)
    finally:
        answers = loop.stop()
        stack.control(latency_seconds=0)
    assert master_survived, "gunicorn halted: a worker could not boot without PostgreSQL"
    workers_after = stack.app.worker_pids()

    try:
        stack.end_leases()  # claims orphaned by the crash expire (nothing is in flight)
        final, retries = retry_until_final(connections, list(traffic.calls.values()), deadline=40)
    finally:
        connections.close()

    # Connections to the worker we killed drop: those requests are the kill's, not
    # the outage's (their keys are retried with all the others below).
    killed = [
        a for a in answers if a.status == 0 and a.started <= replaced_at and a.finished >= killed_at
    ]
    killed_ids = {id(a) for a in killed}
    during = [
        a
        for a in answers
        if a.started >= down_at and a.finished <= up_at and id(a) not in killed_ids
    ]
    calls_seen, charged = stack.processor_counts(run_id)
    rows = stack.charge_ids(run_id)
    figures(
        requests_sent=len(answers),
        cut_by_the_worker_kill=len(killed),
        keys=len(traffic.calls),
        outcomes=status_counts(answers),
        outcomes_in_flight_at_the_stop=status_counts(
            a for a in answers if a.started < down_at < a.finished
        ),
        outcomes_during_outage=status_counts(during),
        processor_calls_started_during_outage=ledger_quiet_to - ledger_quiet_from,
        healthz_during_outage=health_during,
        seconds_to_recover=(
            round(recovered_at - back_at, 2) if recovered_at is not None else "never"
        ),
        worker_killed_during_outage=1,
        gunicorn_master_survived=master_survived,
        workers_restarted_otherwise=len(set(workers_before) - set(workers_after) - {victim}),
        retries_after=dict(retries),
        processor_calls=dict(stack.processor_outcomes(run_id)),
        effective_charges=sum(charged.values()),
        charge_rows=sum(len(ids) for ids in rows.values()),
        duplicates=sum(n - 1 for n in charged.values() if n > 1)
        + sum(len(ids) - 1 for ids in rows.values() if len(ids) > 1),
        records=dict(stack.record_states()),
    )

    outside = [
        a.describe()
        for a in answers
        if (a.status, a.code) not in ALLOWED and id(a) not in killed_ids
    ]
    assert not outside, f"answers outside 201/503/502: {outside[:10]}"
    assert during, "no request was answered during the outage"
    assert all(a.status in (502, 503) or a.replayed == "true" for a in during), (
        "a charge was taken while PostgreSQL was down"
    )
    for answer in answers:
        if answer.status == 503:
            assert answer.headers.get("retry-after", "").isdigit()
            assert "idempotent-replayed" not in answer.headers
    assert ledger_quiet_to == ledger_quiet_from, "the processor was called without a claim"
    assert health_during == 503
    assert recovered_at is not None, "no new charge succeeded after PostgreSQL came back"
    assert set(workers_after) == set(workers_before) - {victim} | replacement, "workers restarted"

    by_key: dict[str, set[bytes]] = defaultdict(set)
    for answer in [*answers, *final.values()]:
        if answer.status == 201:
            by_key[answer.call.tag].add(answer.body)
    for n, key in enumerate(traffic.calls):
        customer = f"{run_id}{n}"
        assert final[key].status == 201, f"{key}: {final[key].describe()}"
        assert charged[customer] == 1, f"{key}: {charged[customer]} effective charges"
        assert len(rows.get(customer, [])) == 1, f"{key}: charge rows {rows.get(customer)}"
        assert len(by_key[key]) == 1, f"{key}: different 2xx bodies"
    assert calls_seen  # the ledger saw this test's customers at all


def _wait_for_fresh_charge(loop: LoadLoop, since: float) -> float | None:
    """When the first new charge started after ``since`` succeeded, within the limit."""
    deadline = since + RECOVERY_LIMIT
    while time.monotonic() < deadline:
        for answer in loop.answers():
            if answer.started >= since and answer.status == 201 and answer.replayed == "false":
                return answer.finished
        time.sleep(0.1)
    return None
