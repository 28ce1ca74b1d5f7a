"""Recovery through gunicorn: SIGKILLed workers, no client retry, ``flask idempotency recover``.

The payments API runs with ``CRASH_DRILL_DELAY_SECONDS``: a charge lingers
between the processor's answer and its commit, and an order after each of its
phases, so a SIGKILL lands exactly there. The completer runs as its own
process (``flask --app example_app idempotency recover --once``), as from cron.

* charges the processor made, whose workers died before the commit, with no
  client retry: ``recover`` records exactly one charge row per payment, and a
  retry afterwards replays it byte for byte;
* the same, with the clients retrying while ``recover`` runs: still one charge;
* attempts the processor never saw: released, and a retry charges once;
* orders killed after their first, second and third phase: on takeover (a
  client's retry or ``recover``) every external step ran exactly once.

Recovery needs row mode; under ``IDEMPOTENCY_CLAIM_MODE=transaction`` (the
second pass of ``make test``) this module is skipped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import psycopg2
import pytest

from example_app.auth import owner_of
from flask_idempotency import digests
from support.gunicorn_server import GunicornServer
from support.http_client import http_request
from support.waiting import wait_until

from .figures import Figures
from .load import Answer, Call, Connections, charge_body, charge_call, retry_until_final
from .stack import REPO_ROOT, Stack, StackOptions, own_database, running_stack

pytestmark = [
    pytest.mark.reliability,
    pytest.mark.skipif(
        os.environ.get("IDEMPOTENCY_CLAIM_MODE") == "transaction",
        reason="recovery needs IDEMPOTENCY_CLAIM_MODE=row",
    ),
]

LEASE = 6.0
PROCESSOR_TIMEOUT = 5.0
#: How long a charge waits between the processor's answer and its commit (and an
#: order after each phase): the window each SIGKILL lands in.
DRILL = 3.0
WORKERS = 2
#: One worker may accept all 12 drilled requests: each needs a thread and a pooled
#: connection at once, or the last ones queue until the first finish their drill.
THREADS = 16


@pytest.fixture(scope="module")
def fulfilment() -> Iterator[GunicornServer]:
    """The warehouse and mailer of the orders route, a process of its own."""
    server = GunicornServer(
        "example_app.fulfilment:app",
        workers=1,
        worker_class="gthread",
        threads=32,
        health_path="/healthz",
    )
    try:
        yield server.start()
    finally:
        server.close()


@pytest.fixture(scope="module")
def recovery_stack(
    server_database_url: str, stack_redis_url: str, fulfilment: GunicornServer
) -> Iterator[Stack]:
    options = StackOptions(
        workers=WORKERS,
        threads=THREADS,
        lease_seconds=LEASE,
        processor_timeout=PROCESSOR_TIMEOUT,
        extra_env={
            "FULFILMENT_URL": fulfilment.url,
            "CRASH_DRILL_DELAY_SECONDS": f"{DRILL:g}",
            "IDEMPOTENCY_POOL_SIZE": str(THREADS),
        },
    )
    with (
        own_database(server_database_url) as url,
        running_stack(url, stack_redis_url, options) as stack,
    ):
        # Each worker's first request opens its pool: not while a drill is timed.
        warm = Connections(stack.url, timeout=20, keep_alive=False)
        with ThreadPoolExecutor(max_workers=8) as pool:
            list(pool.map(warm.send, [Call("GET", "/healthz")] * 16))
        warm.close()
        yield stack


def run_recover(stack: Stack, *args: str) -> tuple[str, float]:
    """``flask --app example_app idempotency recover --once --older-than 0`` as a
    process of its own, configured like the app; its summary line and seconds."""
    env = os.environ | stack.app.env | {"CRASH_DRILL_DELAY_SECONDS": "0"}
    env["PYTHONPATH"] = str(REPO_ROOT)
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "flask", "--app", "example_app", "idempotency", "recover"]
        + ["--once", "--older-than", "0", *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.strip().splitlines()[-1], time.monotonic() - started


def outcomes(summary: str) -> dict[str, int]:
    """``recovered 3, released 1, ...`` as a dict."""
    pairs = (part.strip().rsplit(" ", 1) for part in summary.split(","))
    return {name: int(count) for name, count in pairs}


def kill_all_workers(stack: Stack) -> int:
    killed = stack.app.worker_pids()
    for pid in killed:
        stack.app.kill_worker(pid)
    stack.app.wait_for_workers(exclude=killed)
    return len(killed)


def charges_made(stack: Stack, customer_prefix: str) -> int:
    return sum(stack.processor_counts(customer_prefix)[1].values())


def failures_left(stack: Stack) -> int:
    answer = http_request("GET", stack.processor.url + "/v1/_ledger", timeout=10)
    return int(answer.json()["switches"]["fail_next"])


def taken_over(stack: Stack, record_keys: list[bytes]) -> bool:
    """Whether any of these records has been taken over since it was claimed."""
    rows = stack.query(
        "SELECT count(*) FROM idempotency_records WHERE record_key = ANY(%s) AND takeovers > 0",
        ([psycopg2.Binary(k) for k in record_keys],),
    )
    return int(rows[0][0]) > 0


def test_abandoned_charges_are_recovered_or_released_and_then_replayed(
    recovery_stack: Stack, api_key: str, run_id: str, figures: Figures
) -> None:
    stack = recovery_stack
    connections = Connections(stack.url, timeout=20, keep_alive=False)
    groups: dict[str, list[str]] = {"unseen": [], "no_retry": [], "race": []}
    calls: dict[str, Call] = {}

    def call_for(group: str, n: int) -> Call:
        key = f"{group}-{run_id}{n}"
        groups[group].append(key)
        calls[key] = charge_call(api_key, key, charge_body(700 + n, f"{run_id}{group}{n}"))
        return calls[key]

    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=32) as pool:
        # Charged, then lingering before the commit (the oldest leases: the completer
        # starts with these, while their clients retry).
        cut = [pool.submit(connections.send, call_for("race", n)) for n in range(4)]
        wait_until(lambda: charges_made(stack, run_id) == 4, 20, "the race group's charges")
        # Calls the processor hangs on without ever seeing them (a fault in front of it).
        stack.control(fail_next=4, fail_mode="timeout", hang_seconds=8)
        cut += [pool.submit(connections.send, call_for("unseen", n)) for n in range(4)]
        wait_until(lambda: failures_left(stack) == 0, 20, "the unseen group at the processor")
        cut += [pool.submit(connections.send, call_for("no_retry", n)) for n in range(4)]
        wait_until(lambda: charges_made(stack, run_id) == 8, 20, "the no_retry group's charges")
        # Every charged request is in the drill's window (DRILL after its answer).
        killed = kill_all_workers(stack)
        during = [future.result(30) for future in cut]

        _, charged = stack.processor_counts(run_id)
        abandoned = stack.record_states()["processing"]
        assert all(a.status == 0 for a in during), [a.describe() for a in during]
        assert sum(charged.values()) == 8, "the charged attempts were not all charged"
        assert stack.charge_rows(run_id) == Counter(), "a charge was recorded before the kill"
        stack.end_leases()  # its holders are dead
        stats_before = cli_stats(stack)

        # The completer and the "race" group's clients, at the same time. Two clients
        # retry as the completer starts: they take their records over first, and are
        # still in their views (the drill delay) while its pass runs. The other two
        # retry once the completer has taken theirs (the oldest leases left): they get
        # 409 while it holds them, then its answer.
        owner = owner_of(api_key)
        early, late = groups["race"][:2], groups["race"][2:]
        completer = pool.submit(run_recover, stack, "--batch-size", "2")
        first = pool.submit(retry_until_final, connections, [calls[k] for k in early], deadline=30)
        wait_until(
            lambda: taken_over(stack, [digests.record_key(owner, k) for k in late]),
            20,
            "the completer's takeover",
        )
        raced, race_retries = retry_until_final(connections, [calls[k] for k in late], deadline=30)
        raced |= first.result(60)[0]
        summary, recover_seconds = completer.result(60)

    # No client of "no_retry" came back until now: the completer alone recorded them.
    recovered = outcomes(summary)
    after, _ = retry_until_final(connections, [calls[k] for k in groups["no_retry"]], deadline=30)
    unseen, _ = retry_until_final(connections, [calls[k] for k in groups["unseen"]], deadline=30)
    final = raced | after | unseen
    replays = {key: connections.send(call) for key, call in calls.items()}
    connections.close()

    _, charged = stack.processor_counts(run_id)
    rows = stack.charge_ids(run_id)
    states = stack.record_states()
    stats_after = cli_stats(stack)
    race_by_client = sum(1 for k in groups["race"] if final[k].replayed == "false")
    figures(
        workers_killed=killed,
        abandoned_after_kill=abandoned,
        stats_abandoned=stats_before["abandoned"],
        completer=summary,
        completer_seconds=round(recover_seconds, 1),
        race_taken_over_by_clients=race_by_client,
        race_recovered_by_completer=len(groups["race"]) - race_by_client,
        race_retries=dict(race_retries),
        processor_charges=sum(charged.values()),
        charge_rows=sum(len(ids) for ids in rows.values()),
        stats_recovered=stats_after["recovered"],
        stats_released=stats_after["recovery_released"],
        records=dict(states),
        seconds=round(time.monotonic() - started, 1),
    )

    assert stats_before["abandoned"] >= 12
    assert recovered["recovered"] >= 4 and recovered["released"] == 4
    assert recovered["recovered"] + race_by_client == 8
    assert all(final[k].replayed == "false" for k in early), "the early clients' views ran"
    assert all(final[k].replayed == "true" for k in late), "the completer recovered these"
    for key in groups["no_retry"]:
        assert final[key].replayed == "true", f"{key}: {final[key].describe()}"
    for key in groups["unseen"]:
        assert final[key].replayed == "false", f"{key}: {final[key].describe()}"
    for key, call in calls.items():
        customer = json.loads(call.body)["customer"]
        assert final[key].status == 201, f"{key}: {final[key].describe()}"
        assert charged[customer] == 1, f"{key}: {charged[customer]} charges"
        assert len(rows.get(customer, [])) == 1, f"{key}: rows {rows.get(customer)}"
        assert final[key].json()["id"] == rows[customer][0]
        assert replays[key].replayed == "true" and replays[key].body == final[key].body
    assert states["processing"] == 0


# -- recovery points -----------------------------------------------------------------


def order_body(customer: str, n: int) -> bytes:
    return json.dumps(
        {
            "sku": f"sku_{n}",
            "quantity": 1 + n,
            "amount": 900 + n,
            "currency": "eur",
            "customer": customer,
            "source": "tok_visa",
        }
    ).encode()


def fulfilment_calls(server: GunicornServer) -> list[dict[str, Any]]:
    answer = http_request("GET", server.url + "/v1/_ledger", timeout=10)
    assert answer.status == 200
    calls: list[dict[str, Any]] = answer.json()["calls"]
    return calls


def phases_reached(stack: Stack, owner: str, keys_by_phases: dict[int, list[str]]) -> bool:
    """Whether every order meant to die after phase n has committed exactly n phases."""
    counts = {
        bytes(record_key): n
        for record_key, n in stack.query(
            "SELECT record_key, coalesce(jsonb_array_length(phases), 0)"
            " FROM idempotency_records WHERE state = 'processing'"
        )
    }
    return all(
        counts.get(digests.record_key(owner, key)) == n
        for n, group in keys_by_phases.items()
        for key in group
    )


def test_orders_killed_after_each_phase_resume_without_repeating_a_step(
    recovery_stack: Stack,
    fulfilment: GunicornServer,
    api_key: str,
    run_id: str,
    figures: Figures,
) -> None:
    stack = recovery_stack
    owner = owner_of(api_key)
    connections = Connections(stack.url, timeout=30, keep_alive=False)
    by_phases: dict[int, list[str]] = {1: [], 2: [], 3: []}
    calls: dict[str, Call] = {}
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=16) as pool:
        cut: list[Future[Answer]] = []
        # Staggered by one drill delay: when the last group has committed its first
        # phase, the others have committed their second and third.
        for phases in (3, 2, 1):
            if phases != 3:
                time.sleep(DRILL)
            for n in range(2):
                key = f"order{phases}-{run_id}{n}"
                body = order_body(f"{run_id}p{phases}n{n}", n)
                calls[key] = charge_call(api_key, key, body, path="/v1/orders")
                by_phases[phases].append(key)
                cut.append(pool.submit(connections.send, calls[key]))
        wait_until(
            lambda: phases_reached(stack, owner, by_phases), 20, "the phases before the kill"
        )
        killed = kill_all_workers(stack)
        assert all(future.result(30).status == 0 for future in cut)
        steps_before = step_calls(stack, fulfilment, owner, calls)
        stack.end_leases()  # its holders are dead

        # One order of each group comes back through its client, the other through
        # the completer, at the same time.
        by_client = [group[0] for group in by_phases.values()]
        retried = pool.submit(
            retry_until_final, connections, [calls[k] for k in by_client], deadline=40
        )
        summary, recover_seconds = run_recover(stack)
        final, _ = retried.result(60)
    final |= {k: connections.send(calls[k]) for k in calls if k not in final}
    replays = {key: connections.send(call) for key, call in calls.items()}
    connections.close()

    steps = step_calls(stack, fulfilment, owner, calls)
    rows = dict(
        stack.query(
            "SELECT customer, count(*) FROM orders WHERE customer LIKE %s GROUP BY customer",
            (run_id.replace("_", r"\_") + "%",),
        )
    )
    figures(
        workers_killed=killed,
        killed_after_phase={n: len(group) for n, group in by_phases.items()},
        steps_before_kill=summarise(steps_before),
        completer=summary,
        completer_seconds=round(recover_seconds, 1),
        steps_after_takeover=summarise(steps),
        order_rows=sum(rows.values()),
        records=dict(stack.record_states()),
        seconds=round(time.monotonic() - started, 1),
    )

    assert outcomes(summary)["recovered"] >= 3
    for phases, group in by_phases.items():
        for key in group:
            done = list(steps_before[key].values())
            assert done == [1] * phases + [0] * (3 - phases), f"{key} before: {done}"
            assert steps[key] == {"reserve": 1, "charge": 1, "notify": 1}, f"{key}: {steps[key]}"
            assert final[key].status == 201, f"{key}: {final[key].describe()}"
            assert final[key].json()["status"] == "confirmed"
            assert replays[key].replayed == "true" and replays[key].body == final[key].body
            customer = json.loads(calls[key].body)["customer"]
            assert rows.get(customer) == 1
    assert stack.record_states()["processing"] == 0


def step_calls(
    stack: Stack, fulfilment: GunicornServer, owner: str, calls: dict[str, Call]
) -> dict[str, dict[str, int]]:
    """External calls of each order, by step: reserve and notify from the fulfilment
    service's ledger, charge from the processor's (by the derived keys it was sent)."""
    derived = {
        digests.derived_key(digests.record_key(owner, key), purpose): (key, step)
        for key in calls
        for purpose, step in (("reserve", "reserve"), ("processor", "charge"), ("notify", "notify"))
    }
    counted = {key: {"reserve": 0, "charge": 0, "notify": 0} for key in calls}
    seen = [c["key"] for c in fulfilment_calls(fulfilment)] + [c["key"] for c in stack.ledger()]
    for sent in seen:
        if sent in derived:
            key, step = derived[sent]
            counted[key][step] += 1
    return counted


def summarise(steps: dict[str, dict[str, int]]) -> dict[str, int]:
    """Calls per step over all orders."""
    total: Counter[str] = Counter()
    for per_order in steps.values():
        total.update(per_order)
    return dict(total)


def cli_stats(stack: Stack) -> dict[str, float]:
    """``flask idempotency stats`` of the stack's database, as figures."""
    env = os.environ | stack.app.env
    env["PYTHONPATH"] = str(REPO_ROOT)
    done = subprocess.run(
        [sys.executable, "-m", "flask", "--app", "example_app", "idempotency", "stats"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    pairs = (line.split(": ", 1) for line in done.stdout.splitlines() if ": " in line)
    return {name: float(value) for name, value in pairs}
