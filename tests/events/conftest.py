"""Fixtures of the events tests: the broker, names of their own on it, the app.

RabbitMQ comes from ``AMQP_URL``; ``.ci/run`` sets it when the machine's broker
answers. Unset, the tests that need a broker skip, except under CI (``CI`` set),
where a missing server is a failure. Each test declares exchanges and queues
under names of its own and deletes them at teardown; the shared broker is never
restarted (outages are staged with a proxy of the test's own).
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from typing import Any

import pytest
from flask import Flask

from . import app as events_app


class BrokerNames:
    """Unique exchange and queue names for one test; deleted at teardown."""

    def __init__(self) -> None:
        self.prefix = "t" + secrets.token_hex(4)
        self.exchanges: list[str] = []
        self.queues: list[str] = []

    def exchange(self, name: str = "events") -> str:
        full = f"{self.prefix}.{name}"
        self.exchanges.append(full)
        return full

    def queue(self, name: str) -> str:
        full = f"{self.prefix}.{name}"
        self.queues += [full, full + ".dlq"]
        return full

    def cleanup(self, url: str) -> None:
        import kombu

        with kombu.Connection(url, connect_timeout=5) as conn:
            channel = conn.channel()
            for queue in self.queues:
                try:
                    channel.queue_delete(queue)
                except Exception:
                    channel = conn.channel()
            for name in self.exchanges:
                try:
                    channel.exchange_delete(name)
                except Exception:
                    channel = conn.channel()


@pytest.fixture
def broker_names(amqp_url: str) -> Iterator[BrokerNames]:
    names = BrokerNames()
    yield names
    names.cleanup(amqp_url)


@pytest.fixture
def make_events_app(clean_db: str) -> Iterator[Any]:
    """Factory: ``make_events_app(**config)`` -> the events test app on a clean database."""
    apps: list[Flask] = []

    def make(**config: Any) -> Flask:
        app = events_app.create_app(clean_db, config)
        apps.append(app)
        return app

    yield make
    for app in apps:
        app.extensions["idempotency"].close()


def bind_queue(url: str, exchange: str, queue: str, routing_keys: list[str]) -> None:
    """Declare ``queue`` bound to ``exchange`` (as a consumer would, before the relay runs)."""
    import kombu

    ex = kombu.Exchange(exchange, type="topic", durable=True)
    with kombu.Connection(url, connect_timeout=5) as conn:
        channel = conn.channel()
        ex(channel).declare()
        bindings = [kombu.binding(ex, routing_key=key) for key in routing_keys]
        kombu.Queue(queue, bindings=bindings, durable=True)(channel).declare()


def take_all(url: str, queue: str, *, expect: int = 0, timeout: float = 5.0) -> list[Any]:
    """Every message now in ``queue`` (acknowledged), waiting up to ``timeout`` for ``expect``."""
    import time

    import kombu

    taken: list[Any] = []
    deadline = time.monotonic() + timeout
    with kombu.Connection(url, connect_timeout=5) as conn:
        channel = conn.channel()
        while True:
            message = channel.basic_get(queue, no_ack=True)
            if message is not None:
                taken.append(message)
                continue
            if len(taken) >= expect or time.monotonic() > deadline:
                return taken
            time.sleep(0.05)


def emit_many(app: Flask, count: int, event_type: str = "thing.created") -> list[str]:
    """``count`` events from ``transaction()`` blocks, ten per transaction."""
    ids: list[str] = []
    with app.app_context():
        for start in range(0, count, 10):
            with events_app.idempotency.transaction():
                for n in range(start, min(count, start + 10)):
                    ids.append(events_app.idempotency.emit(event_type, {"n": n}))
    return ids
