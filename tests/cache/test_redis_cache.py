"""The Redis fast path: replays without PostgreSQL, and no outcome ever depends on Redis.

Against the run's real PostgreSQL and Redis. PostgreSQL statements are counted
by a psycopg2 connection subclass handed to the pool (IDEMPOTENCY_DATABASE_OPTIONS),
Redis commands by wrapping the cache client's ``execute_command`` (the public
method every redis-py command goes through), and connect
attempts by wrapping redis-py's ``Connection._connect``. Outages are a cut
``TcpProxy`` (the shared Redis keeps running) or a ``ThrowawayRedis`` of the
test's own that is killed; the breaker's clock is moved, never slept on.
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import psycopg2
import psycopg2.extensions
import pytest
import redis
import redis.connection
from flask import Flask, Response, jsonify, request
from flask.testing import FlaskClient
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from werkzeug.test import TestResponse

from flask_idempotency import Idempotency
from flask_idempotency.cache import codec
from flask_idempotency.cache.keyring import TAG_SIZE
from flask_idempotency.cache.redis import RedisCache
from flask_idempotency.circuit import BreakerState, CircuitBreaker
from flask_idempotency.digests import record_key
from flask_idempotency.scopes import authorization_digest
from flask_idempotency.settings import Settings
from flask_idempotency.store.base import StoredResponse
from support.clock import FakeClock
from support.forking import in_forked_child
from support.servers import ProxyFactory, ThrowawayRedis

from .caches import SECRET, rebuilt, redis_key, standalone

# -- counting PostgreSQL ------------------------------------------------------

STATEMENTS: list[str] = []
PG_CONNECTS: list[int] = []


class CountingCursor(psycopg2.extensions.cursor):
    def execute(self, query: Any, vars: Any = None) -> None:
        STATEMENTS.append(str(query)[:60])
        super().execute(query, vars)


class CountingConnection(psycopg2.extensions.connection):
    """Every cursor the extension opens counts its statements."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        PG_CONNECTS.append(1)
        self.cursor_factory = CountingCursor


def reset_pg_counts() -> None:
    STATEMENTS.clear()
    PG_CONNECTS.clear()


# -- the test application -----------------------------------------------------

#: 6,400 incompressible bytes (every value 0..255 occurs) and 10,000 zeros:
#: compressed as a whole, and any byte lost or mangled would show.
BLOB = b"".join(hashlib.sha256(b"%d" % i).digest() for i in range(200)) + bytes(10_000)

MakeApp = Callable[..., Flask]


def build_app(database_url: str, redis_url: str | None, config: dict[str, Any]) -> Flask:
    """A payments-like view that counts its runs; the JSON body picks the status."""
    app = Flask(__name__)
    settings: dict[str, Any] = {
        "IDEMPOTENCY_DATABASE_URL": database_url,
        "IDEMPOTENCY_AUTO_MIGRATE": True,
        # No keeper thread: every statement counted is the request's own.
        "IDEMPOTENCY_LEASE_RENEW_INTERVAL": 0,
        "IDEMPOTENCY_DATABASE_OPTIONS": {"connection_factory": CountingConnection},
        "SECRET_KEY": SECRET,  # without one there is no Redis cache at all
    }
    if redis_url is not None:
        settings["IDEMPOTENCY_REDIS_URL"] = redis_url
        # These tests are about the cache's contents, so every stored answer is
        # copied as it commits; the default ("replay") has tests of its own.
        settings["IDEMPOTENCY_REDIS_OPTIONS"] = {"fill": "completion"}
    for name, value in config.items():  # a test's group of options adds to these
        grouped = name.endswith("_OPTIONS") and name in settings
        settings[name] = {**settings[name], **value} if grouped else value
    app.config.update(settings)
    idempotency = Idempotency(app)
    runs: list[Any] = []
    app.extensions["runs"] = runs

    @app.post("/pay")
    @idempotency.required
    def pay() -> Response:
        body = request.get_json(silent=True) or {}
        runs.append(body)
        during_view = app.extensions.get("during_view")
        if during_view is not None:
            during_view()
        response = jsonify(n=len(runs), echo=body)
        response.status_code = int(body.get("status", 201))
        response.headers["Location"] = f"/payments/{len(runs)}"
        response.headers["X-Run"] = str(len(runs))
        return response

    @app.post("/blob")
    @idempotency.required
    def blob() -> Response:
        runs.append("blob")
        return Response(BLOB, 200, {"Content-Type": "application/octet-stream"})

    return app


@pytest.fixture
def make_pay_app(clean_db: str, clean_redis: str) -> Iterator[MakeApp]:
    """``make_pay_app(redis_url=..., **IDEMPOTENCY_config)``; Redis defaults to the run's."""
    apps: list[Flask] = []

    def make(redis_url: str | None = clean_redis, **config: Any) -> Flask:
        app = build_app(clean_db, redis_url, config)
        apps.append(app)
        return app

    yield make
    for app in apps:
        app.extensions["idempotency"].close()


