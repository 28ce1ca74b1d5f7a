"""The consumer guard: once in effect per message, whatever the transport does.

``handle()`` directly first (each row of the guard's table), then the kombu
loop against the machine's RabbitMQ: a poison message ends in the dead-letter
queue after N attempts while the others keep flowing.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from flask import Flask

from flask_idempotency import digests
from flask_idempotency.events import (
    ConsumerOutcome,
    ConsumerWorker,
    Delivery,
    Relay,
    Subscription,
)
from flask_idempotency.events.amqp import Publisher
from flask_idempotency.events.messages import Result
from flask_idempotency.events.relay import Backoff
from support.pg_query import query
from support.records import end_leases
from support.servers import ProxyFactory
from support.waiting import wait_until

from . import app as events_app
from .conftest import BrokerNames, emit_many, take_all

MakeApp = Callable[..., Flask]
idempotency = events_app.idempotency


def record(delivery: Delivery, consumer: str) -> None:
    """The handler's business write, in the guard's transaction."""
    with idempotency.connection().cursor() as cur:
        cur.execute(
            "INSERT INTO ev_handled (consumer, message_id) VALUES (%s, %s)",
            (consumer, delivery.id),
        )


def handled(url: str) -> list[str]:
    return [r[0] for r in query(url, "SELECT message_id FROM ev_handled ORDER BY id")]


def delivery(message_id: str = "evt_1", **payload: Any) -> Delivery:
    body = {"id": message_id, "type": "thing.created", "created": 0, "data": payload or {"n": 1}}
    return Delivery.from_body(body, message_id=message_id)


@pytest.fixture
def app(make_events_app: MakeApp) -> Flask:
    return make_events_app()


def test_a_message_is_handled_once_and_a_redelivery_is_acknowledged_without_running(
    app: Flask, clean_db: str
) -> None:
    runs: list[str] = []

    @idempotency.consumer("ledger")
    def write(d: Delivery) -> None:
        runs.append(str(d.id))
        record(d, "ledger")

    first = write.handle(delivery(), app=app)
    again = write.handle(delivery(), app=app)
    print(f"outcomes={first.outcome.value},{again.outcome.value} runs={len(runs)}")
    assert (first.outcome, again.outcome) == (ConsumerOutcome.HANDLED, ConsumerOutcome.DUPLICATE)
    assert first.outcome.acknowledge and again.outcome.acknowledge
    assert runs == ["evt_1"] and handled(clean_db) == ["evt_1"]
    # Keyed by message id under the scope "consumer:<name>", in the records table.
    rows = query(
        clean_db,
        "SELECT state FROM idempotency_records WHERE record_key = %s",
        (digests.record_key("consumer:ledger", "evt_1"),),
    )
    assert rows == [("completed",)]

    # Another consumer of the same message has records of its own.
    @idempotency.consumer("mailer")
    def mail(d: Delivery) -> None:
        record(d, "mailer")

    assert mail.handle(delivery(), app=app).outcome is ConsumerOutcome.HANDLED


def test_a_claim_held_by_a_live_consumer_is_requeued_with_a_delay(app: Flask) -> None:
    entered, release = threading.Event(), threading.Event()

    @idempotency.consumer("slow", busy_delay=0.5)
    def slow(d: Delivery) -> None:
        entered.set()
        release.wait(10)

    results: list[Result] = []
    worker = threading.Thread(target=lambda: results.append(slow.handle(delivery(), app=app)))
    worker.start()
    try:
        assert entered.wait(5)
        busy = slow.handle(delivery(), app=app)
    finally:
        release.set()
        worker.join(10)
    print(f"second delivery: {busy.outcome.value} delay={busy.delay:.2f}s")
    assert busy.outcome is ConsumerOutcome.BUSY and not busy.outcome.acknowledge
    assert 0 < busy.delay <= 0.5
    assert results[0].outcome is ConsumerOutcome.HANDLED


def test_a_dead_consumers_lease_is_taken_over_and_its_late_commit_fenced(
    make_events_app: MakeApp, clean_db: str
) -> None:
    # No renewals: a consumer that stops renewing is what a dead one looks like.
    app = make_events_app(IDEMPOTENCY_LEASE=0.5, IDEMPOTENCY_LEASE_RENEW_INTERVAL=0)
    entered, release = threading.Event(), threading.Event()

    @idempotency.consumer("receipts")
    def write(d: Delivery) -> None:
        record(d, threading.current_thread().name)
        if threading.current_thread().name == "stalled":
            entered.set()
            release.wait(10)

    results: dict[str, Result] = {}

    def stalled() -> None:
        results["stalled"] = write.handle(delivery(), app=app)

    thread = threading.Thread(target=stalled, name="stalled")
    thread.start()
    try:
        assert entered.wait(5)
        assert end_leases(clean_db) == 1  # as once its lease ran out
        results["taker"] = write.handle(delivery(), app=app)
    finally:
        release.set()
        thread.join(10)
    takeovers = query(clean_db, "SELECT takeovers FROM idempotency_records")[0][0]
    print({k: v.outcome.value for k, v in results.items()}, f"takeovers={takeovers}")
    assert results["taker"].outcome is ConsumerOutcome.HANDLED
    assert (
        results["stalled"].outcome is ConsumerOutcome.FENCED
        and results["stalled"].outcome.acknowledge
    )
    assert query(clean_db, "SELECT consumer FROM ev_handled") == [("MainThread",)]
    assert takeovers == 1


def test_a_message_that_kills_its_consumer_every_time_is_dead_lettered_unrun(
    app: Flask, clean_db: str, tmp_path: Path
) -> None:
    """Each attempt ends its process (``os._exit``: a segfault, an OOM kill), so
    nothing raises and no retry is counted; only the record's takeovers show it.
    After ``max_attempts`` lost attempts the next delivery copies the message to
    the dead-letter queue without running it, and releases its record: the
    message, replayed after a fix, runs from its first attempt."""
    parent = os.getpid()
    runs = tmp_path / "runs"

    @idempotency.consumer("crasher", max_attempts=3)
    def crash(d: Delivery) -> None:
        with runs.open("a") as out:
            out.write("x")
        if os.getpid() == parent:
            raise AssertionError("the poison message ran in the test's own process")
        os._exit(1)

    fork = multiprocessing.get_context("fork")
    for _ in range(3):
        child = fork.Process(target=lambda: crash.handle(delivery("evt_poison"), app=app))
        child.start()
        child.join(30)
        assert child.exitcode == 1
        assert end_leases(clean_db) == 1  # as time does for the dead holder's lease
    dead: list[tuple[str | None, str | None, str]] = []
    result = crash.handle(
        delivery("evt_poison"),
        app=app,
        dead_letter=lambda d, r, reason: dead.append((d.id, r.reason, reason)),
    )
    assert result.outcome is ConsumerOutcome.DEAD_LETTERED and result.outcome.acknowledge
    assert (result.reason, result.attempts) == ("worker_lost", 3)
    assert dead == [("evt_poison", "worker_lost", "3 attempts lost without finishing")]
    assert runs.read_text() == "xxx"  # three lost attempts, none since
    assert query(clean_db, "SELECT count(*) FROM idempotency_records") == [(0,)]

    @idempotency.consumer("crasher", max_attempts=3)
    def fixed(d: Delivery) -> None:
        record(d, "fixed")

    assert fixed.handle(delivery("evt_poison"), app=app).outcome is ConsumerOutcome.HANDLED
    assert handled(clean_db) == ["evt_poison"]


def test_a_failing_handler_is_retried_with_backoff_then_dead_lettered(
    app: Flask, clean_db: str, caplog: pytest.LogCaptureFixture
) -> None:
    dead: list[tuple[str | None, Result, str]] = []

    @idempotency.consumer("flaky", max_attempts=3, retry_delay=0.1)
    def always_fails(d: Delivery) -> None:
        record(d, "flaky")
        raise ValueError("cannot handle this one")

    def dead_letter(d: Delivery, result: Result, error: str) -> None:
        dead.append((d.id, result, error))

    with caplog.at_level(logging.WARNING, "flask_idempotency.events"):
        results = [
            always_fails.handle(delivery(), app=app, dead_letter=dead_letter) for _ in range(3)
        ]
    failed = [r.getMessage() for r in caplog.records if "handler failed" in r.getMessage()]
    assert ["(attempt 1 of 3)" in failed[0], "(attempt 3 of 3)" in failed[2]] == [True, True]
    assert [r.outcome for r in results] == [
        ConsumerOutcome.RETRY,
        ConsumerOutcome.RETRY,
        ConsumerOutcome.DEAD_LETTERED,
    ]
    assert [r.attempts for r in results] == [1, 2, 3]
    assert [r.delay for r in results[:2]] == [0.1, 0.2]
    assert dead == [("evt_1", results[2], "ValueError: cannot handle this one")]
    assert handled(clean_db) == []  # every attempt rolled back
    # Released: replayed from the dead-letter queue after a fix, it runs again.
    assert query(clean_db, "SELECT count(*) FROM idempotency_records") == [(0,)]


def test_another_message_under_a_used_id_or_no_id_is_dead_lettered_unrun(app: Flask) -> None:
    runs: list[Any] = []

    @idempotency.consumer("strict")
    def strict(d: Delivery) -> None:
        runs.append(d.payload)

    assert strict.handle(delivery(n=1), app=app).outcome is ConsumerOutcome.HANDLED
    reused = strict.handle(delivery(n=2), app=app)
    no_id = strict.handle(Delivery.from_body({"n": 3}), app=app)
    assert (reused.outcome, reused.reason) == (ConsumerOutcome.DEAD_LETTERED, "key_reused")
    assert (no_id.outcome, no_id.reason) == (ConsumerOutcome.DEAD_LETTERED, "missing_key")
    assert runs == [{"n": 1}]


def test_dead_letters_are_counted_for_prometheus_by_consumer_and_reason(app: Flask) -> None:
    from prometheus_client import CollectorRegistry

    from flask_idempotency.observability.prometheus import PrometheusMetrics

    registry = CollectorRegistry()
    PrometheusMetrics(app, registry=registry)

    @idempotency.consumer("counted")
    def counted(d: Delivery) -> None:
        pass

    def dead_letters(reason: str) -> float | None:
        return registry.get_sample_value(
            "flask_idempotency_events_dead_lettered_total",
            {"consumer": "counted", "reason": reason},
        )

    assert counted.handle(delivery(n=1), app=app).outcome is ConsumerOutcome.HANDLED
    assert dead_letters("key_reused") is None
    counted.handle(delivery(n=2), app=app)
    counted.handle(delivery(n=3), app=app)
    counted.handle(Delivery.from_body({"n": 4}), app=app)
    assert dead_letters("key_reused") == 2
    assert dead_letters("missing_key") == 1


def test_a_handler_emits_in_its_own_transaction(app: Flask, clean_db: str) -> None:
    @idempotency.consumer("chain", max_attempts=2)
    def chain(d: Delivery) -> None:
        idempotency.emit("thing.followed", {"after": d.id})
        if d.payload.get("fail"):
            raise RuntimeError("no")

    assert chain.handle(delivery("evt_ok"), app=app).outcome is ConsumerOutcome.HANDLED
    assert chain.handle(delivery("evt_bad", fail=True), app=app).outcome is ConsumerOutcome.RETRY
    rows = query(clean_db, "SELECT event_type, payload, record_key FROM idempotency_outbox")
    assert [(r[0], r[1]) for r in rows] == [("thing.followed", {"after": "evt_ok"})]
    assert bytes(rows[0][2]) == digests.record_key("consumer:chain", "evt_ok")


@pytest.fixture
def worker_thread() -> Iterator[Callable[[ConsumerWorker], None]]:
    stop = threading.Event()
    threads: list[threading.Thread] = []

    def start(worker: ConsumerWorker) -> None:
        thread = threading.Thread(target=worker.run, args=(stop,), daemon=True)
        thread.start()
        threads.append(thread)
        assert worker.connected.wait(10)

    yield start
    stop.set()
    for thread in threads:
        thread.join(10)


def test_a_poison_message_ends_in_the_dead_letter_queue_and_the_others_keep_flowing(
    app: Flask,
    clean_db: str,
    amqp_url: str,
    broker_names: BrokerNames,
    worker_thread: Callable[[ConsumerWorker], None],
) -> None:
    @idempotency.consumer("poison", max_attempts=3, retry_delay=0.05, busy_delay=0.05)
    def handler(d: Delivery) -> None:
        if d.payload["n"] == 7:
            raise KeyError("poison")
        record(d, "poison")

    exchange, queue = broker_names.exchange(), broker_names.queue("poison")
    worker = ConsumerWorker(
        app, amqp_url, [Subscription(handler, queue, ["thing.created"], exchange)], prefetch=5
    )
    started = time.monotonic()
    worker_thread(worker)
    ids = emit_many(app, 30)
    Relay(app.extensions["idempotency"].store, Publisher(amqp_url, exchange)).run(once=True)
    dead = take_all(amqp_url, queue + ".dlq", expect=1, timeout=10)
    wait_until(lambda: len(handled(clean_db)) >= 29, 10, "29 handled events")
    done = handled(clean_db)
    print(
        f"published=30 handled={len(done)} dead_lettered={len(dead)} "
        f"counts={dict(worker.counts)} in {time.monotonic() - started:.2f} s"
    )
    assert sorted(done) == sorted(ids[:7] + ids[8:])
    assert [m.properties["message_id"] for m in dead] == [ids[7]]
    headers = dead[0].headers
    assert headers["x-idempotency-dead-letter-reason"] == "handler_failed"
    assert headers["x-idempotency-attempts"] == 3
    assert headers["x-idempotency-error"] == "KeyError: 'poison'"
    assert json.loads(dead[0].body)["data"] == {"n": 7}
    assert worker.counts["retry"] == 2 and worker.counts["handled"] == 29


def test_after_a_broker_outage_the_worker_consumes_and_dead_letters_again_and_stops_at_once(
    app: Flask, amqp_url: str, broker_names: BrokerNames, tcp_proxy: ProxyFactory
) -> None:
    """Both of the worker's connections (consuming, dead letters) come back after a
    cut, and a stop during an outage ends it without waiting for the broker."""

    @idempotency.consumer("outage", max_attempts=1)
    def handler(d: Delivery) -> None:
        if d.payload["n"] == 1:
            raise KeyError("poison")

    parts = urlsplit(amqp_url)
    proxy = tcp_proxy(parts.hostname or "127.0.0.1", parts.port or 5672)
    exchange, queue = broker_names.exchange(), broker_names.queue("outage")
    subscription = Subscription(handler, queue, ["thing.created"], exchange)
    url = proxy.url_for(amqp_url)
    worker = ConsumerWorker(app, url, [subscription], timeout=2.0, backoff=Backoff(0.1, 0.3))
    stop = threading.Event()
    thread = threading.Thread(target=worker.run, args=(stop,), daemon=True)
    thread.start()
    try:
        for outage in range(2):
            assert worker.connected.wait(10)
            emit_many(app, 3)  # n = 0, 1, 2: the second is dead-lettered
            Relay(app.extensions["idempotency"].store, Publisher(amqp_url, exchange)).run(once=True)
            assert len(take_all(amqp_url, queue + ".dlq", expect=1, timeout=10)) == 1
            # The copy is in the dead-letter queue before the original is acked: cut only
            # once the worker is past it (the third message handled after its ack), or
            # the original comes back after the outage and is dead-lettered again.
            handled = 2 * (outage + 1)
            wait_until(
                lambda: worker.counts["handled"] == handled,  # noqa: B023 (called at once)
                10,
                "the worker to handle the message after the poison one",
            )
            proxy.cut()
            wait_until(lambda: not worker.connected.is_set(), 10, "the worker to see the cut")
            if outage == 0:
                proxy.restore()
        stopped = time.monotonic()
        stop.set()
        thread.join(5)
        assert not thread.is_alive()
        print(f"counts={dict(worker.counts)} stopped in {time.monotonic() - stopped:.2f} s")
        assert time.monotonic() - stopped < 2
        assert worker.counts["handled"] == 4 and worker.counts["dead_lettered"] == 2
        assert worker.counts["reconnects"] >= 2
    finally:
        stop.set()
        proxy.restore()
        thread.join(10)
