"""Crash: SIGKILL gunicorn workers while charges wait on a slow processor, again and again.

A killed worker's claim is left ``processing`` and its lease stops being
renewed; its client sees the connection drop, not knowing whether the card was
charged. After the lease, a retry with the same key must take the record over
and end with exactly one effective charge and a 201, whether the crash fell
before the processor call, during it, or between its answer and the commit
(the derived processor key makes the processor replay instead of charging
again). No record may stay ``processing``.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from .figures import Figures
from .load import (
    Answer,
    Call,
    Connections,
    charge_body,
    charge_call,
    retry_until_final,
    status_counts,
)
from .stack import Stack, StackOptions, own_database, running_stack

pytestmark = pytest.mark.reliability

#: Shortened through the app's configuration, as the issue allows: the processor
#: timeout must stay below the lease (the app refuses to start otherwise).
LEASE = 3.0
PROCESSOR_TIMEOUT = 2.0
#: Slow enough that a kill half a second after a batch starts finds requests
#: waiting on the processor.
PROCESSOR_LATENCY = 1.0
KILLS = 12
BATCH = 8
WORKERS = 3
#: A replacement worker needs about a second to import and start the app; killing
#: it before it serves would test nothing.
SETTLE_AFTER_KILL = 1.2


@pytest.fixture(scope="module")
def crash_stack(server_database_url: str, stack_redis_url: str) -> Iterator[Stack]:
    options = StackOptions(
        workers=WORKERS, lease_seconds=LEASE, processor_timeout=PROCESSOR_TIMEOUT
    )
    with (
        own_database(server_database_url) as url,
        running_stack(url, stack_redis_url, options) as stack,
    ):
        yield stack


def test_killed_workers_leave_exactly_one_charge_per_key(
    crash_stack: Stack, api_key: str, run_id: str, figures: Figures
) -> None:
    stack = crash_stack
    stack.control(latency_seconds=PROCESSOR_LATENCY)
    rng = random.Random(5)
    connections = Connections(stack.url, timeout=20, keep_alive=False)
    calls: dict[str, Call] = {}
    customers: dict[str, str] = {}
    in_flight: list[Future[Answer]] = []
    killed: list[int] = []
    started = time.monotonic()
    try:
        with ThreadPoolExecutor(max_workers=BATCH * 3, thread_name_prefix="crash") as pool:
            for round_ in range(KILLS):
                for j in range(BATCH):
                    n = round_ * BATCH + j
                    key = f"crash-{run_id}{n}"
                    customers[key] = f"{run_id}{n}"
                    calls[key] = charge_call(api_key, key, charge_body(500 + n, customers[key]))
                    in_flight.append(pool.submit(connections.send, calls[key]))
                time.sleep(PROCESSOR_LATENCY / 2)  # claimed, waiting on the processor
                victim = rng.choice(stack.app.worker_pids())
                stack.app.kill_worker(victim)
                killed.append(victim)
                stack.app.wait_for_workers(exclude=killed)
                time.sleep(SETTLE_AFTER_KILL)
            during = [future.result(timeout=60) for future in in_flight]
        kill_seconds = time.monotonic() - started
        stuck_after_kills = stack.record_states()["processing"]

        # Every client retries its key once the lease of a dead holder has run out:
        # nothing is in flight now, so every processing record's holder is dead.
        stack.end_leases()
        final, retries = retry_until_final(connections, list(calls.values()), deadline=45)
        replays = {key: connections.send(call) for key, call in calls.items()}
    finally:
        connections.close()
        stack.control(latency_seconds=0)

    calls_seen, charged = stack.processor_counts(run_id)
    rows = stack.charge_ids(run_id)
    states = stack.record_states()
    recovered_after_charge = sum(
        1 for key, answer in final.items() if answer.replayed == "false" and _was_cut(during, key)
    )
    figures(
        kills=len(killed),
        requests_in_flight=len(during),
        outcomes_during_kills=status_counts(during),
        stuck_processing_after_kills=stuck_after_kills,
        takeovers=stack.takeovers(),
        retries=dict(retries),
        retried_keys_that_ran_again=recovered_after_charge,
        processor_calls=dict(stack.processor_outcomes(run_id)),
        effective_charges=sum(charged.values()),
        charge_rows=sum(len(ids) for ids in rows.values()),
        duplicates=sum(n - 1 for n in charged.values() if n > 1),
        records=dict(states),
        seconds=round(kill_seconds, 1),
    )

    assert len(killed) >= 10
    cut = [a for a in during if a.status == 0]
    assert cut, "no kill hit a request in flight: the test exercised nothing"
    assert all(a.status == 201 for a in during if a.status != 0), status_counts(during)
    if os.environ.get("IDEMPOTENCY_CLAIM_MODE") == "transaction":
        # The claim was the killed session's transaction: it died with it.
        assert stuck_after_kills == 0, "a transaction-mode claim outlived its session"
    else:
        assert stuck_after_kills > 0, "no claim was left behind by a killed worker"
    for key, customer in customers.items():
        assert final[key].status == 201, f"{key}: {final[key].describe()}"
        assert charged[customer] == 1, f"{key}: {charged[customer]} effective charges"
        assert len(rows.get(customer, [])) == 1, f"{key}: charge rows {rows.get(customer)}"
        assert final[key].json()["id"] == rows[customer][0]
        assert replays[key].status == 201 and replays[key].body == final[key].body
    assert states["processing"] == 0, f"records left processing: {dict(states)}"
    # Answers that did arrive during the kills are the same bytes the retries got.
    for answer in during:
        if answer.status == 201:
            assert answer.body == final[answer.call.tag].body


def _was_cut(during: list[Answer], key: str) -> bool:
    return any(a.call.tag == key and a.status == 0 for a in during)
