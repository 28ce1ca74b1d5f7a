"""The Celery app the tests' workers run (``celery -A celery_worker_app worker``).

Configured from the environment the harness (``celery_harness.py``) sets:
``CT_DATABASE_URL``, ``CT_AMQP_URL``, ``CT_REDIS_URL``, ``CT_QUEUE`` (a name of
the test's own, so concurrent runs never take each other's messages),
``CT_READY_FILE`` (written once the worker consumes) and ``CT_LEASE``.

Every task writes its effect through ``idempotency.connection()`` (rolled back
with the attempt) and, on a connection of its own, one ``ct_attempts`` row each
time its body starts (kept whatever happens): the tests count both. Each
message a worker finishes, whatever its state, is a ``ct_deliveries`` row.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import psycopg2
from celery import Celery
from celery.signals import task_postrun, worker_ready
from flask import Flask

from flask_idempotency import Idempotency
from flask_idempotency.celery import IdempotentTask

TABLES = """
CREATE TABLE IF NOT EXISTS ct_effects (
    id bigserial PRIMARY KEY, key text NOT NULL, amount integer, attempt integer
);
CREATE TABLE IF NOT EXISTS ct_attempts (
    id bigserial PRIMARY KEY, key text NOT NULL, pid integer NOT NULL
);
CREATE TABLE IF NOT EXISTS ct_deliveries (
    id bigserial PRIMARY KEY, task_id text, key text, state text NOT NULL
);
"""


class Transient(Exception):
    """What ``charge`` raises while ``fail_times`` says so: retried by Celery."""


def _env(name: str, default: str | None = None) -> str:
    value = os.environ.get(name, default)
    if value is None:
        raise RuntimeError(f"{name} is unset: the harness (celery_harness.py) sets it")
    return value


DATABASE_URL = _env("CT_DATABASE_URL", "")
QUEUE = _env("CT_QUEUE", "ct.unset")

flask_app = Flask(__name__)
flask_app.config.update(
    IDEMPOTENCY_DATABASE_URL=DATABASE_URL,
    IDEMPOTENCY_AUTO_MIGRATE=True,
    IDEMPOTENCY_LEASE=float(_env("CT_LEASE", "5")),
    IDEMPOTENCY_DATABASE_OPTIONS={"pool_size": 2},
)
idempotency = Idempotency()

celery_app = Celery("celery_worker_app")
celery_app.conf.update(
    broker_url=_env("CT_AMQP_URL", "memory://"),
    result_backend=_env("CT_REDIS_URL", "cache+memory://"),
    task_default_queue=QUEUE,
    # A payments team's configuration (docs/celery.md): acknowledge after the task,
    # give the message back when its pool process dies, one message at a time.
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    # No broadcast queue: other test runs on the same broker cannot reach us.
    worker_enable_remote_control=False,
    broker_connection_retry_on_startup=True,
    result_expires=600,
)


def _autocommit(sql: str, params: Any) -> None:
    conn = psycopg2.connect(DATABASE_URL)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            cur.execute(sql, params)
    finally:
        conn.close()


def _attempt(key: str) -> int:
    """Record that the body started (outside the task's transaction); its number."""
    conn = psycopg2.connect(DATABASE_URL)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            cur.execute("INSERT INTO ct_attempts (key, pid) VALUES (%s, %s)", (key, os.getpid()))
            cur.execute("SELECT count(*) FROM ct_attempts WHERE key = %s", (key,))
            row = cur.fetchone()
    finally:
        conn.close()
    assert row is not None
    return int(row[0])


def _effect(key: str, amount: int | None, attempt: int) -> None:
    with idempotency.connection().cursor() as cur:
        cur.execute(
            "INSERT INTO ct_effects (key, amount, attempt) VALUES (%s, %s, %s)",
            (key, amount, attempt),
        )


@celery_app.task(  # type: ignore[untyped-decorator]  # Celery is untyped
    base=IdempotentTask,
    bind=True,
    name="ct.charge",
    flask_app=flask_app,
    idempotency_key="order_id",
    idempotency_busy_delay=0.2,
    autoretry_for=(Transient,),
    max_retries=5,
    default_retry_delay=0.1,
)
def charge(
    self: Any,
    order_id: str,
    amount: int,
    *,
    hang_first: bool = False,
    fail_times: int = 0,
    work_seconds: float = 0.0,
) -> dict[str, Any]:
    attempt = _attempt(order_id)
    _effect(order_id, amount, attempt)
    if hang_first and attempt == 1:
        time.sleep(120)  # the test kills this process here
    if attempt <= fail_times:
        raise Transient(f"attempt {attempt} fails")
    if work_seconds:
        time.sleep(work_seconds)
    return {"order_id": order_id, "amount": amount, "attempt": attempt, "pid": os.getpid()}


@celery_app.task(  # type: ignore[untyped-decorator]
    base=IdempotentTask,
    bind=True,
    name="ct.crash",
    flask_app=flask_app,
    idempotency_key="order_id",
    idempotency_busy_delay=0.2,
)
def crash(self: Any, order_id: str, *, die_times: int | None = None) -> dict[str, Any]:
    """Kills its pool process (``os._exit``) on its first ``die_times`` attempts,
    every time when ``None``: a segfault or an OOM kill, as Celery sees it. The
    default ``idempotency_max_worker_losses`` (3) applies."""
    attempt = _attempt(order_id)
    _effect(order_id, None, attempt)
    if die_times is None or attempt <= die_times:
        os._exit(1)
    return {"order_id": order_id, "attempt": attempt, "pid": os.getpid()}


@celery_app.task(  # type: ignore[untyped-decorator]
    base=IdempotentTask, bind=True, name="ct.record_event", flask_app=flask_app
)
def record_event(self: Any, event: dict[str, Any]) -> dict[str, Any]:
    """An outbox event's consumer: keyed by the ``idempotency_key`` header (the event id)."""
    attempt = _attempt(event["id"])
    _effect(event["id"], None, attempt)
    return {"event": event["id"], "data": event["data"], "attempt": attempt}


@task_postrun.connect  # type: ignore[untyped-decorator]
def _delivered(task_id: str, task: Any, args: Any, kwargs: Any, state: str, **_: Any) -> None:
    key = kwargs.get("order_id") or (args[0] if args else None)
    if isinstance(key, dict):
        key = key.get("id")
    _autocommit(
        "INSERT INTO ct_deliveries (task_id, key, state) VALUES (%s, %s, %s)",
        (task_id, str(key), state or "UNKNOWN"),
    )


@worker_ready.connect  # type: ignore[untyped-decorator]
def _ready(**_: Any) -> None:
    ready = os.environ.get("CT_READY_FILE")
    if ready:
        Path(ready).write_text(str(os.getpid()))


if DATABASE_URL:
    _autocommit(TABLES, None)
    idempotency.init_app(flask_app)
