"""Idempotent Celery tasks on a real worker (prefork) and the machine's RabbitMQ.

Each test publishes ``ct.charge`` (``celery_worker_app.py``) in some hostile way
and then counts rows in PostgreSQL: ``ct_effects`` (the task's writes, kept
only with a stored result) must hold exactly one row per key, whatever the
duplicates, retries and kills; ``ct_attempts`` shows how often the body ran.
"""

from __future__ import annotations

import os
import secrets
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest
from celery_harness import *  # noqa: F403  (the fixtures, used by name)
from celery_harness import CeleryWorker, wait_for_rows

from flask_idempotency.celery import TaskKeyReused
from support.pg_query import query

MakeWorker = Callable[..., CeleryWorker]
RESULT_TIMEOUT = 30.0


def effects(url: str, key: str) -> list[tuple[Any, ...]]:
    return query(url, "SELECT amount, attempt FROM ct_effects WHERE key = %s", (key,))


def attempts(url: str, key: str) -> list[int]:
    rows = query(url, "SELECT pid FROM ct_attempts WHERE key = %s ORDER BY id", (key,))
    return [r[0] for r in rows]


def finished(url: str, key: str, expect: int, state: str = "SUCCESS") -> int:
    """Wait until ``expect`` deliveries of ``key`` ended in ``state``; their count."""
    return wait_for_rows(
        url,
        "SELECT count(*) FROM ct_deliveries WHERE key = %s AND state = %s",
        (key, state),
        expect,
    )


def charge(client: Any, order_id: str, amount: int = 1500, **options: Any) -> Any:
    kwargs = options.pop("kwargs", {})
    return client.send_task("ct.charge", args=[order_id, amount], kwargs=kwargs, **options)


def test_duplicate_publishes_run_once_and_all_get_the_stored_result(
    celery_worker: MakeWorker, celery_client: Any, clean_db: str
) -> None:
    celery_worker(concurrency=2)
    order = "ord_" + secrets.token_hex(4)
    started = time.monotonic()
    first = charge(celery_client, order)
    value = first.get(timeout=RESULT_TIMEOUT)
    # The same message again (same task id: a re-publish), and the same call
    # under new task ids (a caller that retried apply_async): keyed by order_id.
    again = [charge(celery_client, order, task_id=first.id) for _ in range(3)]
    again += [charge(celery_client, order) for _ in range(3)]
    results = [r.get(timeout=RESULT_TIMEOUT) for r in again]
    assert finished(clean_db, order, 7) == 7
    elapsed = time.monotonic() - started
    print(f"7 publishes in {elapsed:.2f}s; result {value}; effects {effects(clean_db, order)}")
    assert value["order_id"] == order and value["attempt"] == 1
    assert results == [value] * 6
    assert effects(clean_db, order) == [(1500, 1)]
    assert len(attempts(clean_db, order)) == 1

    # Another call under the same key (another amount) is refused, not run.
    other = charge(celery_client, order, amount=999)
    with pytest.raises(TaskKeyReused):
        other.get(timeout=RESULT_TIMEOUT)
    assert effects(clean_db, order) == [(1500, 1)]


def test_a_task_that_raises_is_rolled_back_and_retried_by_celery_until_it_succeeds(
    celery_worker: MakeWorker, celery_client: Any, clean_db: str
) -> None:
    celery_worker(concurrency=2)
    order = "ord_" + secrets.token_hex(4)
    result = charge(celery_client, order, kwargs={"fail_times": 2})
    value = result.get(timeout=RESULT_TIMEOUT)
    print(f"result {value}; attempts {len(attempts(clean_db, order))}")
    # Attempts 1 and 2 wrote their effect and raised: both rolled back.
    assert value["attempt"] == 3
    assert effects(clean_db, order) == [(1500, 3)]
    assert len(attempts(clean_db, order)) == 3
    # Celery counted the retries (autoretry_for, max_retries=5): two of them.
    assert result.retries == 2 or result.retries is None
    # A redelivery after the success replays it.
    again = charge(celery_client, order, kwargs={"fail_times": 2})
    assert again.get(timeout=RESULT_TIMEOUT) == value
    assert len(attempts(clean_db, order)) == 3


