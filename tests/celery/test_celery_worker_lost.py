"""A task that kills its worker every time stops after a bounded number of losses.

``ct.crash`` (``celery_worker_app.py``) calls ``os._exit(1)`` in its body. With
``acks_late`` and ``task_reject_on_worker_lost`` the broker gives the message
back each time; nothing raised, so Celery counts no retry. The guard counts the
record's takeovers instead, and after ``idempotency_max_worker_losses`` (3, the
default) lost attempts the next delivery fails the task with
:class:`TaskWorkerLost` without running it. Real workers, RabbitMQ and
PostgreSQL; a short lease (1 s) keeps each takeover quick.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from typing import Any

import kombu
import pytest
from celery_harness import *  # noqa: F403  (the fixtures, used by name)
from celery_harness import CeleryWorker, wait_for_rows

from flask_idempotency.celery import IdempotentTask, TaskWorkerLost
from flask_idempotency.events.messages import consumer_options
from support.pg_query import query

MakeWorker = Callable[..., CeleryWorker]
RESULT_TIMEOUT = 30.0
LEASE = "1"


def attempts(url: str, key: str) -> int:
    return int(query(url, "SELECT count(*) FROM ct_attempts WHERE key = %s", (key,))[0][0])


def deliveries(url: str, key: str) -> list[str]:
    """How each delivery that ran to its end finished, less the copies deferred
    (``IGNORED``) while a dead holder's lease ran out."""
    rows = query(
        url,
        "SELECT state FROM ct_deliveries WHERE key = %s AND state <> 'IGNORED' ORDER BY id",
        (key,),
    )
    return [r[0] for r in rows]


def queued(amqp_url: str, queue: str) -> int:
    """Messages in ``queue`` (ready, and given back by a stopped worker)."""
    with kombu.Connection(amqp_url, connect_timeout=5) as conn:
        _, count, _ = conn.default_channel.queue_declare(queue, passive=True)
    return int(count)


def test_a_task_that_kills_its_worker_every_time_fails_after_the_limit(
    celery_worker: MakeWorker,
    celery_client: Any,
    celery_env: dict[str, str],
    clean_db: str,
) -> None:
    worker = celery_worker(concurrency=1, CT_LEASE=LEASE)
    order = "ord_" + secrets.token_hex(4)
    started = time.monotonic()
    result = celery_client.send_task("ct.crash", args=[order])
    with pytest.raises(TaskWorkerLost) as caught:
        result.get(timeout=RESULT_TIMEOUT)
    elapsed = time.monotonic() - started
    wait_for_rows(
        clean_db,
        "SELECT count(*) FROM ct_deliveries WHERE key = %s AND state = 'FAILURE'",
        (order,),
        1,
    )
    print(f"failed after {elapsed:.2f}s: {caught.value}; deliveries {deliveries(clean_db, order)}")
    assert result.state == "FAILURE"
    assert "idempotency_max_worker_losses=3" in str(caught.value)
    assert order not in str(caught.value)
    # Three attempts died; the fourth delivery did not run the body.
    assert attempts(clean_db, order) == 3
    assert deliveries(clean_db, order) == ["FAILURE"]
    assert query(clean_db, "SELECT count(*) FROM ct_effects WHERE key = %s", (order,)) == [(0,)]
    # The record is released, as a dead-lettered message's: a fixed re-run starts afresh.
    assert query(clean_db, "SELECT count(*) FROM idempotency_records") == [(0,)]

    # Not looping: no attempt after the failure, and once the worker has stopped
    # (giving back whatever it held unacknowledged) the queue is empty.
    time.sleep(float(LEASE) + 0.5)
    assert attempts(clean_db, order) == 3
    worker.stop()
    assert queued(celery_env["CT_AMQP_URL"], celery_env["CT_QUEUE"]) == 0

    log = worker.log_path.read_text()
    errors = [line for line in log.splitlines() if "max_worker_losses=3" in line]
    print("\n".join(errors))
    guard_errors = [line for line in errors if "ERROR" in line]
    assert any("3 earlier attempts were lost" in line for line in guard_errors)
    assert sum("its record released" in line for line in log.splitlines()) == 1
    assert order not in "\n".join(errors)


def test_a_task_that_kills_its_worker_once_completes_once(
    celery_worker: MakeWorker, celery_client: Any, clean_db: str
) -> None:
    celery_worker(concurrency=1, CT_LEASE=LEASE)
    order = "ord_" + secrets.token_hex(4)
    result = celery_client.send_task("ct.crash", args=[order], kwargs={"die_times": 1})
    value = result.get(timeout=RESULT_TIMEOUT)
    print(f"result {value}; deliveries {deliveries(clean_db, order)}")
    assert value["attempt"] == 2
    assert attempts(clean_db, order) == 2
    assert query(clean_db, "SELECT attempt FROM ct_effects WHERE key = %s", (order,)) == [(2,)]
    assert query(clean_db, "SELECT state, takeovers FROM idempotency_records") == [("completed", 1)]
    # A redelivery replays the stored result.
    again = celery_client.send_task("ct.crash", args=[order], kwargs={"die_times": 1})
    assert again.get(timeout=RESULT_TIMEOUT) == value
    assert attempts(clean_db, order) == 2


def test_raises_retried_by_celery_are_not_worker_losses(
    celery_worker: MakeWorker, celery_client: Any, clean_db: str
) -> None:
    """More raises than the loss limit: Celery's retries, not lost attempts."""
    celery_worker(concurrency=1, CT_LEASE=LEASE)
    order = "ord_" + secrets.token_hex(4)
    result = celery_client.send_task("ct.charge", args=[order, 1500], kwargs={"fail_times": 4})
    value = result.get(timeout=RESULT_TIMEOUT)
    assert value["attempt"] == 5
    assert query(clean_db, "SELECT amount, attempt FROM ct_effects WHERE key = %s", (order,)) == [
        (1500, 5)
    ]


def test_a_final_failure_releases_the_record_so_a_fixed_rerun_runs(
    celery_worker: MakeWorker, celery_client: Any, clean_db: str
) -> None:
    """Six raises (max_retries=5) fail the task for good: its record is released,
    so the same key run again is a first attempt, not a fourth loss."""
    celery_worker(concurrency=1, CT_LEASE=LEASE)
    order = "ord_" + secrets.token_hex(4)
    failing = celery_client.send_task("ct.charge", args=[order, 1500], kwargs={"fail_times": 6})
    with pytest.raises(Exception, match="attempt 6 fails"):
        failing.get(timeout=RESULT_TIMEOUT)
    assert query(clean_db, "SELECT count(*) FROM idempotency_records") == [(0,)]
    fixed = celery_client.send_task("ct.charge", args=[order, 1500], kwargs={"fail_times": 6})
    assert fixed.get(timeout=RESULT_TIMEOUT)["attempt"] == 7


def test_the_option_defaults_to_three_and_is_checked() -> None:
    assert IdempotentTask.idempotency_max_worker_losses == 3
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="max_worker_losses"):
            consumer_options(
                "t",
                key=None,
                max_attempts=1,
                lease=None,
                ttl=None,
                retry_delay=1,
                max_retry_delay=1,
                busy_delay=1,
                max_worker_losses=bad,  # type: ignore[arg-type]
            )
