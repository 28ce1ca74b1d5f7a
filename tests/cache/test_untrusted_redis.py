"""Redis is not trusted (contract section 7): tried as an attacker with Redis access.

Entries are written straight into the run's Redis with redis-py - rewritten,
planted before the first request, copied from another deployment, carrying
``Set-Cookie`` - against real apps on real PostgreSQL databases, and the
outcome is read from outside: whether the view ran, what PostgreSQL holds, what
the client got. Nothing Redis holds may decide an answer unless this
deployment sealed it.
"""

from __future__ import annotations

import hashlib
import logging
import struct
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg2
import pytest
import redis
from flask import Flask, Response, jsonify, request
from werkzeug.test import TestResponse

from flask_idempotency import Idempotency
from flask_idempotency.cache import codec
from flask_idempotency.cache.keyring import TAG_SIZE, Keyring, Unauthentic
from flask_idempotency.cache.redis import RedisCache
from flask_idempotency.digests import record_key
from flask_idempotency.observer import Observer
from flask_idempotency.scopes import authorization_digest
from flask_idempotency.store.base import StoredResponse
from flask_idempotency.store.identity import database_identity

from .caches import SECRET, redis_key

AUTH = "Bearer victim"
EVIL = "https://evil.example/phish"

MakeApp = Callable[..., Flask]


def build(database_url: str, redis_url: str, **config: Any) -> Flask:
    """A charge route that counts its runs and sets a cookie and a CORS header."""
    app = Flask(__name__)
    app.config.update(
        IDEMPOTENCY_DATABASE_URL=database_url,
        IDEMPOTENCY_AUTO_MIGRATE=True,
        IDEMPOTENCY_LEASE_RENEW_INTERVAL=0,
        IDEMPOTENCY_REDIS_URL=redis_url,
        IDEMPOTENCY_REDIS_OPTIONS={"fill": "completion"},
        SECRET_KEY=SECRET,
    )
    app.config.update(config)
    idempotency = Idempotency(app)
    runs: list[Any] = []
    lock = threading.Lock()
    app.extensions["runs"] = runs

    @app.post("/charges")
    @idempotency.required
    def charge() -> Response:
        with lock:
            runs.append(request.get_json())
            n = len(runs)
        response = jsonify(id=f"ch_{n}", amount=request.get_json()["amount"])
        response.status_code = 201
        response.headers["Location"] = f"/charges/ch_{n}"
        return response

    return app


@pytest.fixture
def make(clean_db: str, clean_redis: str) -> Iterator[MakeApp]:
    """``make(database_url=clean_db, **config)``: an app on the run's Redis."""
    apps: list[Flask] = []

    def make_app(database_url: str = clean_db, **config: Any) -> Flask:
        app = build(database_url, clean_redis, **config)
        apps.append(app)
        return app

    yield make_app
    for app in apps:
        app.extensions["idempotency"].close()


@pytest.fixture
def r(clean_redis: str) -> Iterator[redis.Redis[bytes]]:
    """The attacker's client."""
    client: redis.Redis[bytes] = redis.Redis.from_url(clean_redis)
    yield client
    client.close()


def charge(app: Flask, key: str, amount: int = 1500) -> TestResponse:
    return app.test_client().post(
        "/charges", json={"amount": amount}, headers={"Idempotency-Key": key, "Authorization": AUTH}
    )


def rkey(key: str) -> bytes:
    return record_key(authorization_digest(AUTH), key)


def cache_of(app: Flask) -> RedisCache:
    cache = app.extensions["idempotency"].cache
    assert isinstance(cache, RedisCache)
    return cache


def rows(database_url: str) -> int:
    with psycopg2.connect(database_url) as conn, conn.cursor() as cur:
        cur.execute("SELECT count(*) FROM idempotency_records")
        (count,) = cur.fetchone() or (0,)
    conn.close()
    return int(count)


def fingerprint_of(app: Flask, key: str, amount: int = 1500) -> bytes:
    """What the app's fingerprint of that request is, read from the record it wrote."""
    with psycopg2.connect(app.config["IDEMPOTENCY_DATABASE_URL"]) as conn, conn.cursor() as cur:
        cur.execute(
            "SELECT fingerprint FROM idempotency_records WHERE record_key = %s", (rkey(key),)
        )
        row = cur.fetchone()
    conn.close()
    assert row is not None
    return bytes(row[0])