@pytest.fixture
def r(clean_redis: str) -> Iterator[redis.Redis[bytes]]:
    """The test's own view of the run's Redis (never the app's client)."""
    client: redis.Redis[bytes] = redis.Redis.from_url(clean_redis)
    yield client
    client.close()


def pay(client: FlaskClient, key: str, auth: str = "Bearer a", **body: Any) -> TestResponse:
    return client.post("/pay", json=body, headers={"Idempotency-Key": key, "Authorization": auth})


def outcome(response: TestResponse) -> tuple[int, str | None, bytes]:
    return response.status_code, response.headers.get("Idempotent-Replayed"), response.data


def rkey(key: str, auth: str = "Bearer a") -> bytes:
    return record_key(authorization_digest(auth), key)


def redis_cache(app: Flask, clock: FakeClock | None = None) -> RedisCache:
    """The app's cache; with ``clock``, replaced by one whose breaker reads that clock."""
    state = app.extensions["idempotency"]
    if clock is not None:
        old = state.cache
        state.cache = rebuilt(app, clock=clock)
        old.close()
    cache = state.cache
    assert isinstance(cache, RedisCache)
    return cache


def redis_commands(monkeypatch: pytest.MonkeyPatch, cache: RedisCache) -> list[str]:
    """Names of the commands the cache sends from now on: every redis-py command
    method (``get``, ``set``, ``delete``) goes through the client's public
    ``execute_command``, which this wraps on the one client object (a spy; the
    real Redis still answers)."""
    sent: list[str] = []
    original = cache.client.execute_command

    def counting(*args: Any, **options: Any) -> Any:
        sent.append(str(args[0]))
        return original(*args, **options)

    monkeypatch.setattr(cache.client, "execute_command", counting)
    return sent


def connect_attempts(monkeypatch: pytest.MonkeyPatch, port: int) -> list[int]:
    """Every TCP connect redis-py attempts to ``port`` from now on."""
    attempts: list[int] = []
    original = getattr(redis.connection.Connection, "_connect")  # noqa: B009 (not in the stubs)

    def counting(self: Any) -> Any:
        if self.port == port:
            attempts.append(port)
        return original(self)

    monkeypatch.setattr(redis.connection.Connection, "_connect", counting)
    return attempts


def breaker_state(breaker: CircuitBreaker) -> BreakerState:
    """The breaker's state, read afresh (a call, so the type checker does not narrow it)."""
    return breaker.state


def record_expiry(database_url: str, key: bytes, expression: str) -> float:
    """``expression`` (over the record's ``expires_at``) for the record ``key``."""
    with psycopg2.connect(database_url) as conn, conn.cursor() as cur:
        cur.execute(
            f"SELECT ({expression})::float8 FROM idempotency_records WHERE record_key = %s",
            (key,),
        )
        row = cur.fetchone()
    conn.close()
    assert row is not None
    return float(row[0])


def pg_seconds_left(database_url: str, key: bytes) -> float:
    return record_expiry(database_url, key, "extract(epoch FROM expires_at - now())")


def execute(database_url: str, query: str, *params: Any) -> None:
    with psycopg2.connect(database_url) as conn, conn.cursor() as cur:
        cur.execute(query, params)
    conn.close()


# -- the fast path --------------------------------------------------------------


