"""The store's circuit breaker against a real PostgreSQL behind a proxy that stalls.

A stalled proxy keeps every socket open and forwards nothing, as a frozen
server would: each statement waits out the extension's deadline. Requests that
queue behind the stuck ones (for a pool connection, then a connect) must not
wait several deadlines: they answer ``503 store_unavailable`` once the breaker
opens, new requests at once, and the first request after the cooldown probes
and closes it when the server answers again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from flask import Flask

from flask_idempotency.circuit import BreakerState
from support.servers import ProxyFactory

MakeApp = Callable[..., Flask]

STATEMENT_TIMEOUT = 1.0
#: The extension's deadline: statement_timeout + 1 s of grace (not under libpq's 2 s
#: shortest connect timeout, which a connect started at once may take).
DEADLINE = STATEMENT_TIMEOUT + 1.0
SLACK = 0.5


def post(app: Flask, key: str, body: dict[str, Any] | None = None) -> tuple[int, str, float]:
    started = time.monotonic()
    response = app.test_client().post("/charges", json=body or {}, headers={"Idempotency-Key": key})
    code = (response.get_json(silent=True) or {}).get("error", {}).get("code", "")
    return response.status_code, code, time.monotonic() - started


def concurrently(app: Flask, keys: list[str]) -> list[tuple[int, str, float]]:
    results: list[tuple[int, str, float]] = [(0, "", 0.0)] * len(keys)

    def run(n: int) -> None:
        results[n] = post(app, keys[n])

    threads = [threading.Thread(target=run, args=(n,)) for n in range(len(keys))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return results


def test_requests_queued_behind_a_silent_server_answer_within_one_deadline(
    make_app: MakeApp,
    clean_db: str,
    tcp_proxy: ProxyFactory,
    caplog: pytest.LogCaptureFixture,
) -> None:
    proxy = tcp_proxy(clean_db)
    app = make_app(
        IDEMPOTENCY_DATABASE_URL=proxy.url_for(clean_db),
        IDEMPOTENCY_DATABASE_OPTIONS={
            "statement_timeout": STATEMENT_TIMEOUT,
            "connect_timeout": 3,
            "pool_size": 3,
            "pool_timeout": 10,
        },
    )
    caplog.set_level(logging.INFO, logger="flask_idempotency")
    assert post(app, "warm-up")[0] == 201
    # All three of the pool's connections open before the stall, so that the three
    # claims hold them. (A connect that fails during the stall frees its slot without
    # waking a request queued on SQLAlchemy's pool: that one waits out pool_timeout.)
    engine = app.extensions["idempotency"].store.pool.engine
    opened = [engine.connect() for _ in range(3)]
    for connection in opened:
        connection.close()
    proxy.stall()
    # Three claims hold the pool's connections; five more wait for one.
    results = concurrently(app, [f"queued-{n}" for n in range(8)])
    assert {(status, code) for status, code, _ in results} == {(503, "store_unavailable")}
    slowest = max(seconds for _, _, seconds in results)
    assert slowest <= DEADLINE + SLACK, f"a request took {slowest:.2f} s behind the others"

    # Open: a new request does not even try, and is no WARNING of its own (the
    # breaker's opening was): a frozen server under load must not flood the log.
    before = [(r.name, r.getMessage()) for r in caplog.records]
    assert any(
        name == "flask_idempotency.store" and "store circuit breaker open" in message
        for name, message in before
    ), before
    caplog.clear()
    status, code, seconds = post(app, "while-open")
    assert (status, code) == (503, "store_unavailable")
    assert seconds < 0.3
    refusals = [r for r in caplog.records if r.name == "flask_idempotency.requests"]
    assert [(r.levelno, r.outcome) for r in refusals] == [  # type: ignore[attr-defined]
        (logging.INFO, "store_unavailable")
    ]

    proxy.resume()
    time.sleep(1.0)  # the default cooldown
    assert post(app, "the-probe")[0] == 201
    store = app.extensions["idempotency"].store
    assert store.breaker.state is BreakerState.CLOSED
    messages = [message for _, message in before] + [r.getMessage() for r in caplog.records]
    assert any("store circuit breaker closed" in m for m in messages)
    for key in ("queued-", "while-open", "the-probe"):
        assert not any(key in m for m in messages), f"a log line names the key {key}"


def test_answers_of_a_live_server_never_open_it(make_app: MakeApp) -> None:
    app = make_app(IDEMPOTENCY_DATABASE_OPTIONS={"breaker_threshold": 1})
    store = app.extensions["idempotency"].store
    assert post(app, "k", {"amount": 1})[0] == 201
    assert post(app, "k", {"amount": 1})[0] == 201  # a replay
    assert post(app, "k", {"amount": 2})[:2] == (422, "key_reused")
    assert store.breaker.state is BreakerState.CLOSED