def forged(
    fingerprint: bytes,
    headers: tuple[tuple[str, str], ...],
    body: bytes,
    *,
    ring: Keyring | None = None,
    redis_key: str = "",
    status: int = 201,
) -> bytes:
    """A well-formed version-2 entry; sealed with ``ring`` (a key the attacker
    does or does not have), else followed by a tag of random bytes."""
    payload = codec.encode(
        fingerprint,
        StoredResponse(status, headers, body),
        expires_at=int((time.time() + 3600) * 1000),
        compress_over=1 << 20,
    )
    if ring is None:
        return payload + hashlib.sha256(b"guess").digest()
    return ring.seal(redis_key.encode(), payload)


class Rejections(Observer):
    def __init__(self) -> None:
        self.reasons: list[str] = []

    def cache_rejected(self, reason: str) -> None:
        self.reasons.append(reason)


def watch(app: Flask) -> Rejections:
    seen = Rejections()
    cache_of(app).attach_observer(seen)
    return seen


# -- planted and rewritten entries -------------------------------------------------


def test_an_entry_planted_before_the_first_request_never_skips_the_view(
    make: MakeApp, r: redis.Redis[bytes], clean_db: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The attacker guesses scope and key, knows the key layout, forges a fine entry
    with the right fingerprint, but has no secret to seal it with."""
    probe = make()
    charge(probe, "probe")  # the attacker learns the fingerprint scheme and the namespace
    fingerprint = fingerprint_of(probe, "probe")  # same body as the victim's below
    app = make()
    seen = watch(app)
    cache = cache_of(app)
    wrong_ring = Keyring(
        [b"a guessed secret"], database_identity(app.extensions["idempotency"].store)
    )
    for key in ("victim-1", "victim-2"):
        target = redis_key(cache, rkey(key))
        # A random tag, then one made with a guessed secret.
        ring = None if key == "victim-1" else wrong_ring
        r.set(
            target,
            forged(
                fingerprint,
                (("Location", EVIL),),
                b'{"id": "ch_fake"}',
                ring=ring,
                redis_key=target,
            ),
        )
        with caplog.at_level(logging.WARNING, logger="flask_idempotency.cache"):
            first = charge(app, key)
        assert first.status_code == 201
        assert first.headers["Idempotent-Replayed"] == "false"  # the view ran
        assert first.headers["Location"] != EVIL and b"ch_fake" not in first.data
        again = charge(app, key)  # and its genuine entry replaced the plant
        assert again.headers["Idempotent-Replayed"] == "true" and again.data == first.data
    assert len(app.extensions["runs"]) == 2  # each victim request ran its view once
    assert rows(clean_db) == 3  # PostgreSQL has their records (and the probe's)
    assert seen.reasons == ["unverified", "unverified"]
    assert "rejected (unverified" in caplog.text
    assert rkey("victim-1").hex() not in caplog.text  # the key is logged hashed


def test_a_rewritten_entry_is_a_miss_and_postgresql_replays_the_true_answer(
    make: MakeApp, r: redis.Redis[bytes]
) -> None:
    app = make()
    seen = watch(app)
    first = charge(app, "k1")
    target = redis_key(cache_of(app), rkey("k1"))
    ring = cache_of(app).keyring.get()
    genuine = r.get(target)
    assert genuine is not None and ring is not None
    # Flip the body, or swap in a Location, keeping the genuine tag.
    payload = genuine[:-TAG_SIZE]
    rewritten = [
        payload.replace(b"ch_1", b"ch_9") + genuine[-TAG_SIZE:],
        payload.replace(b"/charges/ch_1", b"https://evil.example") + genuine[-TAG_SIZE:],
        payload + bytes(TAG_SIZE),  # the tag zeroed
    ]
    for value in rewritten:
        assert value != genuine
        r.set(target, value)
        again = charge(app, "k1")
        assert again.status_code == 201 and again.headers["Idempotent-Replayed"] == "true"
        assert again.data == first.data and again.headers["Location"] == "/charges/ch_1"
        refilled = r.get(target)  # the PostgreSQL replay put a genuine entry back
        assert refilled is not None and ring.open(target.encode(), refilled)
    assert seen.reasons == ["unverified"] * 3
    assert len(app.extensions["runs"]) == 1


def test_an_entry_moved_to_another_key_does_not_verify(
    make: MakeApp, r: redis.Redis[bytes]
) -> None:
    """A genuine entry of one record, copied under another record's key (another
    client's, another scope's): the tag is bound to the key."""
    app = make()
    seen = watch(app)
    charge(app, "mine", amount=1)
    cache = cache_of(app)
    genuine = r.get(redis_key(cache, rkey("mine")))
    assert genuine is not None
    r.set(redis_key(cache, rkey("theirs")), genuine)
    theirs = charge(app, "theirs", amount=1)
    assert theirs.headers["Idempotent-Replayed"] == "false"
    assert len(app.extensions["runs"]) == 2
    assert seen.reasons == ["unverified"]


# -- what a replay carries ------------------------------------------------------------


def test_a_replay_never_carries_set_cookie_or_cors_headers_whatever_redis_holds(
    make: MakeApp, r: redis.Redis[bytes]
) -> None:
    app = make()
    first = charge(app, "k1")
    cache = cache_of(app)
    target = redis_key(cache, rkey("k1"))
    fingerprint = fingerprint_of(app, "k1")
    ring = cache.keyring.get()
    assert ring is not None
    bad_headers = (
        ("Content-Type", "application/json"),
        ("Set-Cookie", "session=attacker; Path=/"),
        ("set-cookie", "other=1"),
        ("Access-Control-Allow-Origin", "https://first-origin.example"),
        ("Location", "/charges/ch_1"),
    )
    # Unsealed (what an attacker can write): not replayed at all.
    r.set(target, forged(fingerprint, bad_headers, first.data))
    unsealed = charge(app, "k1")
    assert "Set-Cookie" not in unsealed.headers
    # Sealed (as if a writer had let them through): replayed without them.
    r.set(target, forged(fingerprint, bad_headers, first.data, ring=ring, redis_key=target))
    sealed = charge(app, "k1")
    assert sealed.headers["Idempotent-Replayed"] == "true" and sealed.data == first.data
    assert "Set-Cookie" not in sealed.headers
    assert "Access-Control-Allow-Origin" not in sealed.headers
    assert sealed.headers["Location"] == "/charges/ch_1"
    assert len(app.extensions["runs"]) == 1


# -- deployments, versions, secrets ---------------------------------------------------------


def test_two_deployments_sharing_one_redis_never_see_each_others_entries(
    make: MakeApp, r: redis.Redis[bytes], clean_db: str, fresh_database_url: str
) -> None:
    """The same app, same settings, same SECRET_KEY, on two databases and one Redis."""
    one, two = make(clean_db), make(fresh_database_url)
    first = charge(one, "same-key")
    assert charge(one, "same-key").headers["Idempotent-Replayed"] == "true"
    answer = charge(two, "same-key")
    assert answer.headers["Idempotent-Replayed"] == "false"  # deployment two ran its view
    assert len(two.extensions["runs"]) == 1 and rows(fresh_database_url) == 1
    assert answer.data == first.data  # (same view, same first id: but its own run)
    names = {k.decode() for k in r.keys("idempotency:*")}
    assert len(names) == 2 and redis_key(cache_of(one), rkey("same-key")) != redis_key(
        cache_of(two), rkey("same-key")
    )

    # Deployment one's genuine entry copied under deployment two's key: refused.
    seen = watch(two)
    genuine = r.get(redis_key(cache_of(one), rkey("other-key")))
    assert genuine is None
    charge(one, "other-key")
    genuine = r.get(redis_key(cache_of(one), rkey("other-key")))
    assert genuine is not None
    r.set(redis_key(cache_of(two), rkey("other-key")), genuine)
    assert charge(two, "other-key").headers["Idempotent-Replayed"] == "false"
    assert seen.reasons == ["unverified"]


def test_an_old_format_entry_is_never_replayed(
    make: MakeApp, r: redis.Redis[bytes], clean_db: str
) -> None:
    """0.2.x wrote version-1 entries (no tag, no expiry) under ``{prefix}:{<hex>}``.
    New workers never read that key, and a version-1 value under theirs is a miss;
    0.2.x workers never read the new keys (and refuse version 2)."""
    app = make()
    seen = watch(app)
    charge(app, "probe")
    fingerprint = fingerprint_of(app, "probe")
    cache = cache_of(app)

    def version_1(body: bytes) -> bytes:
        head = struct.pack(">BBH", 1, 0, 201) + struct.pack(">H", len(fingerprint)) + fingerprint
        header = (b"Location", EVIL.encode())
        framed = struct.pack(">H", 1) + b"".join(struct.pack(">H", len(x)) + x for x in header)
        return head + framed + struct.pack(">I", len(body)) + body

    old_key = f"idempotency:{{{rkey('rolling').hex()}}}"
    r.set(old_key, version_1(b'{"id": "old"}'))
    r.set(redis_key(cache, rkey("rolling")), version_1(b'{"id": "old"}'))
    answer = charge(app, "rolling")
    assert answer.headers["Idempotent-Replayed"] == "false" and b"old" not in answer.data
    assert seen.reasons == ["version"]
    assert rows(clean_db) == 2
    # Our own entry now sits at the new key; the 0.2.x key holds only what 0.2.x wrote.
    ours = r.get(redis_key(cache, rkey("rolling")))
    assert ours is not None and ours[:1] == codec.VERSION_BYTE
    assert r.get(old_key) == version_1(b'{"id": "old"}')


def test_rotated_secrets_verify_through_the_fallbacks(make: MakeApp, r: redis.Redis[bytes]) -> None:
    old = make()
    first = charge(old, "k1")
    rotated = make(SECRET_KEY="the-new-secret", SECRET_KEY_FALLBACKS=[SECRET])
    seen = watch(rotated)
    from_cache_before = rotated.extensions["idempotency"].metrics.snapshot()["replayed_from_cache"]
    assert charge(rotated, "k1").data == first.data
    snapshot = rotated.extensions["idempotency"].metrics.snapshot()
    assert snapshot["replayed_from_cache"] == from_cache_before + 1  # verified by the fallback
    assert seen.reasons == []

    forgotten = make(SECRET_KEY="the-new-secret")  # the old secret dropped
    seen = watch(forgotten)
    r.set(redis_key(cache_of(forgotten), rkey("k2")), b"")  # (an empty value: another kind of junk)
    charge(old, "k3")
    assert charge(forgotten, "k3").headers["Idempotent-Replayed"] == "true"  # from PostgreSQL
    assert seen.reasons == ["unverified"]
    assert forgotten.extensions["idempotency"].metrics.snapshot()["replayed_from_cache"] == 0


def test_an_authentic_entry_past_its_records_expiry_is_a_miss(
    make: MakeApp, r: redis.Redis[bytes]
) -> None:
    """Re-planted after its record expired (captured earlier, set again without a
    TTL): the expiry is inside what the tag covers."""
    app = make()
    seen = watch(app)
    charge(app, "k1")
    cache = cache_of(app)
    target = redis_key(cache, rkey("k1"))
    ring = cache.keyring.get()
    assert ring is not None
    genuine = r.get(target)
    assert genuine is not None
    entry = codec.decode(ring.open(target.encode(), genuine))
    payload = codec.encode(
        entry.record.fingerprint,
        entry.record.response,
        expires_at=int(time.time() * 1000) - 1,
        compress_over=1 << 20,
    )
    r.set(target, ring.seal(target.encode(), payload))
    assert charge(app, "k1").headers["Idempotent-Replayed"] == "true"  # from PostgreSQL
    assert seen.reasons == ["expired"]
    with pytest.raises(Unauthentic):  # and the expiry cannot be moved without the key
        later = genuine[:4] + struct.pack(">Q", 2**63) + genuine[12:]
        ring.open(target.encode(), later)


def test_without_a_secret_there_is_no_redis_cache(
    clean_db: str, clean_redis: str, r: redis.Redis[bytes], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR, logger="flask_idempotency.cache"):
        app = build(clean_db, clean_redis, SECRET_KEY=None)
    try:
        assert any(
            rec.levelno == logging.ERROR and "no SECRET_KEY" in rec.getMessage()
            for rec in caplog.records
        )
        first = charge(app, "k1")
        again = charge(app, "k1")
        assert again.headers["Idempotent-Replayed"] == "true" and again.data == first.data
        snapshot = app.extensions["idempotency"].metrics.snapshot()
        assert (snapshot["replayed_from_cache"], snapshot["replayed_from_store"]) == (0, 1)
        assert r.keys("*") == []  # nothing was written to Redis

        result = app.test_cli_runner().invoke(args=["idempotency", "doctor"])
        line = next(x for x in result.output.splitlines() if " cache " in f"{x} ")
        assert line.startswith("FAIL") and "no SECRET_KEY" in line, result.output
    finally:
        app.extensions["idempotency"].close()

    with pytest.raises(ValueError):  # a malformed URL still stops the start, secret or not
        build(clean_db, "http://nope", SECRET_KEY=None)
