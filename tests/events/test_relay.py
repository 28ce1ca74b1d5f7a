"""The relay against the machine's RabbitMQ: confirms, ids, crashes, several relays, outages.

Every test declares an exchange and queues of its own (``broker_names``); an
outage is a proxy of the test's own in front of the broker, never the broker.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flask import Flask

from flask_idempotency.events import Relay
from flask_idempotency.events.amqp import Publisher
from flask_idempotency.events.relay import Backoff
from support.pg_query import query
from support.servers import ProxyFactory
from support.waiting import wait_until

from .conftest import BrokerNames, bind_queue, emit_many, take_all

MakeApp = Callable[..., Flask]
REPO_ROOT = Path(__file__).resolve().parents[2]


def message_ids(messages: list[Any]) -> list[str]:
    return [m.properties["message_id"] for m in messages]


def pending(url: str) -> int:
    return int(
        query(url, "SELECT count(*) FROM idempotency_outbox WHERE published_at IS NULL")[0][0]
    )


def unlocked(url: str) -> int:
    """Pending events no transaction holds locked (what a relay can take now)."""
    statement = (
        "SELECT count(*) FROM (SELECT 1 FROM idempotency_outbox WHERE published_at IS NULL"
        " FOR UPDATE SKIP LOCKED) AS free"
    )
    return int(query(url, statement)[0][0])


def test_relay_once_publishes_each_pending_event_with_its_id(
    make_events_app: MakeApp, clean_db: str, amqp_url: str, broker_names: BrokerNames
) -> None:
    app = make_events_app()
    exchange, queue = broker_names.exchange(), broker_names.queue("all")
    bind_queue(amqp_url, exchange, queue, ["thing.*"])
    client = app.test_client()
    answer = client.post(
        "/things", json={"label": "a", "events": 2}, headers={"Idempotency-Key": "r1"}
    )
    ids = answer.get_json()["events"] + emit_many(app, 3)
    args = ["idempotency", "relay", "--once", "--broker-url", amqp_url, "--exchange", exchange]
    result = app.test_cli_runner().invoke(args=args)
    assert result.exit_code == 0, result.output
    assert "5 event(s) published" in result.output
    messages = take_all(amqp_url, queue, expect=5)
    print(f"emitted={len(ids)} published={len(messages)} pending={pending(clean_db)}")
    assert message_ids(messages) == ids
    first = messages[0]
    envelope = json.loads(first.body)
    row = query(
        clean_db, "SELECT derived_key, attempts FROM idempotency_outbox WHERE id = %s", (ids[0],)
    )
    assert envelope["id"] == ids[0] and envelope["type"] == "thing.created"
    assert envelope["data"] == {"label": "a", "n": 0}
    assert envelope["derived_key"] == row[0][0]
    assert first.properties["type"] == "thing.created"
    assert first.properties["delivery_mode"] == 2
    assert pending(clean_db) == 0
    assert {r[0] for r in query(clean_db, "SELECT attempts FROM idempotency_outbox")} == {1}
    # Nothing pending: a second run publishes nothing.
    again = app.test_cli_runner().invoke(args=args)
    assert "0 event(s) published" in again.output
    assert take_all(amqp_url, queue, timeout=0.2) == []


def test_an_unroutable_event_is_deferred_and_holds_up_no_other(
    make_events_app: MakeApp, clean_db: str, amqp_url: str, broker_names: BrokerNames
) -> None:
    app = make_events_app()
    exchange, queue = broker_names.exchange(), broker_names.queue("things")
    bind_queue(amqp_url, exchange, queue, ["thing.created"])
    lonely = emit_many(app, 1, "nobody.listens")
    routed = emit_many(app, 3)
    relay = Relay(app.extensions["idempotency"].store, Publisher(amqp_url, exchange))
    stats = relay.run(once=True)
    print(f"published={stats.published} deferred={stats.deferred}")
    assert (stats.published, stats.deferred) == (3, 1)
    assert message_ids(take_all(amqp_url, queue, expect=3)) == routed
    row = query(
        clean_db,
        "SELECT published_at, attempts, available_at > now() FROM idempotency_outbox WHERE id = %s",
        (lonely[0],),
    )
    assert row == [(None, 1, True)]
    # Once a queue is bound and the deferral is over, it goes out.
    bind_queue(amqp_url, exchange, broker_names.queue("late"), ["nobody.#"])
    query(clean_db, "UPDATE idempotency_outbox SET available_at = now()")
    assert (
        Relay(app.extensions["idempotency"].store, Publisher(amqp_url, exchange))
        .run(once=True)
        .published
        == 1
    )
    assert pending(clean_db) == 0


CRASHING_RELAY = """
import os, signal, sys
sys.path[:0] = [{root!r}, {tests!r}]
from events import app as events_app
from flask_idempotency.events import Relay
from flask_idempotency.events.amqp import Publisher

