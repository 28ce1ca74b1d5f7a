"""`make run` without DATABASE_URL: gunicorn's master owns the embedded PostgreSQL.

gunicorn.conf.py starts the embedded server (pgserver, example_app/embedded.py)
in the master before any worker exists, and stops it when the master exits
(Ctrl-C is SIGINT, a process manager sends SIGTERM). A worker exiting or being
replaced must not stop it: the other workers still use it.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from example_app.embedded import embedded_postgres_pid, stop_embedded_postgres
from support.gunicorn_server import REPO_ROOT, GunicornServer
from support.http_client import http_request
from support.waiting import wait_until

CHARGE = {"amount": 1500, "currency": "usd", "customer": "cus_embedded", "source": "tok_visa"}


def _charge(server: GunicornServer, key: str) -> int:
    headers = {"Authorization": "Bearer sk_test_embedded", "Idempotency-Key": key}
    return http_request("POST", server.url + "/v1/charges", json=CHARGE, headers=headers).status


def test_ctrl_c_stops_the_embedded_postgres_the_master_started(tmp_path: Path) -> None:
    instance = tmp_path / "instance"
    server = GunicornServer(
        "wsgi:app",
        config=REPO_ROOT / "gunicorn.conf.py",
        env={"DATABASE_URL": "", "REDIS_URL": "", "EXAMPLE_INSTANCE_PATH": str(instance)},
        workers=2,
        worker_class="gthread",
        threads=2,
        health_path="/healthz",
        startup_timeout=120,
    )
    try:
        server.start()
        postgres = embedded_postgres_pid(str(instance))
        assert postgres is not None, server.log_text()
        assert postgres not in (server.master_pid, *server.worker_pids())
        assert _charge(server, "embedded-1") == 201

        # Workers come and go (a graceful exit, a crash): the database stays.
        for sig in (signal.SIGTERM, signal.SIGKILL):
            victim = server.worker_pids()[0]
            server.kill_worker(victim, sig)
            server.wait_for_workers(exclude=[victim], timeout=30)
            assert embedded_postgres_pid(str(instance)) == postgres
        wait_until(
            lambda: http_request("GET", server.url + "/healthz").status == 200,
            30,
            "the replaced workers serve",
        )
        assert _charge(server, "embedded-2") == 201
        assert embedded_postgres_pid(str(instance)) == postgres

        # Ctrl-C: the terminal signals the whole foreground process group (gunicorn runs
        # in its own here); PostgreSQL is not in it, as pg_ctl detached it.
        os.killpg(server.master_pid, signal.SIGINT)
        wait_until(lambda: not server.running, 60, "gunicorn's master exits")
        wait_until(
            lambda: embedded_postgres_pid(str(instance)) is None,
            30,
            "the embedded PostgreSQL is gone",
        )
        assert "stopping the embedded PostgreSQL" in server.log_text()
    finally:
        server.close()
        stop_embedded_postgres(str(instance), wait=30)  # if the test failed half-way


def test_sigterm_stops_it_unless_another_master_started_it(tmp_path: Path) -> None:
    """SIGTERM (a process manager's stop) stops it too, but only in the master that
    started it: another gunicorn (or a ``flask`` command) that did is left running."""
    instance = tmp_path / "instance"
    env = {"DATABASE_URL": "", "REDIS_URL": "", "EXAMPLE_INSTANCE_PATH": str(instance)}
    options = {"config": REPO_ROOT / "gunicorn.conf.py", "env": env, "health_path": "/healthz"}
    first = GunicornServer("wsgi:app", startup_timeout=120, **options)  # type: ignore[arg-type]
    second = GunicornServer("wsgi:app", startup_timeout=60, **options)  # type: ignore[arg-type]
    try:
        first.start()
        postgres = embedded_postgres_pid(str(instance))
        assert postgres is not None
        second.start()
        second.stop()
        assert embedded_postgres_pid(str(instance)) == postgres
        assert "left running on exit" in second.log_text()
        first.stop()  # SIGTERM
        wait_until(lambda: embedded_postgres_pid(str(instance)) is None, 30, "it is gone")
    finally:
        second.close()
        first.close()
        stop_embedded_postgres(str(instance), wait=30)
