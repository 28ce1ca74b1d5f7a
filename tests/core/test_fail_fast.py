"""Fail fast, not late: a PostgreSQL that stops answering is a prompt 503.

A partition, a failover that moved the database's address or a stuck lock
closes no socket: without bounds, claims, completions and renewals would wait
for minutes. The extension's own statements carry ``SET LOCAL statement_timeout``
and ``lock_timeout`` (server side), its connections TCP keepalives and
``tcp_user_timeout``, and a client-side deadline shuts a connection down when
nothing at all comes back (a stalled proxy still ACKs, so only the client can
tell). Each case answers ``503 store_unavailable`` with ``Retry-After`` within
seconds, keeps nothing, and recovers by itself once the database answers.

``TcpProxy.stall()`` stages the silent outage: it keeps every socket open and
forwards nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg2
import pytest
from flask import Flask, Response, jsonify

from flask_idempotency import Idempotency
from support import core_app
from support.records import end_leases, wait_for_renewal
from support.servers import ProxyFactory, TcpProxy
from support.waiting import wait_until

MakeApp = Callable[..., Flask]

#: What the tests configure: a short statement timeout, so a stalled statement is
#: given up after 1 s + 1 s of grace; libpq's shortest connect timeout (2 s).
FAST_OPTIONS = {"statement_timeout": 1, "lock_timeout": 0.5, "connect_timeout": 2}
FAST = {"IDEMPOTENCY_DATABASE_OPTIONS": FAST_OPTIONS}
#: The upper bound the tests hold a 503 to (the deadline is 2 s).
PROMPT = 10.0


@pytest.fixture
def apps() -> Iterator[list[Flask]]:
    made: list[Flask] = []
    yield made
    for app in made:
        app.extensions["idempotency"].close()


def sql(database_url: str, query: str, params: Any = None) -> list[tuple[Any, ...]]:
    conn = psycopg2.connect(database_url)
    try:
        with conn, conn.cursor() as cur:
            cur.execute(query, params)
            return cur.fetchall() if cur.description else []
    finally:
        conn.close()


def add_gated_route(app: Flask) -> tuple[threading.Event, threading.Event, list[str]]:
    """``POST /gated``: writes a business row in the request's transaction, then
    waits for the gate before answering 201 (so a test can stall the database
    between the view's last statement and the completion)."""
    idem: Idempotency = app.extensions["idem"]
    entered, gate = threading.Event(), threading.Event()
    runs: list[str] = []

    @app.post("/gated")
    @idem.required
    def gated() -> tuple[Response, int]:
        runs.append("gated")
        with idem.connection().cursor() as cur:
            cur.execute("INSERT INTO core_business_rows (label) VALUES ('gated') RETURNING id")
            row = cur.fetchone()
        entered.set()
        gate.wait(30)
        return jsonify({"row": row[0] if row else None}), 201

    return entered, gate, runs


def timed(call: Callable[[], Any]) -> tuple[Any, float]:
    started = time.monotonic()
    result = call()
    return result, time.monotonic() - started


def assert_store_unavailable(response: Any) -> None:
    assert response.status_code == 503, response.data
    assert response.get_json()["error"]["code"] == "store_unavailable"
    assert response.headers["Retry-After"].isdigit()


def proxied_app(
    clean_db: str, tcp_proxy: ProxyFactory, apps: list[Flask], **config: Any
) -> tuple[Flask, TcpProxy]:
    proxy = tcp_proxy(clean_db)
    app = core_app.create_app(proxy.url_for(clean_db), {**FAST, **config})
    apps.append(app)
    return app, proxy


def test_claim_during_a_stall_answers_503_within_seconds_and_recovers(
    clean_db: str, tcp_proxy: ProxyFactory, apps: list[Flask]
) -> None:
    app, proxy = proxied_app(clean_db, tcp_proxy, apps)
    client = app.test_client()
    assert (
        client.post("/plain", data=b"x", headers={"Idempotency-Key": "before"}).status_code == 200
    )

    proxy.stall()
    during, elapsed = timed(
        lambda: client.post("/plain", data=b"x", headers={"Idempotency-Key": "during"})
    )
    print(f"claim during a stall: 503 after {elapsed:.2f} s")
    assert_store_unavailable(during)
    assert elapsed < PROMPT
    assert app.extensions["runs"] == ["plain"]  # the view never ran without a claim

    # As after a failover: the old connections are gone, the held claim never arrives.
    proxy.resume(reset=True)
    after = client.post("/plain", data=b"x", headers={"Idempotency-Key": "after"})
    assert after.status_code == 200  # the silent connections were replaced, no restart
    again = client.post("/plain", data=b"x", headers={"Idempotency-Key": "during"})
    assert again.status_code == 200  # nothing of the failed claim lingers
    replay = client.post("/plain", data=b"x", headers={"Idempotency-Key": "before"})
    assert replay.headers["Idempotent-Replayed"] == "true"


@pytest.mark.parametrize("reset", [True, False], ids=["connections-reset", "bytes-delivered"])
def test_completion_during_a_stall_answers_503_and_the_retry_runs_once(
    clean_db: str, tcp_proxy: ProxyFactory, apps: list[Flask], reset: bool
) -> None:
    app, proxy = proxied_app(
        clean_db, tcp_proxy, apps, IDEMPOTENCY_LEASE=1.5, IDEMPOTENCY_LEASE_RENEW_INTERVAL=0.5
    )
    entered, gate, runs = add_gated_route(app)
    client = app.test_client()
    answers: list[Any] = []
    started: list[float] = []

    def first() -> None:
        answers.append(client.post("/gated", headers={"Idempotency-Key": "k"}))

    thread = threading.Thread(target=first)
    thread.start()
    assert entered.wait(10)
    proxy.stall()  # the view wrote its row; now nothing reaches the database
    started.append(time.monotonic())
    gate.set()
    thread.join(30)
    elapsed = time.monotonic() - started[0]
    print(f"completion during a stall: 503 after {elapsed:.2f} s")
    assert not thread.is_alive()
    assert_store_unavailable(answers[0])
    assert elapsed < PROMPT

    # Reset: the held COMMIT never arrives, the transaction dies with its connection
    # and the claim is left to its lease. Delivered: the COMMIT arrives late and the
    # answer is stored, as when only the reply was lost. Either way the row exists
    # once and only with its stored answer.
    proxy.resume(reset=reset)
    deadline = time.monotonic() + 15
    while True:
        retry = client.post("/gated", headers={"Idempotency-Key": "k"})
        if retry.status_code == 201:
            break
        assert retry.status_code in (409, 503), retry.data
        assert time.monotonic() < deadline, "the key never became usable again"
        time.sleep(0.2)
    rows = sql(clean_db, "SELECT id FROM core_business_rows WHERE label = 'gated'")
    assert rows == [(retry.get_json()["row"],)]
    assert len(runs) <= 2  # the first attempt, and the retry only if that one left nothing
    if retry.headers["Idempotent-Replayed"] == "false":
        assert len(runs) == 2
    assert sql(clean_db, "SELECT state FROM idempotency_records") == [("completed",)]


def renewal_failures(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if "lease renewal failed" in r.getMessage()]


def test_a_renewal_during_a_stall_does_not_hang_the_keeper(
    clean_db: str, tcp_proxy: ProxyFactory, apps: list[Flask], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="flask_idempotency")
    app, proxy = proxied_app(
        clean_db, tcp_proxy, apps, IDEMPOTENCY_LEASE=8, IDEMPOTENCY_LEASE_RENEW_INTERVAL=0.3
    )
    client = app.test_client()
    answers: list[Any] = []
    thread = threading.Thread(
        target=lambda: answers.append(
            client.post("/charges", json={"gate": "g"}, headers={"Idempotency-Key": "slow"})
        )
    )
    thread.start()
    gates = app.extensions["gates"]
    try:
        assert gates.entered_event("g").wait(10)
        wait_for_renewal(clean_db)  # the keeper's connection is open and in use
        caplog.clear()
        proxy.stall()
        # Each round the keeper thread gives up and logs: the first after the
        # deadline (2 s), the next on the connect timeout (2 s). A thread stuck in
        # its first renewal would log nothing.
        started = time.monotonic()
        wait_until(
            lambda: len(renewal_failures(caplog)) >= 2,
            PROMPT,
            "two renewal rounds given up (a keeper hung on a silent database gives up none)",
        )
        elapsed = time.monotonic() - started
        rounds = len(renewal_failures(caplog))
        print(f"renewal rounds given up during {elapsed:.2f} s of stall: {rounds}")
        proxy.resume()
        wait_for_renewal(clean_db, timeout=PROMPT)  # renewing again, on a new connection
    finally:
        gates.get("g").set()
        thread.join(15)
    assert answers[0].status_code == 201


class Locker:
    """A session holding every record's row lock in an open transaction; rolled back
    after ``release_after`` s at the latest, so code that waits forever still ends."""

    def __init__(self, database_url: str, release_after: float = 8.0) -> None:
        self.conn = psycopg2.connect(database_url)
        with self.conn.cursor() as cur:
            cur.execute("SELECT record_key FROM idempotency_records FOR UPDATE")
        self.timer = threading.Timer(release_after, self.conn.rollback)
        self.timer.start()

    def release(self) -> None:
        self.timer.cancel()
        self.conn.rollback()
        self.conn.close()


@pytest.mark.parametrize(
    "timeouts",
    [
        {"lock_timeout": 0.5},
        {"lock_timeout": 0, "statement_timeout": 0.5},
    ],
    ids=["lock-timeout", "statement-timeout"],
)
def test_a_claim_waiting_on_a_locked_row_answers_503(
    make_app: MakeApp, clean_db: str, timeouts: dict[str, float]
) -> None:
    app = make_app(IDEMPOTENCY_DATABASE_OPTIONS={**FAST_OPTIONS, **timeouts})
    client = app.test_client()
    assert client.post("/plain", data=b"x", headers={"Idempotency-Key": "k"}).status_code == 200
    # Expired: the next claim takes the row over, and so needs its lock.
    sql(clean_db, "UPDATE idempotency_records SET expires_at = now() - interval '1 second'")
    locker = Locker(clean_db)
    try:
        blocked, elapsed = timed(
            lambda: client.post("/plain", data=b"x", headers={"Idempotency-Key": "k"})
        )
    finally:
        locker.release()
    print(f"claim on a locked row: {blocked.status_code} after {elapsed:.2f} s")
    assert_store_unavailable(blocked)
    assert elapsed < 3
    assert app.extensions["runs"] == ["plain"]
    # The connection was sound: the same pool serves the next claim at once.
    assert client.post("/plain", data=b"x", headers={"Idempotency-Key": "k"}).status_code == 200


def test_a_completion_waiting_on_a_locked_row_answers_503(make_app: MakeApp, clean_db: str) -> None:
    app = make_app(**FAST, IDEMPOTENCY_LEASE=1, IDEMPOTENCY_LEASE_RENEW_INTERVAL=0)
    entered, gate, runs = add_gated_route(app)
    client = app.test_client()
    answers: list[Any] = []
    thread = threading.Thread(
        target=lambda: answers.append(client.post("/gated", headers={"Idempotency-Key": "k"}))
    )
    thread.start()
    assert entered.wait(10)
    locker = Locker(clean_db)
    try:
        started = time.monotonic()
        gate.set()
        thread.join(15)
        elapsed = time.monotonic() - started
    finally:
        locker.release()
    print(f"completion on a locked row: {answers[0].status_code} after {elapsed:.2f} s")
    assert_store_unavailable(answers[0])
    assert elapsed < 4  # the completion's lock wait, then the release's
    assert sql(clean_db, "SELECT count(*) FROM core_business_rows") == [(0,)]
    end_leases(clean_db)  # the claim the release could not delete, as once its lease ran out
    retry = client.post("/gated", headers={"Idempotency-Key": "k"})
    assert retry.status_code == 201
    assert sql(clean_db, "SELECT count(*) FROM core_business_rows") == [(1,)]
    assert runs == ["gated", "gated"]


def test_the_views_statements_keep_the_sessions_timeouts(make_app: MakeApp) -> None:
    app = make_app(**FAST)
    idem: Idempotency = app.extensions["idem"]

    @app.post("/settings")
    @idem.required
    def settings() -> Response:
        with idem.connection().cursor() as cur:
            cur.execute(
                "SELECT current_setting('statement_timeout'), current_setting('lock_timeout')"
            )
            row = cur.fetchone()
        return jsonify(
            {"statement_timeout": row[0] if row else None, "lock": row[1] if row else None}
        )

    answer = app.test_client().post("/settings", headers={"Idempotency-Key": "s"})
    assert answer.status_code == 200
    assert answer.get_json() == {"statement_timeout": "0", "lock": "0"}


def test_connections_carry_keepalives_unless_overridden(clean_db: str) -> None:
    from flask_idempotency.settings import Settings
    from flask_idempotency.store.pool import EnginePool, build_engine

    def pool_of(**kwargs: object) -> EnginePool:
        settings = Settings(
            database_url=clean_db, pool_size=1, pool_timeout=1, connect_kwargs=kwargs
        )
        engine = build_engine(settings)
        return EnginePool(engine, owned=True)

    pool = pool_of()
    conn = pool.getconn()
    params = conn.info.dsn_parameters
    assert params["keepalives"] == "1"
    assert params["tcp_user_timeout"] == "10000"
    pool.putconn(conn)
    pool.close()

    pool = pool_of(keepalives_idle=30)
    conn = pool.getconn()
    assert conn.info.dsn_parameters["keepalives_idle"] == "30"
    pool.putconn(conn)
    pool.close()


def test_the_watchdog_wakes_a_statement_blocked_on_a_silent_server(
    clean_db: str, tcp_proxy: ProxyFactory
) -> None:
    from flask_idempotency.store.errors import is_unreachable
    from flask_idempotency.store.watchdog import WATCHDOG

    proxy = tcp_proxy(clean_db)
    conn = psycopg2.connect(proxy.url_for(clean_db))
    try:
        proxy.stall()
        ticket = WATCHDOG.watch(conn, 0.5)
        started = time.monotonic()
        with pytest.raises(psycopg2.OperationalError) as raised:
            with conn.cursor() as cur:
                cur.execute("SELECT 1")
        elapsed = time.monotonic() - started
        assert WATCHDOG.unwatch(ticket)
        assert 0.4 < elapsed < 2
        assert is_unreachable(raised.value, conn)
        # A statement that ends in time is left alone.
        proxy.resume()
        other = psycopg2.connect(proxy.url_for(clean_db))
        ticket = WATCHDOG.watch(other, 0.5)
        with other.cursor() as cur:
            cur.execute("SELECT 1")
        assert not WATCHDOG.unwatch(ticket)
        time.sleep(0.7)
        with other.cursor() as cur:
            cur.execute("SELECT 2")
        other.close()
    finally:
        conn.close()


def test_the_stalled_proxy_holds_bytes_and_new_connections(
    clean_db: str, tcp_proxy: ProxyFactory
) -> None:
    proxy = tcp_proxy(clean_db)
    url = proxy.url_for(clean_db)
    conn = psycopg2.connect(url)
    proxy.stall()
    assert proxy.is_stalled
    results: list[Any] = []

    def query() -> None:
        with conn.cursor() as cur:
            cur.execute("SELECT 42")
            results.append(cur.fetchone())

    thread = threading.Thread(target=query, daemon=True)
    thread.start()
    thread.join(1.0)
    assert thread.is_alive()  # nothing came back, nothing was closed
    started = time.monotonic()
    with pytest.raises(psycopg2.OperationalError):
        psycopg2.connect(url, connect_timeout=2)  # accepted, never answered
    assert time.monotonic() - started >= 1.5
    proxy.resume()
    thread.join(5)
    assert results == [(42,)]  # the held query went through once resumed
    conn.close()


def test_the_timeouts_are_validated_at_start_up() -> None:
    from datetime import timedelta

    from flask_idempotency.settings import settings_from_config

    base = {"DATABASE_URL": "postgresql://localhost/x"}
    defaults = settings_from_config(base)
    assert (defaults.statement_timeout, defaults.lock_timeout) == (5.0, 2.0)
    settings = settings_from_config(
        {
            **base,
            "DATABASE_OPTIONS": {
                "statement_timeout": timedelta(milliseconds=1500),
                "lock_timeout": "0",
            },
        }
    )
    assert (settings.statement_timeout, settings.lock_timeout) == (1.5, 0.0)
    for bad in ({"statement_timeout": 0}, {"statement_timeout": "soon"}, {"lock_timeout": -1}):
        with pytest.raises(ValueError, match="(?i)timeout"):
            settings_from_config({**base, "DATABASE_OPTIONS": bad})
