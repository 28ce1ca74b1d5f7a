"""IdempotentTask without a broker: ``apply()`` and plain calls, on PostgreSQL.

Where the key comes from, what "the same call" is, and what a task run outside
a worker does when it cannot run now. The Flask app comes from the app context
(no ``flask_app=`` on these tasks).
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Iterator
from typing import Any

import psycopg2
import pytest
from celery import Celery
from flask import Flask

from flask_idempotency import Idempotency
from flask_idempotency.celery import (
    KEY_HEADER,
    IdempotentTask,
    TaskDeferred,
    TaskKeyMissing,
    TaskKeyReused,
)

idempotency = Idempotency()
celery_app = Celery("ct_in_process", broker="memory://")
celery_app.conf.update(task_store_eager_result=False)
runs: list[tuple[str, Any]] = []
gate = {"entered": threading.Event(), "release": threading.Event()}


def _write(label: str) -> None:
    with idempotency.connection().cursor() as cur:
        cur.execute("INSERT INTO ct_in_process (label) VALUES (%s)", (label,))


@celery_app.task(base=IdempotentTask, name="cti.by_id")  # type: ignore[untyped-decorator]
def by_id(label: str, amount: int = 1) -> dict[str, Any]:
    runs.append(("by_id", label))
    _write(label)
    return {"label": label, "amount": amount, "runs": len(runs)}


@celery_app.task(  # type: ignore[untyped-decorator]
    base=IdempotentTask, name="cti.by_arg", idempotency_key="order"
)
def by_arg(order: str, amount: int = 1) -> int:
    runs.append(("by_arg", order))
    _write(order)
    return amount


@celery_app.task(  # type: ignore[untyped-decorator]
    base=IdempotentTask,
    name="cti.by_func",
    idempotency_key=lambda request, args, kwargs: f"{kwargs['tenant']}:{kwargs['ref']}",
)
def by_func(*, tenant: str, ref: str) -> str:
    runs.append(("by_func", ref))
    return ref


@celery_app.task(base=IdempotentTask, name="cti.slow", idempotency_key="order")  # type: ignore[untyped-decorator]
def slow(order: str) -> str:
    gate["entered"].set()
    gate["release"].wait(10)
    _write(order)
    return order


@celery_app.task(base=IdempotentTask, name="cti.not_json", idempotency_key="order")  # type: ignore[untyped-decorator]
def not_json(order: str, ok: bool = False) -> Any:
    runs.append(("not_json", order))
    _write(order)
    return order if ok else {order}


@pytest.fixture
def app(clean_db: str) -> Iterator[Flask]:
    conn = psycopg2.connect(clean_db)
    with conn, conn.cursor() as cur:
        cur.execute("CREATE TABLE IF NOT EXISTS ct_in_process (id bigserial, label text)")
    conn.close()
    app = Flask(__name__)
    app.config.update(IDEMPOTENCY_DATABASE_URL=clean_db, IDEMPOTENCY_AUTO_MIGRATE=True)
    idempotency.init_app(app)
    runs.clear()
    with app.app_context():
        yield app
    app.extensions["idempotency"].close()


def rows(url: str, label: str) -> int:
    conn = psycopg2.connect(url)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT count(*) FROM ct_in_process WHERE label = %s", (label,))
            row = cur.fetchone()
    finally:
        conn.close()
    assert row is not None
    return int(row[0])


def test_the_key_is_the_header_else_the_task_id_and_a_replay_returns_the_stored_result(
    app: Flask, clean_db: str
) -> None:
    label = secrets.token_hex(4)
    first = by_id.apply(args=[label], task_id="t-1").get()
    again = by_id.apply(args=[label], task_id="t-1").get()
    # A new task id carrying the first one's key in the header: the same call.
    header = by_id.apply(args=[label], task_id="t-2", headers={KEY_HEADER: "t-1"}).get()
    assert first == again == header == {"label": label, "amount": 1, "runs": 1}
    assert rows(clean_db, label) == 1
    # A new task id alone is a new key: it runs.
    assert by_id.apply(args=[label], task_id="t-3").get()["runs"] == 2


def test_a_named_argument_keys_the_task_whether_passed_by_position_or_by_name(
    app: Flask, clean_db: str
) -> None:
    order = "ord_" + secrets.token_hex(4)
    assert by_arg.apply(args=[order, 5]).get() == 5
    assert by_arg.apply(kwargs={"order": order, "amount": 5}).get() == 5
    assert by_arg(order, 5) == 5  # a plain call is guarded too
    assert runs == [("by_arg", order)] and rows(clean_db, order) == 1
    # Another amount under the same order is another call: refused, not run.
    with pytest.raises(TaskKeyReused):
        by_arg.apply(args=[order, 6]).get()
    assert runs == [("by_arg", order)]
    # A key function.
    assert by_func.apply(kwargs={"tenant": "t", "ref": "r1"}).get() == "r1"
    assert by_func.apply(kwargs={"tenant": "t", "ref": "r1"}).get() == "r1"
    assert runs.count(("by_func", "r1")) == 1


def test_no_key_and_a_held_key_outside_a_worker_raise_instead_of_running(
    app: Flask, clean_db: str
) -> None:
    with pytest.raises(TaskKeyMissing):
        by_id("no task id, no header")  # a plain call has neither
    order = "ord_" + secrets.token_hex(4)
    gate["entered"].clear()
    gate["release"].clear()
    holder = threading.Thread(target=lambda: _in_context(app, lambda: slow.apply(args=[order])))
    holder.start()
    try:
        assert gate["entered"].wait(10)
        with pytest.raises(TaskDeferred) as deferred:
            slow.apply(args=[order]).get()
    finally:
        gate["release"].set()
        holder.join(10)
    assert deferred.value.reason == "in_progress" and deferred.value.delay > 0
    assert rows(clean_db, order) == 1


def test_a_result_that_is_not_json_fails_the_attempt_and_keeps_none_of_its_writes(
    app: Flask, clean_db: str
) -> None:
    order = "ord_" + secrets.token_hex(4)
    with pytest.raises(TypeError):
        not_json.apply(args=[order]).get()
    assert rows(clean_db, order) == 0
    # The failed attempt ended its claim: the same call runs again (and fails again).
    with pytest.raises(TypeError):
        not_json.apply(args=[order]).get()
    assert runs == [("not_json", order)] * 2 and rows(clean_db, order) == 0


def test_a_failed_attempt_is_logged_without_a_limit_as_celery_counts_the_retries(
    app: Flask, caplog: pytest.LogCaptureFixture
) -> None:
    order = "ord_" + secrets.token_hex(4)
    with caplog.at_level(logging.WARNING, "flask_idempotency.events"):
        with pytest.raises(TypeError):
            not_json.apply(args=[order]).get()
    [line] = [r.getMessage() for r in caplog.records if "handler failed" in r.getMessage()]
    assert "(attempt 1): TypeError" in line, line  # not "attempt 1 of 2147483647"


def _in_context(app: Flask, call: Any) -> None:
    with app.app_context():
        call()
