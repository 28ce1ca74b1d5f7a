"""A live request is never taken over, however busy its worker's pool is.

The lease keeper renews on a connection of its own, not on one of the request
slots of ``IDEMPOTENCY_DATABASE_OPTIONS["pool_size"]``: with every slot held by a slow view (more
gunicorn threads than pool slots), the renewals still run, and a duplicate on
another worker gets ``409 in_progress`` instead of taking the key over and
running the view a second time.

The app below (``create_app``, also served by gunicorn) counts executions in
``core_executions`` on a connection outside the extension's pool, labelled with
the request's key: the views never need a second pool slot (which
``support.core_app`` does, through ``idempotency.transaction()``).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import psycopg2
import pytest
from flask import Flask, Response, jsonify, request

from flask_idempotency import Idempotency
from flask_idempotency.settings import Settings
from flask_idempotency.store.pool import EnginePool, build_engine
from flask_idempotency.workers import check_pool_size
from support import core_app
from support.records import wait_for_renewal
from support.servers import GunicornFactory, http_request

MakeApp = Callable[..., Flask]


def create_app(database_url: str | None = None, config: Mapping[str, Any] | None = None) -> Flask:
    """``/slow``: records its execution, waits (``sleep`` seconds or ``gate``), then
    writes a business row in the request's transaction. ``CAPACITY_IDEMPOTENCY_*``
    variables configure it under gunicorn."""
    app = Flask(__name__)
    dsn = database_url or os.environ["DATABASE_URL"]
    app.config.update(
        IDEMPOTENCY_DATABASE_URL=dsn,
        IDEMPOTENCY_AUTO_MIGRATE=True,
        IDEMPOTENCY_SCOPE_FUNC=lambda request: "capacity-tests",  # one client
    )
    for name, value in os.environ.items():
        if name.startswith("CAPACITY_IDEMPOTENCY_"):
            # A group of options (``..._DATABASE_OPTIONS``) is given as JSON.
            parsed = json.loads(value) if name.endswith("_OPTIONS") else value
            app.config[name.removeprefix("CAPACITY_")] = parsed
    app.config.update(config or {})
    with psycopg2.connect(dsn) as conn, conn.cursor() as cur:
        cur.execute("SELECT pg_advisory_xact_lock(4242)")
        cur.execute(core_app.TABLES)
    conn.close()
    idempotency = Idempotency(app)
    gates = core_app.Gates()
    app.extensions["gates"] = gates
    app.extensions["idem"] = idempotency

    @app.post("/slow")
    @idempotency.required
    def slow() -> tuple[Response, int]:
        body = request.get_json(silent=True) or {}
        label = request.headers["Idempotency-Key"]
        # Outside the extension's pool: an execution is counted even when the
        # attempt is later rolled back, and the view needs no second slot.
        direct = psycopg2.connect(dsn)
        try:
            direct.autocommit = True
            with direct.cursor() as cur:
                cur.execute(
                    "INSERT INTO core_executions (label, pid) VALUES (%s, %s)",
                    (label, os.getpid()),
                )
        finally:
            direct.close()
        if "gate" in body:
            gates.entered_event(body["gate"]).set()
            gates.get(body["gate"]).wait(timeout=30)
        time.sleep(float(body.get("sleep", 0)))
        with idempotency.connection().cursor() as cur:
            cur.execute("INSERT INTO core_business_rows (label) VALUES (%s) RETURNING id", (label,))
            row = cur.fetchone()
            assert row is not None
        return jsonify({"row": row[0], "key": label, "pid": os.getpid()}), 201

    return app


def executions(database_url: str) -> dict[str, int]:
    with psycopg2.connect(database_url) as conn, conn.cursor() as cur:
        cur.execute("SELECT label, count(*) FROM core_executions GROUP BY label")
        rows = cur.fetchall()
    conn.close()
    return {str(label): int(count) for label, count in rows}


@pytest.fixture
def make_capacity_app(clean_db: str) -> Iterator[MakeApp]:
    apps: list[Flask] = []

    def make(**config: Any) -> Flask:
        app = create_app(clean_db, config)
        apps.append(app)
        return app

    yield make
    for app in apps:
        app.extensions["idempotency"].close()


def post(app: Flask, key: str, body: dict[str, Any]) -> Any:
    return app.test_client().post("/slow", json=body, headers={"Idempotency-Key": key})


def test_keeper_renews_while_every_pool_slot_is_held(
    make_capacity_app: MakeApp, clean_db: str
) -> None:
    # Two "workers" of one pool slot each. The first one's only slot is held by a
    # view for several leases; its keeper must still renew.
    config = {
        "IDEMPOTENCY_DATABASE_OPTIONS": {"pool_size": 1, "pool_timeout": 5},
        "IDEMPOTENCY_LEASE": 1.0,
        "IDEMPOTENCY_LEASE_RENEW_INTERVAL": 0.2,
    }
    first, second = make_capacity_app(**config), make_capacity_app(**config)
    body = {"gate": "held"}
    answers: list[Any] = []
    holder = threading.Thread(target=lambda: answers.append(post(first, "live", body)))
    holder.start()
    try:
        assert first.extensions["gates"].entered_event("held").wait(10)
        wait_for_renewal(clean_db)  # the keeper renews, though the view holds the only slot
        duplicate = post(second, "live", body)
        assert duplicate.status_code == 409, duplicate.get_json()
        assert duplicate.get_json()["error"]["code"] == "in_progress"
    finally:
        first.extensions["gates"].get("held").set()
        second.extensions["gates"].get("held").set()
        holder.join(15)
    assert answers[0].status_code == 201, answers[0].get_json()
    assert executions(clean_db) == {"live": 1}


def test_waiting_for_a_pool_slot_is_warned_about_once(
    clean_db: str, caplog: pytest.LogCaptureFixture
) -> None:
    engine = build_engine(Settings(database_url=clean_db, pool_size=1, pool_timeout=5))
    pool = EnginePool(engine, owned=True)
    held = pool.getconn()
    taken: list[Any] = []
    waiter = threading.Thread(target=lambda: taken.append(pool.getconn()))
    with caplog.at_level(logging.WARNING, logger="flask_idempotency"):
        waiter.start()
        time.sleep(0.2)
        pool.putconn(held)
        waiter.join(5)
        pool.putconn(taken[0])
        for _ in range(2):  # waits again, warned no more
            held = pool.getconn()
            waiter = threading.Thread(target=lambda: taken.append(pool.getconn()))
            waiter.start()
            time.sleep(0.1)
            pool.putconn(held)
            waiter.join(5)
            pool.putconn(taken[-1])
    pool.close()
    warnings = [r for r in caplog.records if "pool_size" in r.getMessage()]
    assert len(warnings) == 1
    assert warnings[0].levelno == logging.WARNING


class _Log:
    def __init__(self) -> None:
        self.warnings: list[str] = []

    def warning(self, message: str, *args: Any) -> None:
        self.warnings.append(message % args)

    def info(self, message: str, *args: Any) -> None:
        pass


def test_pool_smaller_than_the_worker_threads_is_warned_about(
    make_capacity_app: MakeApp,
) -> None:
    app = make_capacity_app(IDEMPOTENCY_DATABASE_OPTIONS={"pool_size": 2})
    log = _Log()
    assert not check_pool_size(app, threads=12, log=log)
    assert len(log.warnings) == 1
    assert "pool_size" in log.warnings[0] and "12" in log.warnings[0]
    assert check_pool_size(app, threads=2, log=log)
    assert len(log.warnings) == 1


# -- through gunicorn -----------------------------------------------------------

GUNICORN_CONF = """
from flask_idempotency.gunicorn import post_worker_init  # noqa: F401
"""


@pytest.mark.reliability
def test_no_takeover_under_gunicorn_with_more_threads_than_pool_slots(
    gunicorn_server: GunicornFactory, clean_db: str, tmp_path: Path
) -> None:
    conf = tmp_path / "gunicorn.conf.py"
    conf.write_text(GUNICORN_CONF)
    server = gunicorn_server(
        "core.test_lease_capacity:create_app()",
        workers=2,
        worker_class="gthread",
        threads=12,
        config=conf,
        env={
            "DATABASE_URL": clean_db,
            "CAPACITY_IDEMPOTENCY_DATABASE_OPTIONS": '{"pool_size": 2, "pool_timeout": 30}',
            "CAPACITY_IDEMPOTENCY_LEASE": "1.5",
            "CAPACITY_IDEMPOTENCY_LEASE_RENEW_INTERVAL": "0.5",
        },
    )
    # Views of 1.7 to 2.8 leases each (the renewals are what is tested, so these
    # sleeps stay), more of them than the two workers have slots, and each key sent
    # again and again from other connections while it runs.
    sleeps = [2.5, 3.0, 3.5, 4.0, 2.75, 3.25, 3.75, 4.25]
    keys = [f"key-{i}" for i in range(len(sleeps))]
    finals: dict[str, list[Any]] = {key: [] for key in keys}
    errors: list[BaseException] = []

    def client(key: str, sleep: float, delay: float) -> None:
        time.sleep(delay)
        deadline = time.monotonic() + 90
        try:
            while time.monotonic() < deadline:
                answer = http_request(
                    "POST",
                    server.url + "/slow",
                    headers={"Idempotency-Key": key},
                    json={"sleep": sleep},
                    timeout=60,
                )
                if answer.status == 201:
                    finals[key].append(answer.json())
                    return
                assert answer.status in (409, 503), (answer.status, answer.body)
                time.sleep(0.2)
            raise AssertionError(f"{key} never finished")
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=client, args=(key, sleep, delay))
        for key, sleep in zip(keys, sleeps, strict=True)
        for delay in (0.0, 1.7, 2.3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors
    assert executions(clean_db) == {key: 1 for key in keys}
    for key in keys:
        assert len({answer["row"] for answer in finals[key]}) == 1  # one stored answer
    server.stop()
    log = server.log_text()
    assert log.count("for 12 worker threads") == 2  # post_worker_init, in each worker
