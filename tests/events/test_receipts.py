"""The example app's events (CONTRACT §2, §5) in process: ``charge.succeeded``, receipts.

A created charge emits its event with the charge row; a decline, a processor
failure and a replay emit nothing. The receipts handler then writes one receipt
per charge, over the embedded path (no broker) and over RabbitMQ.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from flask import Flask
from flask.testing import FlaskClient

from example_app import create_app, receipts
from example_app.auth import owner_of
from example_app.processor_client import InProcessProcessorClient
from example_app.processor_core import FakeProcessor
from flask_idempotency import digests
from flask_idempotency.events import ConsumerWorker
from support.pg_query import query
from support.waiting import wait_until

from .conftest import BrokerNames

TOKEN, OTHER = "sk_test_receipts", "sk_test_other"
BODY: dict[str, Any] = {"amount": 1500, "currency": "usd", "customer": "cus_r", "source": "tok"}
BuildApp = Callable[..., Flask]


@pytest.fixture
def build_app(clean_db: str) -> Iterator[BuildApp]:
    apps: list[Flask] = []

    def build(**config: Any) -> Flask:
        base: dict[str, Any] = {
            "TESTING": True,
            "DATABASE_URL": clean_db,
            "REDIS_URL": None,
            "PROCESSOR_URL": None,
            "AMQP_URL": None,
            "PROCESSOR_CLIENT": InProcessProcessorClient(FakeProcessor(), 2.0),
        }
        app = create_app(base | config)
        apps.append(app)
        return app

    yield build
    for app in apps:
        app.extensions["idempotency"].close()


def charge(client: FlaskClient, key: str, token: str = TOKEN, **changes: Any) -> Any:
    headers = {"Authorization": f"Bearer {token}", "Idempotency-Key": key}
    return client.post("/v1/charges", json=BODY | changes, headers=headers)


def list_receipts(client: FlaskClient, token: str = TOKEN, customer: str = "cus_r") -> Any:
    headers = {"Authorization": f"Bearer {token}"}
    return client.get(f"/v1/receipts?customer={customer}", headers=headers).get_json()["data"]


def test_a_created_charge_emits_charge_succeeded_once(build_app: BuildApp, clean_db: str) -> None:
    client = build_app().test_client()
    created = charge(client, "c-1")
    assert created.status_code == 201
    assert charge(client, "c-1").headers["Idempotent-Replayed"] == "true"
    assert charge(client, "c-2", source="tok_decline_x").status_code == 402
    rows = query(clean_db, "SELECT event_type, payload, derived_key FROM idempotency_outbox")
    print(f"charges=1 declines=1 replays=1 events={len(rows)}")
    assert len(rows) == 1
    event_type, payload, derived = rows[0]
    assert event_type == "charge.succeeded"
    assert payload == created.get_json() | {"owner": owner_of(TOKEN)}
    assert derived == digests.derived_key(digests.record_key(owner_of(TOKEN), "c-1"), "events")


def test_the_embedded_path_writes_one_receipt_per_charge(build_app: BuildApp) -> None:
    app = build_app()
    client = app.test_client()
    events = receipts.embedded(app)
    events.relay.poll_interval = 0.05
    events.start()
    try:
        charges = [charge(client, f"e-{n}").get_json()["id"] for n in range(5)]
        charge(client, "e-0")  # a replay: no second event, no second receipt
        wait_until(lambda: len(list_receipts(client)) == 5, 10, "five receipts")
        time.sleep(0.2)
    finally:
        events.stop()
    listed = list_receipts(client)
    print(f"charges={len(charges)} receipts={len(listed)} relay={events.relay.stats}")
    assert sorted(r["charge"] for r in listed) == sorted(charges)
    assert all(r["id"].startswith("rc_") and r["amount"] == 1500 for r in listed)
    assert all(r["currency"] == "usd" and isinstance(r["created"], int) for r in listed)
    assert list_receipts(client, token=OTHER) == []
    assert client.get("/v1/receipts?customer=cus_r").status_code == 401
    missing = client.get("/v1/receipts", headers={"Authorization": f"Bearer {TOKEN}"})
    assert missing.status_code == 400


def test_over_rabbitmq_the_relay_and_the_receipts_worker_write_each_receipt_once(
    build_app: BuildApp, amqp_url: str, broker_names: BrokerNames, clean_db: str
) -> None:
    exchange, queue = broker_names.exchange(), broker_names.queue("receipts")
    app = build_app(AMQP_URL=amqp_url, EVENTS_EXCHANGE=exchange, RECEIPTS_QUEUE=queue)
    client = app.test_client()
    worker = ConsumerWorker(app, amqp_url, [receipts.subscription(app.config)])
    stop = threading.Event()
    thread = threading.Thread(target=worker.run, args=(stop,))
    thread.start()
    try:
        assert worker.connected.wait(10)
        charges = [charge(client, f"q-{n}").get_json()["id"] for n in range(5)]
        runner = app.test_cli_runner()
        for _ in range(2):  # a second relay run publishes nothing again
            result = runner.invoke(args=["idempotency", "relay", "--once"])
            assert result.exit_code == 0, result.output
        # A duplicate publish of every event (as after a relay crash): acked, not run.
        query(clean_db, "UPDATE idempotency_outbox SET published_at = NULL")
        assert runner.invoke(args=["idempotency", "relay", "--once"]).exit_code == 0
        wait_until(lambda: worker.counts["duplicate"] == 5, 10, "five duplicates")
    finally:
        stop.set()
        thread.join(10)
    listed = list_receipts(client)
    print(f"charges={len(charges)} receipts={len(listed)} worker={dict(worker.counts)}")
    assert sorted(r["charge"] for r in listed) == sorted(charges)
    assert worker.counts["handled"] == 5


def test_events_embedded_starts_the_embedded_path_in_the_web_process(build_app: BuildApp) -> None:
    app = build_app(EVENTS_EMBEDDED=True)
    client = app.test_client()
    try:
        charge_id = charge(client, "w-1").get_json()["id"]
        wait_until(
            lambda: [r["charge"] for r in list_receipts(client)] == [charge_id],
            10,
            "the charge's one receipt",
        )
    finally:
        app.extensions[receipts.EMBEDDED_KEY].stop()


def test_the_receipts_service_without_amqp_url_relays_in_one_process(
    build_app: BuildApp, clean_db: str
) -> None:
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k not in ("AMQP_URL", "REDIS_URL")}
    env |= {"DATABASE_URL": clean_db, "PYTHONPATH": str(root)}
    client = build_app().test_client()
    charges = [charge(client, f"s-{n}").get_json()["id"] for n in range(3)]
    service = subprocess.Popen(
        [sys.executable, "-m", "example_app.receipts"],
        cwd=root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_until(lambda: len(list_receipts(client)) == 3, 20, "three receipts")
    finally:
        service.send_signal(signal.SIGTERM)
        output = service.communicate(timeout=20)[0].decode(errors="replace")
    print(output[-500:])
    assert service.returncode == 0, output
    assert sorted(r["charge"] for r in list_receipts(client)) == sorted(charges)
