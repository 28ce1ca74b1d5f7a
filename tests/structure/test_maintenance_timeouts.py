"""The completer's and the consumer's statements run under the store's timeouts.

A PostgreSQL that stops answering (every packet swallowed: a partition, a hung
server) must fail each maintenance statement at the store's deadline
(statement timeout + one second), as on the request path; before, the
completer and the consumer ran their own SQL without it and hung.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from flask import Flask

from flask_idempotency import Idempotency
from flask_idempotency.completer import Recoverer
from flask_idempotency.events import ConsumerOutcome, Delivery
from flask_idempotency.store.base import StoreUnavailableError
from support.tcp_proxy import TcpProxy

ProxyFactory = Callable[..., TcpProxy]

STATEMENT_TIMEOUT = 0.5
#: The store's client-side deadline is the statement timeout plus one second;
#: what a caller may wait in all, with room for a loaded machine.
WITHIN = STATEMENT_TIMEOUT + 1.0 + 2.0


@pytest.fixture
def stalled_app(clean_db: str, tcp_proxy: ProxyFactory) -> Iterator[tuple[Flask, TcpProxy]]:
    proxy = tcp_proxy(clean_db)
    app = Flask(__name__)
    app.config.update(
        IDEMPOTENCY_DATABASE_URL=proxy.url_for(clean_db),
        IDEMPOTENCY_AUTO_MIGRATE=True,
        IDEMPOTENCY_DATABASE_OPTIONS={
            "statement_timeout": STATEMENT_TIMEOUT,
            "connect_timeout": 1,
            "pool_size": 2,
        },
    )
    idempotency = Idempotency(app)
    with app.app_context():
        idempotency.ping()  # a pooled connection, open before the server goes quiet
    yield app, proxy
    proxy.resume(reset=True)
    app.extensions["idempotency"].close()


def timed(call: Callable[[], Any]) -> tuple[float, BaseException | Any]:
    started = time.monotonic()
    try:
        result: Any = call()
    except StoreUnavailableError as exc:
        result = exc
    return time.monotonic() - started, result


def test_each_maintenance_statement_fails_at_the_deadline(
    stalled_app: tuple[Flask, TcpProxy],
) -> None:
    app, proxy = stalled_app
    store = app.extensions["idempotency"].store
    key, token = b"k" * 32, 1
    calls: dict[str, Callable[[], Any]] = {
        "recovery_cutoff": lambda: store.recovery_cutoff(60.0),
        "take_over": lambda: store.take_over(None, 5, 30.0),
        "hand_back": lambda: store.hand_back(key, token),
        "release_abandoned": lambda: store.release_abandoned(key, token, keep_phases=False),
        "recovery_stats": store.recovery_stats,
        "attempts_so_far": lambda: store.attempts_so_far(key, token),
        "fail_attempt": lambda: store.fail_attempt(key, token),
        "release_claim": lambda: store.release_claim(key, token),
        "stats": store.stats,
    }
    proxy.stall()
    for name, call in calls.items():
        seconds, result = timed(call)
        print(f"{name}: {seconds:.2f} s -> {type(result).__name__}")
        assert isinstance(result, StoreUnavailableError), name
        assert seconds < WITHIN, name


def test_a_recovery_pass_and_a_consumer_fail_within_the_deadline(
    stalled_app: tuple[Flask, TcpProxy],
) -> None:
    app, proxy = stalled_app
    idempotency = Idempotency()  # an unbound instance: the state is the app's

    @idempotency.consumer("receipts")
    def handle(delivery: Delivery) -> None:
        raise AssertionError("must not run without a claim")

    proxy.stall()
    seconds, result = timed(lambda: Recoverer(app).run_pass())
    print(f"recover pass: {seconds:.2f} s -> {type(result).__name__}")
    assert isinstance(result, StoreUnavailableError)
    assert seconds < WITHIN

    delivery = Delivery.from_body({"id": "evt_1", "type": "t", "data": {}})
    seconds, outcome = timed(lambda: handle.handle(delivery, app=app))
    print(f"consumer: {seconds:.2f} s -> {outcome}")
    assert not isinstance(outcome, BaseException)
    assert outcome.outcome is ConsumerOutcome.RETRY
    assert seconds < WITHIN