class CrashAfter(Publisher):
    published = 0
    def publish(self, event):
        confirmed = super().publish(event)
        CrashAfter.published += 1
        if CrashAfter.published == {crash_after}:
            os.kill(os.getpid(), signal.SIGKILL)  # confirmed by the broker, never marked
        return confirmed

app = events_app.create_app({db!r})
Relay(app.extensions["idempotency"].store, CrashAfter({url!r}, {exchange!r})).run(once=True)
"""


def test_a_relay_killed_between_publish_and_mark_publishes_again_under_the_same_ids(
    make_events_app: MakeApp, clean_db: str, amqp_url: str, broker_names: BrokerNames
) -> None:
    app = make_events_app()
    exchange, queue = broker_names.exchange(), broker_names.queue("crash")
    bind_queue(amqp_url, exchange, queue, ["#"])
    ids = emit_many(app, 6)
    script = CRASHING_RELAY.format(
        root=str(REPO_ROOT),
        tests=str(REPO_ROOT / "tests"),
        crash_after=3,
        db=clean_db,
        url=amqp_url,
        exchange=exchange,
    )
    crashed = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr.decode()
    assert pending(clean_db) == 6  # its transaction died with it: nothing marked
    # Its PostgreSQL backend ends its transaction only once it reads the closed
    # socket: until then the rows stay locked, and a relay skips locked rows.
    wait_until(lambda: unlocked(clean_db) == 6, 10, "the killed relay's locks to go")
    stats = Relay(app.extensions["idempotency"].store, Publisher(amqp_url, exchange)).run(once=True)
    received = Counter(message_ids(take_all(amqp_url, queue, expect=9)))
    print(
        f"emitted=6 published_before_crash=3 republished={stats.published} "
        f"messages={sum(received.values())} duplicates={sum(received.values()) - len(received)}"
    )
    assert set(received) == set(ids)
    assert [received[i] for i in ids] == [2, 2, 2, 1, 1, 1]
    assert pending(clean_db) == 0


def test_relays_side_by_side_publish_every_event_once(
    make_events_app: MakeApp, clean_db: str, amqp_url: str, broker_names: BrokerNames
) -> None:
    app = make_events_app()
    exchange, queue = broker_names.exchange(), broker_names.queue("many")
    bind_queue(amqp_url, exchange, queue, ["#"])
    ids = emit_many(app, 200)
    store = app.extensions["idempotency"].store
    relays = [Relay(store, Publisher(amqp_url, exchange), batch_size=10) for _ in range(3)]
    started = time.monotonic()
    threads = [threading.Thread(target=r.run, kwargs={"once": True}) for r in relays]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    received = message_ids(take_all(amqp_url, queue, expect=200))
    shares = [r.stats.published for r in relays]
    print(
        f"relays=3 emitted=200 published_by_each={shares} messages={len(received)} "
        f"in {time.monotonic() - started:.2f} s"
    )
    assert sorted(received) == sorted(ids)  # each exactly once: SKIP LOCKED, no overlap
    assert sum(shares) == 200
    assert pending(clean_db) == 0


def test_a_broker_cut_mid_stream_loses_nothing_and_the_relay_recovers(
    make_events_app: MakeApp,
    clean_db: str,
    amqp_url: str,
    broker_names: BrokerNames,
    tcp_proxy: ProxyFactory,
) -> None:
    from urllib.parse import urlsplit

    app = make_events_app()
    exchange, queue = broker_names.exchange(), broker_names.queue("cut")
    bind_queue(amqp_url, exchange, queue, ["#"])
    parts = urlsplit(amqp_url)
    proxy = tcp_proxy(parts.hostname or "127.0.0.1", parts.port or 5672)
    relay = Relay(
        app.extensions["idempotency"].store,
        Publisher(proxy.url_for(amqp_url), exchange, timeout=2.0),
        poll_interval=0.05,
        backoff=Backoff(0.1, 0.5),
    )
    stop = threading.Event()
    thread = threading.Thread(target=relay.run, args=(stop,))
    thread.start()
    try:
        ids = emit_many(app, 20)
        wait_until(lambda: relay.stats.published > 0, 15, "the relay to be publishing")
        proxy.cut()
        ids += emit_many(app, 30)  # emitted while the broker is away
        wait_until(lambda: relay.stats.outages > 0, 15, "the relay to meet the outage")
        assert pending(clean_db) > 0
        proxy.restore()
        wait_until(lambda: not pending(clean_db), 15, "the relay to publish the backlog")
    finally:
        stop.set()
        thread.join(10)
    received = Counter(message_ids(take_all(amqp_url, queue, expect=50)))
    print(
        f"emitted={len(ids)} published={relay.stats.published} outages={relay.stats.outages} "
        f"distinct_received={len(received)} duplicates={sum(received.values()) - len(received)}"
    )
    assert set(received) == set(ids)
    assert relay.stats.outages >= 1
    assert pending(clean_db) == 0
    assert os.getpid()  # the relay recovered in this process, without a restart