def test_a_storm_of_one_message_across_pool_processes_runs_it_once(
    celery_worker: MakeWorker, celery_client: Any, clean_db: str
) -> None:
    celery_worker(concurrency=4)
    order = "ord_" + secrets.token_hex(4)
    kwargs = {"work_seconds": 0.5}  # long enough for the copies to meet a live holder
    started = time.monotonic()
    first = charge(celery_client, order, kwargs=kwargs)
    copies = [first] + [
        charge(celery_client, order, kwargs=kwargs, task_id=first.id if n % 2 else None)
        for n in range(23)
    ]
    values = [c.get(timeout=RESULT_TIMEOUT) for c in copies]
    assert finished(clean_db, order, len(copies)) == len(copies)
    deferred = query(
        clean_db,
        "SELECT count(*) FROM ct_deliveries WHERE key = %s AND state = 'IGNORED'",
        (order,),
    )[0][0]
    pids = {r[0] for r in query(clean_db, "SELECT DISTINCT pid FROM ct_attempts")}
    print(
        f"{len(copies)} copies in {time.monotonic() - started:.2f}s; deferred while busy: "
        f"{deferred}; body ran {len(attempts(clean_db, order))}x; pool pids {len(pids)}"
    )
    assert {v["attempt"] for v in values} == {1} and len({v["pid"] for v in values}) == 1
    assert effects(clean_db, order) == [(1500, 1)]
    assert len(attempts(clean_db, order)) == 1
    assert deferred >= 1  # copies did meet the live holder


def _wait_for_attempt(url: str, key: str, number: int) -> int:
    """The pid of the pool process running ``key``'s ``number``-th attempt."""
    wait_for_rows(url, "SELECT count(*) FROM ct_attempts WHERE key = %s", (key,), number)
    pids = attempts(url, key)
    assert len(pids) >= number, f"attempt {number} of {key} never started"
    return pids[number - 1]


def _expire_leases(url: str) -> None:
    """The lease runs out now (the clock is not what these tests are about)."""
    query(
        url,
        "UPDATE idempotency_records SET lease_expires_at = now() WHERE state = 'processing'",
    )


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ", 1)[1].startswith("Z")
    except FileNotFoundError:
        return True


def _wait_gone(pid: int, timeout: float = 10.0) -> None:
    """Until the killed process is dead (a zombie counts: its sockets are closed)."""
    deadline = time.monotonic() + timeout
    while not _gone(pid):
        assert time.monotonic() < deadline, f"process {pid} outlived SIGKILL"
        time.sleep(0.02)


def test_a_pool_process_killed_mid_task_is_requeued_and_taken_over_after_its_lease(
    celery_worker: MakeWorker, celery_client: Any, clean_db: str
) -> None:
    celery_worker(concurrency=2)
    order = "ord_" + secrets.token_hex(4)
    result = charge(celery_client, order, kwargs={"hang_first": True})
    pid = _wait_for_attempt(clean_db, order, 1)
    os.kill(pid, signal.SIGKILL)  # the pool process dies mid-task, its transaction open
    _wait_gone(pid)
    # task_reject_on_worker_lost: the message comes straight back; the dead
    # holder's claim still has its lease, so the copy waits for it to run out.
    _expire_leases(clean_db)
    value = result.get(timeout=RESULT_TIMEOUT)
    print(f"result {value}; attempts by pid {attempts(clean_db, order)}")
    assert value["attempt"] == 2 and value["pid"] != pid
    assert effects(clean_db, order) == [(1500, 2)]
    takeovers = query(clean_db, "SELECT takeovers FROM idempotency_records")
    assert takeovers == [(1,)]


def test_a_worker_killed_mid_task_is_taken_over_by_another_after_its_lease(
    celery_worker: MakeWorker, celery_client: Any, clean_db: str
) -> None:
    first = celery_worker(concurrency=2)
    order = "ord_" + secrets.token_hex(4)
    result = charge(celery_client, order, kwargs={"hang_first": True})
    pid = _wait_for_attempt(clean_db, order, 1)
    first.kill()  # main process and pool at once: the broker gets the message back
    _wait_gone(pid)
    _expire_leases(clean_db)
    celery_worker(concurrency=2)
    value = result.get(timeout=RESULT_TIMEOUT)
    print(f"result {value}; attempts by pid {attempts(clean_db, order)}")
    assert value["attempt"] == 2
    assert effects(clean_db, order) == [(1500, 2)]