def test_replay_is_one_redis_get_and_no_postgres_statement(
    make_pay_app: MakeApp, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = make_pay_app()
    client = app.test_client()
    sent = redis_commands(monkeypatch, redis_cache(app))

    reset_pg_counts()
    first = pay(client, "k1", amount=1500)
    assert outcome(first)[:2] == (201, "false")
    assert sent == ["GET", "SET"]  # a miss, then the copy after the commit
    assert STATEMENTS, "the first request must go through PostgreSQL"

    sent.clear()
    reset_pg_counts()
    again = pay(client, "k1", amount=1500)
    assert STATEMENTS == [] and PG_CONNECTS == []
    assert sent == ["GET"]
    assert outcome(again) == (201, "true", first.data)
    for name in ("Content-Type", "Location", "X-Run"):
        assert again.headers[name] == first.headers[name]
    assert app.extensions["runs"] == [{"amount": 1500}]


def test_fill_on_replay_copies_a_response_only_once_it_is_retried(
    make_pay_app: MakeApp, monkeypatch: pytest.MonkeyPatch, r: redis.Redis[bytes]
) -> None:
    """IDEMPOTENCY_REDIS_OPTIONS["fill"] = "replay": no SET on a first request; the first
    replay comes from PostgreSQL and fills the cache; later ones are one GET."""
    app = make_pay_app(IDEMPOTENCY_REDIS_OPTIONS={"fill": "Replay"})  # (case does not matter)
    cache = redis_cache(app)
    client = app.test_client()
    sent = redis_commands(monkeypatch, cache)

    first = pay(client, "k1", amount=1500)
    assert outcome(first)[:2] == (201, "false")
    assert sent == ["GET"]  # the miss only: nothing is copied yet
    assert r.get(redis_key(cache, record_key(authorization_digest("Bearer a"), "k1"))) is None

    sent.clear()
    reset_pg_counts()
    retried = pay(client, "k1", amount=1500)
    assert outcome(retried) == (201, "true", first.data)
    assert sent == ["GET", "SET"] and len(STATEMENTS) == 1  # the claim replays, then the copy

    sent.clear()
    reset_pg_counts()
    again = pay(client, "k1", amount=1500)
    assert outcome(again) == (201, "true", first.data)
    assert sent == ["GET"] and STATEMENTS == []
    assert app.extensions["runs"] == [{"amount": 1500}]


def test_fill_on_replay_serves_only_retried_keys_while_postgres_is_down(
    clean_db: str, clean_redis: str, tcp_proxy: ProxyFactory
) -> None:
    """The price of filling on replay: a key never retried before is not in Redis,
    so its retry during a PostgreSQL outage is a 503 (fail closed), not a replay."""
    proxy = tcp_proxy(clean_db)
    app = build_app(
        proxy.url_for(clean_db),
        clean_redis,
        {
            "IDEMPOTENCY_REDIS_OPTIONS": {"fill": "replay"},
            "IDEMPOTENCY_DATABASE_OPTIONS": {"connect_timeout": 1},
        },
    )
    try:
        client = app.test_client()
        retried, never = pay(client, "retried", amount=1), pay(client, "never", amount=2)
        assert outcome(pay(client, "retried", amount=1)) == (201, "true", retried.data)

        proxy.cut()
        assert outcome(pay(client, "retried", amount=1)) == (201, "true", retried.data)
        down = pay(client, "never", amount=2)
        assert down.status_code == 503 and down.headers.get("Retry-After")
        proxy.restore()
        assert outcome(pay(client, "never", amount=2)) == (201, "true", never.data)
        assert app.extensions["runs"] == [{"amount": 1}, {"amount": 2}]
    finally:
        app.extensions["idempotency"].close()


def test_an_unknown_fill_mode_is_refused_at_start(clean_db: str, clean_redis: str) -> None:
    with pytest.raises(ValueError, match=r'IDEMPOTENCY_REDIS_OPTIONS\["fill"\] must be one of'):
        build_app(clean_db, clean_redis, {"IDEMPOTENCY_REDIS_OPTIONS": {"fill": "eager"}})


def test_large_binary_body_is_compressed_and_replayed_byte_for_byte(
    make_pay_app: MakeApp, r: redis.Redis[bytes]
) -> None:
    app = make_pay_app()
    client = app.test_client()
    headers = {"Idempotency-Key": "blob-1", "Authorization": "Bearer blob"}
    first = client.post("/blob", data=b"x", headers=headers)
    assert first.data == BLOB

    raw = r.get(redis_key(redis_cache(app), rkey("blob-1", "Bearer blob")))
    assert raw is not None
    assert raw[1] & codec.FLAG_COMPRESSED and len(raw) < len(BLOB) // 2

    reset_pg_counts()
    again = client.post("/blob", data=b"x", headers=headers)
    assert STATEMENTS == []
    assert again.data == BLOB and again.headers["Content-Type"] == "application/octet-stream"
    assert app.extensions["runs"] == ["blob"]


def test_cached_422_is_the_same_answer_as_postgres_422(
    make_pay_app: MakeApp, r: redis.Redis[bytes]
) -> None:
    app = make_pay_app()
    client = app.test_client()
    assert pay(client, "k1", amount=1).status_code == 201

    reset_pg_counts()
    from_redis = pay(client, "k1", amount=2)
    assert STATEMENTS == [], "the 422 must have been decided from the cached fingerprint"

    r.flushdb()
    from_postgres = pay(client, "k1", amount=2)
    assert STATEMENTS, "with Redis empty the 422 comes from PostgreSQL"

    assert from_redis.status_code == from_postgres.status_code == 422
    assert from_redis.data == from_postgres.data
    assert from_redis.json == from_postgres.json
    assert from_redis.json is not None and from_redis.json["error"]["code"] == "key_reused"
    assert from_redis.headers["Content-Type"] == from_postgres.headers["Content-Type"]
    assert "Idempotent-Replayed" not in from_redis.headers
    assert "Idempotent-Replayed" not in from_postgres.headers
    assert len(app.extensions["runs"]) == 1


def test_processing_and_unstored_answers_are_never_cached(
    make_pay_app: MakeApp, r: redis.Redis[bytes]
) -> None:
    app = make_pay_app()
    client = app.test_client()
    cache_key = redis_key(redis_cache(app), rkey("k1"))
    seen_during_view: list[int] = []
    app.extensions["during_view"] = lambda: seen_during_view.append(r.exists(cache_key))

    assert pay(client, "k1", amount=1).status_code == 201
    assert seen_during_view == [0]  # processing: nothing in Redis
    assert r.exists(cache_key) == 1  # completed: cached

    for key, status in (("k400", 400), ("k409", 409), ("k500", 500), ("k503", 503)):
        assert pay(client, key, status=status).status_code == status
        assert r.exists(redis_key(redis_cache(app), rkey(key))) == 0
    assert pay(client, "k402", status=402).status_code == 402  # a stored decline
    assert r.exists(redis_key(redis_cache(app), rkey("k402"))) == 1


#: Every kind of answer: first run, replay, 422, stored 402, unstored 400/500.
SCRIPT: list[tuple[str, dict[str, Any]]] = [
    ("k1", {"amount": 1}),
    ("k1", {"amount": 1}),
    ("k1", {"amount": 2}),
    ("k2", {"amount": 3, "status": 402}),
    ("k2", {"amount": 3, "status": 402}),
    ("k3", {"status": 400}),
    ("k3", {"status": 400}),
    ("k4", {"status": 500}),
    ("k1", {"amount": 1}),
    ("k2", {"amount": 3, "status": 402}),
    ("k1", {"amount": 2}),
    ("k4", {"status": 500}),
    ("k1", {"amount": 1}),
]


def run_script(
    client: FlaskClient, auth: str, flush: Callable[[int], object] = lambda step: None
) -> list[tuple[int, str | None, bytes]]:
    results = []
    for step, (key, body) in enumerate(SCRIPT):
        results.append(outcome(pay(client, key, auth, **body)))
        flush(step)
    return results


#: What SCRIPT answers with PostgreSQL alone.
SCRIPT_STATUSES = [201, 201, 422, 402, 402, 400, 400, 500, 201, 402, 422, 500, 201]

FLUSHES: dict[str, Callable[[redis.Redis[bytes], int], object]] = {
    "never": lambda r, step: None,
    "after every request": lambda r, step: r.flushdb(),
    "every third request": lambda r, step: r.flushdb() if step % 3 == 2 else None,
    "inside every view": lambda r, step: None,  # see below
}


@pytest.mark.parametrize("when", list(FLUSHES))
def test_flushing_redis_changes_no_outcome(
    make_pay_app: MakeApp, r: redis.Redis[bytes], when: str
) -> None:
    postgres_only = make_pay_app(redis_url=None)
    expected = run_script(postgres_only.test_client(), "Bearer pg")
    assert [status for status, _, _ in expected] == SCRIPT_STATUSES

    app = make_pay_app()
    if when == "inside every view":  # between the claim and the completion's put
        app.extensions["during_view"] = r.flushdb
    got = run_script(app.test_client(), "Bearer redis", lambda step: FLUSHES[when](r, step))
    assert got == expected
    assert app.extensions["runs"] == postgres_only.extensions["runs"]
    from_cache = app.extensions["idempotency"].metrics.snapshot()["replayed_from_cache"]
    if when == "never":
        assert from_cache == 5  # all five replays of a stored answer
    if when == "after every request":
        assert from_cache == 0


def test_two_scopes_with_the_same_key_never_share_an_entry(
    make_pay_app: MakeApp, r: redis.Redis[bytes]
) -> None:
    app = make_pay_app()
    client = app.test_client()
    alice = pay(client, "same-key", "Bearer alice", amount=1)
    bob = pay(client, "same-key", "Bearer bob", amount=1)
    assert alice.json is not None and bob.json is not None
    assert (alice.json["n"], bob.json["n"]) == (1, 2)  # bob's request ran: not alice's answer

    reset_pg_counts()
    assert pay(client, "same-key", "Bearer alice", amount=1).data == alice.data
    assert pay(client, "same-key", "Bearer bob", amount=1).data == bob.data
    assert STATEMENTS == []  # both from Redis, each its own

    names = sorted(k.decode() for k in r.keys("idempotency:*"))
    assert len(names) == 2
    for name in names:
        # Hashed record key in a hash tag; neither the client key nor a token appears.
        assert re.fullmatch(r"idempotency:[0-9a-f]{32}:\{[0-9a-f]{64}\}", name)
        assert "same-key" not in name and "alice" not in name


#: Redis counts a ``PX`` from when the ``SET`` arrives, a moment after the extension
#: computed it from the record's remainder: the key may outlast the record by that
#: moment (a fraction of a millisecond, more on a loaded machine). Nothing is served
#: in it: the entry carries its own expiry, computed before the SET and checked on
#: every read: that expiry is what must never pass the record's (``embedded_expiry``).
SET_IN_FLIGHT_MS = 50


def embedded_expiry(cache: RedisCache, r: redis.Redis[bytes], key: bytes) -> int:
    """The wall-clock expiry (epoch ms) sealed into a record's entry, which every
    read checks before replaying it."""
    ring = cache.keyring.get()
    assert ring is not None
    name = redis_key(cache, key)
    value = r.get(name)
    assert value is not None
    return codec.decode(ring.open(name.encode(), value)).expires_at


def pg_expiry_ms(database_url: str, key: bytes) -> float:
    return record_expiry(database_url, key, "extract(epoch FROM expires_at) * 1000")


def test_cached_entry_never_outlives_the_record(
    make_pay_app: MakeApp, r: redis.Redis[bytes], clean_db: str
) -> None:
    app = make_pay_app(IDEMPOTENCY_TTL=120)
    client = app.test_client()
    cache = redis_cache(app)
    key = rkey("k1")
    pay(client, "k1", amount=1)

    left = pg_seconds_left(clean_db, key)  # read first: the record only gets older
    pttl = r.pttl(redis_key(cache, key))
    assert 110_000 < pttl <= left * 1000 + SET_IN_FLIGHT_MS
    assert embedded_expiry(cache, r, key) <= pg_expiry_ms(clean_db, key)

    # A PostgreSQL replay repopulates with the record's remaining TTL.
    execute(
        clean_db,
        "UPDATE idempotency_records SET expires_at = now() + interval '3 seconds'"
        " WHERE record_key = %s",
        key,
    )
    r.flushdb()
    assert pay(client, "k1", amount=1).headers["Idempotent-Replayed"] == "true"
    left = pg_seconds_left(clean_db, key)
    pttl = r.pttl(redis_key(cache, key))
    assert 0 < pttl <= left * 1000 + SET_IN_FLIGHT_MS and left <= 3
    assert embedded_expiry(cache, r, key) <= pg_expiry_ms(clean_db, key)

    # A record at the end of its life is not cached at all.
    cache.put(rkey("k9"), b"f" * 32, StoredResponse(201, (), b"x"), 0.0004)  # < 1 ms
    cache.put(rkey("k9"), b"f" * 32, StoredResponse(201, (), b"x"), -5)
    assert r.exists(redis_key(cache, rkey("k9"))) == 0


def test_unreadable_entry_is_a_miss_and_gets_replaced(
    make_pay_app: MakeApp, r: redis.Redis[bytes], caplog: pytest.LogCaptureFixture
) -> None:
    app = make_pay_app()
    client = app.test_client()
    cache_key = redis_key(redis_cache(app), rkey("k1"))
    first = pay(client, "k1", amount=1)

    good = r.get(cache_key)
    assert good is not None
    # A future format, then what a pickle would look like: neither is run or trusted.
    for foreign in (b"\x03" + good[1:], b"\x80\x04\x95" + b"cos\nsystem\n"):
        r.set(cache_key, foreign)
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="flask_idempotency"):
            again = pay(client, "k1", amount=1)
        assert outcome(again) == (201, "true", first.data)
        assert "rejected (version: written by another version)" in caplog.text
        assert first.data.decode() not in caplog.text and rkey("k1").hex() not in caplog.text
        refreshed = r.get(cache_key)
        assert refreshed is not None
        assert codec.decode(refreshed[:-TAG_SIZE]).record.response.body == first.data
    assert len(app.extensions["runs"]) == 1


