"""Fixtures and helpers of the Celery tests: real workers on the machine's RabbitMQ.

``celery_worker(concurrency=4)`` starts ``celery -A celery_worker_app worker``
(prefork) as a process group of its own, consuming a queue named for the test
alone, with Redis (``REDIS_URL``) as the result backend; ``celery_client`` is a
Celery app in the test process that publishes to that queue and reads results.

The broker is ``AMQP_URL`` (``.ci/run`` sets it when RabbitMQ answers). Unset,
these tests skip and say so, except under CI (``CI`` set), where a missing
broker fails them, as in tests/events.

This folder has no ``__init__.py`` on purpose: a package ``tests/celery`` would
be imported as ``celery`` and hide Celery itself. Without one, a ``conftest.py``
here would be a second top-level module ``conftest`` (mypy refuses that), so the
fixtures live in this module and the test modules import them by name.
"""

from __future__ import annotations

import os
import secrets
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from support._procs import log_tail, spawn, stop_process
from support.pg_query import query
from support.waiting import wait_until

#: What ``from celery_harness import *`` gives a test module: the fixtures.
__all__ = ["celery_amqp_url", "celery_client", "celery_env", "celery_worker"]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


@pytest.fixture(scope="session")
def celery_amqp_url(amqp_url: str) -> str:
    """The run's RabbitMQ (``amqp_url`` of tests/conftest.py), as the Celery tests name it."""
    return amqp_url


class CeleryWorker:
    """One ``celery worker`` process group, its log, and ways to stop or kill it."""

    def __init__(self, env: dict[str, str], workdir: Path, concurrency: int) -> None:
        self.env = env
        self.concurrency = concurrency
        self.ready_file = workdir / f"ready-{secrets.token_hex(4)}"
        self.log_path = workdir / f"worker-{secrets.token_hex(4)}.log"
        self.proc: Any = None

    def start(self, timeout: float = 30.0) -> CeleryWorker:
        argv = [
            sys.executable, "-m", "celery", "-A", "celery_worker_app", "worker",
            "--pool", "prefork", "--concurrency", str(self.concurrency),
            "--queues", self.env["CT_QUEUE"],
            "--hostname", f"{self.env['CT_QUEUE']}-{secrets.token_hex(2)}@%h",
            "--without-gossip", "--without-mingle", "--without-heartbeat",
            "--loglevel", "INFO",
        ]  # fmt: skip
        env = dict(self.env, CT_READY_FILE=str(self.ready_file))
        self.proc = spawn(
            argv, log_path=self.log_path, env=env, cwd=HERE, death_signal=signal.SIGKILL
        )
        # Ready when the worker says it consumes (worker_ready), not after a sleep.
        wait_until(
            lambda: self.ready_file.exists() or self.proc.poll() is not None,
            timeout,
            "the celery worker to consume",
            describe=self.log,
            interval=0.05,
        )
        if self.proc.poll() is not None:
            raise RuntimeError(f"celery worker exited at start:\n{self.log()}")
        return self

    def log(self) -> str:
        return log_tail(self.log_path, max_lines=80) if self.log_path.exists() else "(no log)"

    def kill(self) -> None:
        """SIGKILL the whole worker at once (main process and pool), as a lost machine."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        # A cold shutdown (SIGQUIT): the tests have checked what they wanted, and
        # a warm one waits for the deferred copies still held by the worker.
        if self.proc is not None:
            stop_process(self.proc, [(signal.SIGQUIT, 5.0)])


@pytest.fixture
def celery_env(
    clean_db: str, redis_url: str, celery_amqp_url: str, tmp_path: Path
) -> Iterator[dict[str, str]]:
    """The workers' environment: this test's queue, database, broker and backend.
    The queue is deleted at teardown."""
    queue = f"ct.{secrets.token_hex(6)}"
    pythonpath = os.pathsep.join([str(HERE), str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = dict(
        os.environ,
        CT_DATABASE_URL=clean_db,
        CT_AMQP_URL=celery_amqp_url,
        CT_REDIS_URL=redis_url,
        CT_QUEUE=queue,
        CT_LEASE="5",
        PYTHONPATH=pythonpath,
        # Celery's and the app's own warnings are the worker's log, not errors.
        PYTHONWARNINGS="ignore",
    )
    yield env
    import kombu

    with kombu.Connection(celery_amqp_url, connect_timeout=5) as conn:
        try:
            conn.channel().queue_delete(queue)
        except Exception:
            pass


@pytest.fixture
def celery_worker(
    celery_env: dict[str, str], tmp_path: Path
) -> Iterator[Callable[..., CeleryWorker]]:
    """Factory: ``celery_worker(concurrency=4, **env)`` -> a started worker; all are
    stopped at teardown and their logs printed (shown when the test failed)."""
    workers: list[CeleryWorker] = []

    def make(concurrency: int = 4, **env: str) -> CeleryWorker:
        worker = CeleryWorker(dict(celery_env, **env), tmp_path, concurrency)
        workers.append(worker)
        return worker.start()

    yield make
    for worker in workers:
        worker.stop()
        print(f"--- celery worker log ({worker.log_path.name}) ---\n{worker.log()}")


@pytest.fixture
def celery_client(celery_env: dict[str, str]) -> Iterator[Any]:
    """A Celery app in the test process: publishes to the test's queue, reads results."""
    from celery import Celery

    app = Celery("celery_tests_client")
    app.conf.update(
        broker_url=celery_env["CT_AMQP_URL"],
        result_backend=celery_env["CT_REDIS_URL"],
        task_default_queue=celery_env["CT_QUEUE"],
        broker_connection_retry_on_startup=True,
    )
    yield app
    app.close()


def wait_for_rows(
    database_url: str, sql: str, params: Any, expect: int, *, timeout: float = 30.0
) -> int:
    """Poll ``sql`` (a ``count(*)``) until it reaches ``expect``; the last count."""
    deadline = time.monotonic() + timeout
    while True:
        count = int(query(database_url, sql, params)[0][0])
        if count >= expect or time.monotonic() > deadline:
            return count
        time.sleep(0.05)