# -- outages ----------------------------------------------------------------------


def test_cut_redis_changes_nothing_and_the_breaker_skips_it_until_it_is_back(
    make_pay_app: MakeApp,
    clean_redis: str,
    tcp_proxy: ProxyFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    proxy = tcp_proxy(clean_redis)
    app = make_pay_app(
        redis_url=proxy.url,
        IDEMPOTENCY_REDIS_OPTIONS={"breaker_threshold": 3, "breaker_cooldown": 5},
    )
    clock = FakeClock()
    cache = redis_cache(app, clock)
    attempts = connect_attempts(monkeypatch, proxy.port)
    client = app.test_client()

    a1 = pay(client, "a", amount=1)
    assert outcome(a1)[:2] == (201, "false")

    proxy.cut()
    a2 = pay(client, "a", amount=1)  # GET fails (1), PostgreSQL replays, SET fails (2)
    b1 = pay(client, "b", amount=2)  # GET fails (3): open
    assert breaker_state(cache.breaker) is BreakerState.OPEN
    assert outcome(a2) == (201, "true", a1.data)
    assert outcome(b1)[:2] == (201, "false")

    attempts.clear()
    during = [pay(client, "b", amount=2), pay(client, "a", amount=1), pay(client, "a", amount=9)]
    proxy.restore()
    during.append(pay(client, "b", amount=2))  # back, but the cooldown has not passed
    assert attempts == [], "an open breaker must not even try to connect"
    assert [outcome(x) for x in during] == [
        (201, "true", b1.data),
        (201, "true", a1.data),
        (422, None, during[2].data),
        (201, "true", b1.data),
    ]

    clock.advance(5)
    reset_pg_counts()
    a3 = pay(client, "a", amount=1)  # the trial: Redis still holds a's entry
    assert breaker_state(cache.breaker) is BreakerState.CLOSED
    assert outcome(a3) == (201, "true", a1.data)
    assert STATEMENTS == [] and len(attempts) >= 1
    assert len(app.extensions["runs"]) == 2


def test_killed_redis_changes_nothing_and_a_restarted_empty_one_is_used_again(
    make_pay_app: MakeApp, throwaway_redis: ThrowawayRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = make_pay_app(
        redis_url=throwaway_redis.url,
        IDEMPOTENCY_REDIS_OPTIONS={"breaker_threshold": 2, "breaker_cooldown": 30},
    )
    clock = FakeClock()
    cache = redis_cache(app, clock)
    client = app.test_client()
    first = pay(client, "a", amount=1)

    throwaway_redis.stop()
    answers = [pay(client, "a", amount=1) for _ in range(3)] + [pay(client, "a", amount=2)]
    assert [outcome(x)[:2] for x in answers] == [(201, "true")] * 3 + [(422, None)]
    assert all(x.data == first.data for x in answers[:3])
    assert breaker_state(cache.breaker) is BreakerState.OPEN

    throwaway_redis.start()  # same port, nothing in it
    attempts = connect_attempts(monkeypatch, throwaway_redis.port)
    clock.advance(29)
    assert outcome(pay(client, "a", amount=1)) == (201, "true", first.data)
    assert attempts == []
    clock.advance(1)
    assert outcome(pay(client, "a", amount=1)) == (201, "true", first.data)  # trial: a miss
    assert breaker_state(cache.breaker) is BreakerState.CLOSED

    reset_pg_counts()
    assert outcome(pay(client, "a", amount=1)) == (201, "true", first.data)
    assert STATEMENTS == [], "the PostgreSQL replay after the restart refilled the cache"
    assert len(app.extensions["runs"]) == 1


def test_failures_are_logged_rate_limited_and_without_keys_or_bodies(
    clean_redis: str, tcp_proxy: ProxyFactory, caplog: pytest.LogCaptureFixture
) -> None:
    proxy = tcp_proxy(clean_redis)
    clock = FakeClock()
    settings = Settings(database_url="unused", redis_url=proxy.url, redis_breaker_threshold=100)
    cache = standalone(settings, clock=clock)
    key, body = rkey("k1"), b"card 4242 4242 4242 4242"
    proxy.cut()
    with caplog.at_level(logging.DEBUG, logger="flask_idempotency"):
        for _ in range(10):
            cache.put(key, b"f" * 32, StoredResponse(201, (), body), 60)
            assert cache.get(key) is None
        clock.advance(10)
        cache.get(key)
    cache.close()
    warnings_logged = [rec for rec in caplog.records if rec.levelno == logging.WARNING]
    assert len(warnings_logged) == 2  # the first, then one after LOG_INTERVAL...
    assert "19 similar messages suppressed" in warnings_logged[1].getMessage()  # ...with a count
    assert key.hex()[:12] in caplog.text  # the short label, to correlate
    assert key.hex() not in caplog.text and "4242" not in caplog.text


# -- the CLI ------------------------------------------------------------------------


def test_purge_evicts_the_cached_copies(
    make_pay_app: MakeApp, r: redis.Redis[bytes], clean_db: str
) -> None:
    app = make_pay_app()
    client = app.test_client()
    pay(client, "old", amount=1)
    pay(client, "new", amount=2)
    cache = redis_cache(app)
    assert r.exists(redis_key(cache, rkey("old")), redis_key(cache, rkey("new"))) == 2
    execute(
        clean_db,
        "UPDATE idempotency_records SET expires_at = now() - interval '1 second'"
        " WHERE record_key = %s",
        rkey("old"),
    )
    result = app.test_cli_runner().invoke(args=["idempotency", "purge"])
    assert result.exit_code == 0, result.output
    assert "1 expired record(s) deleted" in result.output
    assert r.exists(redis_key(cache, rkey("old"))) == 0
    assert r.exists(redis_key(cache, rkey("new"))) == 1


def test_unlock_evicts_the_key(make_pay_app: MakeApp, r: redis.Redis[bytes]) -> None:
    app = make_pay_app()
    state = app.extensions["idempotency"]
    key = rkey("stuck", "Bearer a")
    tx = state.store.begin()
    tx.claim(key, b"f" * 32, lease=30, ttl=60)
    tx.close()
    # A copy that should not be there (say, left by an older deployment).
    redis_cache(app).put(key, b"f" * 32, StoredResponse(201, (), b"stale"), 60)
    result = app.test_cli_runner().invoke(
        # The claim's lease is live: off a terminal, unlock needs --yes. The client's
        # secret comes from the environment, never the command line.
        args=["idempotency", "unlock", "stuck", "--authorization", "--yes"],
        env={"IDEMPOTENCY_CLIENT_AUTHORIZATION": "Bearer a"},
    )
    assert result.exit_code == 0, result.output
    assert r.exists(redis_key(redis_cache(app), key)) == 0


# -- the client: configuration, handshake, fork ----------------------------------------


def test_url_client_has_short_timeouts_no_retries_and_connects_lazily(
    clean_redis: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    attempts = connect_attempts(monkeypatch, 1)  # port 1: nothing listens there
    cache = standalone(
        Settings(database_url="unused", redis_url="redis://127.0.0.1:1/0", redis_timeout=0.05)
    )
    assert attempts == []  # built, not connected
    options = cache.client.connection_pool.connection_kwargs
    assert options["socket_timeout"] == options["socket_connect_timeout"] == 0.05
    assert options["health_check_interval"] == 0
    assert options["retry"].get_retries() == 0
    assert cache.get(b"k" * 32) is None  # refused: a miss, after exactly one attempt
    assert attempts == [1]
    cache.close()

    with pytest.raises(ValueError):
        standalone(Settings(database_url="unused", redis_url="http://nope"))


def test_a_new_connection_costs_one_command(throwaway_redis: ThrowawayRedis) -> None:
    """Measured on the server: the first GET of a fresh client is the only command."""
    admin: redis.Redis[bytes] = redis.Redis.from_url(throwaway_redis.url)
    admin.config_resetstat()
    cache = standalone(Settings(database_url="unused", redis_url=throwaway_redis.url))
    cache.get(b"k" * 32)
    cache.put(b"k" * 32, b"f" * 32, StoredResponse(200, (), b"x"), 60)
    cache.evict([b"k" * 32, b"j" * 32])
    stats = admin.info("commandstats")
    calls = {name: stat["calls"] for name, stat in stats.items() if name != "cmdstat_config"}
    assert calls == {"cmdstat_get": 1, "cmdstat_set": 1, "cmdstat_del": 1}
    cache.close()
    admin.close()


def test_an_applications_own_client_is_used_as_is(
    clean_db: str, clean_redis: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    own: redis.Redis[bytes] = redis.Redis.from_url(clean_redis)
    app = build_app(clean_db, None, {"IDEMPOTENCY_REDIS": own})
    try:
        cache = redis_cache(app)
        assert cache.client is own
        sent = redis_commands(monkeypatch, cache)
        client = app.test_client()
        pay(client, "k1", amount=1)
        pay(client, "k1", amount=1)  # the first replay, from PostgreSQL, fills the cache
        pay(client, "k1", amount=1)
        assert sent == ["GET", "GET", "SET", "GET"]
    finally:
        app.extensions["idempotency"].close()
    assert own.ping()  # still the application's, still open

    decoding: redis.Redis[str] = redis.Redis.from_url(clean_redis, decode_responses=True)
    with pytest.raises(ValueError, match="decode responses"):
        build_app(clean_db, None, {"IDEMPOTENCY_REDIS": decoding})
    decoding.close()
    own.close()


def test_a_forked_child_opens_its_own_connection(clean_redis: str) -> None:
    cache = standalone(Settings(database_url="unused", redis_url=clean_redis))
    key = b"k" * 32
    cache.put(key, b"f" * 32, StoredResponse(200, (), b"parent"), 60)
    parent_id = cache.client.client_id()

    def child() -> bool:
        child_id = cache.client.client_id()
        hits = [cache.get(key) for _ in range(20)]
        ok = all(h is not None and h.response.body == b"parent" for h in hits)
        return ok and child_id != parent_id

    assert in_forked_child(child)
    assert cache.client.client_id() == parent_id  # the parent's socket was left alone
    hit = cache.get(key)
    assert hit is not None and hit.response.body == b"parent"
    cache.close()


# -- the codec ----------------------------------------------------------------------------

#: An expiry in Unix milliseconds (the codec only frames it; the cache checks it).
EXPIRES = 1_900_000_000_000

headers_strategy = st.lists(st.tuples(st.text(max_size=40), st.text(max_size=200)), max_size=8).map(
    tuple
)


@hypothesis_settings(max_examples=150, deadline=None)
@given(
    fingerprint=st.binary(max_size=64),
    status=st.integers(100, 599),
    headers=headers_strategy,
    body=st.one_of(st.binary(max_size=9000), st.text(max_size=3000).map(str.encode)),
    compress_over=st.sampled_from([0, 16, 4096]),
)
def test_codec_round_trips(
    fingerprint: bytes,
    status: int,
    headers: tuple[tuple[str, str], ...],
    body: bytes,
    compress_over: int,
) -> None:
    response = StoredResponse(status, headers, body)
    decoded, expires_at = codec.decode(
        codec.encode(fingerprint, response, expires_at=EXPIRES, compress_over=compress_over)
    )
    assert decoded.fingerprint == fingerprint
    assert decoded.response == response
    assert expires_at == EXPIRES


def test_codec_keeps_unicode_headers_and_compresses_only_when_it_pays() -> None:
    headers = (("Content-Type", "application/json"), ("X-Naïve", "€ ✓ \U0001f4b3 \udc80"))
    fingerprint = hashlib.sha256(b"fp").digest()
    json_body = b'{"amount": 1500, "currency": "eur"}' * 200
    random_body = b"".join(hashlib.sha256(b"%d" % i).digest() for i in range(300))

    packed = codec.encode(
        fingerprint, StoredResponse(201, headers, json_body), expires_at=EXPIRES, compress_over=4096
    )
    assert packed[1] & codec.FLAG_COMPRESSED and len(packed) < len(json_body) // 10
    assert codec.decode(packed).record.response.headers == headers

    kept = codec.encode(
        fingerprint, StoredResponse(201, (), random_body), expires_at=EXPIRES, compress_over=4096
    )
    assert not kept[1] & codec.FLAG_COMPRESSED  # deflating random bytes would grow them

    small = codec.encode(
        fingerprint,
        StoredResponse(201, (), json_body[:4096]),
        expires_at=EXPIRES,
        compress_over=4096,
    )
    assert not small[1] & codec.FLAG_COMPRESSED


def test_codec_rejects_anything_it_did_not_write() -> None:
    fingerprint = b"f" * 32
    response = StoredResponse(201, (("ETag", '"1"'),), b'{"ok": true}' * 500)
    plain = codec.encode(fingerprint, response, expires_at=EXPIRES, compress_over=1 << 20)
    packed = codec.encode(fingerprint, response, expires_at=EXPIRES, compress_over=0)
    assert packed[1] & codec.FLAG_COMPRESSED

    for value in (plain, packed):
        for cut in range(len(value)):
            with pytest.raises(codec.CorruptEntry):
                codec.decode(value[:cut])
        with pytest.raises(codec.CorruptEntry):
            codec.decode(value + b"\x00")
    with pytest.raises(codec.UnknownVersion):
        codec.decode(b"\x01" + plain[1:])  # 0.2.x's format
    with pytest.raises(codec.UnknownVersion):
        codec.decode(b"\x80\x04\x95\x00")  # a pickle
    with pytest.raises(codec.CorruptEntry, match="flags"):
        codec.decode(plain[:1] + b"\x02" + plain[2:])
    with pytest.raises(codec.CorruptEntry, match="zlib"):
        codec.decode(plain[:1] + b"\x01" + plain[2:])  # claims compression it lacks
    with pytest.raises(codec.CorruptEntry, match="UTF-8"):
        bad_header = codec.encode(
            fingerprint,
            StoredResponse(200, (("X", "ab"),), b""),
            expires_at=EXPIRES,
            compress_over=0,
        )
        codec.decode(bad_header.replace(b"ab", b"\xff\xfe"))

    # A small value that would inflate to 10 MB is stopped at the size limit.
    bomb_body = zlib.compress(bytes(10_000_000), 9)
    bomb = plain[: plain.index(b"ETag") + 9] + len(bomb_body).to_bytes(4, "big") + bomb_body
    bomb = bomb[:1] + b"\x01" + bomb[2:]
    assert len(codec.decode(bomb).record.response.body) == 10_000_000  # well-formed...
    with pytest.raises(codec.CorruptEntry, match="inflates"):
        codec.decode(bomb, max_body=1024 * 1024)  # ...but bigger than anything stored
    with pytest.raises(codec.CorruptEntry):
        codec.decode(plain, max_body=10)

    with pytest.raises(codec.CodecError):
        codec.encode(
            fingerprint,
            StoredResponse(200, (("X", "v" * 70_000),), b""),
            expires_at=EXPIRES,
            compress_over=0,
        )


# -- the breaker ----------------------------------------------------------------------------


def test_breaker_opens_after_consecutive_failures_only() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(3, 5.0, clock=clock)
    for _ in range(5):  # a success in between resets the count
        assert breaker.failure() is False
        assert breaker.failure() is False
        breaker.success()
    assert breaker_state(breaker) is BreakerState.CLOSED
    breaker.failure()
    breaker.failure()
    assert breaker.failure() is True  # this one opened it
    assert not breaker.allow()
    assert breaker.failure() is False  # a straggler does not extend the cooldown
    clock.advance(4.9)
    assert not breaker.allow()
    clock.advance(0.1)
    assert breaker.allow()  # the trial
    assert breaker_state(breaker) is BreakerState.HALF_OPEN
    assert not breaker.allow()  # one trial at a time
    assert breaker.failure() is True  # failed trial: another full cooldown
    clock.advance(4.9)
    assert not breaker.allow()
    clock.advance(0.1)
    assert breaker.allow()
    assert breaker.success() is True  # the trial's success closed it
    assert breaker.allow() and breaker.allow()


def test_breaker_grants_exactly_one_trial_across_threads() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(1, 5.0, clock=clock)
    breaker.failure()
    clock.advance(5)
    start = threading.Barrier(16)
    granted: list[bool] = []

    def contend() -> None:
        start.wait()
        granted.append(breaker.allow())

    threads = [threading.Thread(target=contend) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(granted) == [False] * 15 + [True]

    # A trial whose caller never reported back does not wedge the breaker.
    clock.advance(5)
    assert breaker.allow()
