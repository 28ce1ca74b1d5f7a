"""The cache's Redis client: redis-py's own pool, shared safely by threads, and a
slow or restarted server that never mixes one command's reply into another's.

(These were tests of a hand-written per-thread connection layer; the cache now
goes through redis-py's public API, and the behaviours they pinned still hold.)
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from flask_idempotency.cache.redis import RedisCache
from flask_idempotency.settings import Settings
from flask_idempotency.store.base import StoredResponse
from support.servers import ProxyFactory, ThrowawayRedis

from .caches import standalone

FINGERPRINT = b"f" * 32


def stored(body: bytes) -> StoredResponse:
    return StoredResponse(201, (("Content-Type", "text/plain"),), body)


def body_of(cache: RedisCache, key: bytes) -> bytes | None:
    hit = cache.get(key)
    return None if hit is None else hit.response.body


@pytest.fixture
def cache(clean_redis: str) -> Iterator[RedisCache]:
    built = standalone(Settings(database_url="unused", redis_url=clean_redis, redis_timeout=0.5))
    yield built
    built.close()


def test_threads_share_the_cache_and_never_read_each_others_replies(cache: RedisCache) -> None:
    errors: list[str] = []
    start = threading.Barrier(8)

    def work(n: int) -> None:
        start.wait()
        for i in range(40):
            key = b"%02d-%03d" % (n, i) + b"k" * 26
            cache.put(key, FINGERPRINT, stored(key), 60)
            if body_of(cache, key) != key:
                errors.append(f"thread {n} step {i}")

    threads = [threading.Thread(target=work, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert cache.breaker.state.value == "closed"


def test_a_timed_out_reply_is_never_read_as_the_next_commands(
    clean_redis: str, tcp_proxy: ProxyFactory
) -> None:
    """A GET that times out leaves its reply in flight; redis-py drops that socket,
    so the late reply can never be taken for the answer to the next GET."""
    proxy = tcp_proxy(clean_redis)
    cache = standalone(
        Settings(
            database_url="unused",
            redis_url=proxy.url,
            redis_timeout=0.2,
            redis_breaker_threshold=100,
        )
    )
    first, second = b"1" * 32, b"2" * 32
    try:
        cache.put(first, FINGERPRINT, stored(b"first"), 60)
        cache.put(second, FINGERPRINT, stored(b"second"), 60)
        proxy.stall()
        assert cache.get(first) is None  # timed out: a miss
        proxy.resume()  # the held GET reaches Redis and its reply flows back, late
        for _ in range(5):
            assert body_of(cache, second) == b"second"
            assert body_of(cache, first) == b"first"
    finally:
        cache.close()


def test_a_restarted_redis_is_used_again_without_opening_the_breaker() -> None:
    with ThrowawayRedis() as server:
        cache = standalone(
            Settings(database_url="unused", redis_url=server.url, redis_breaker_threshold=2)
        )
        key = b"k" * 32
        try:
            cache.put(key, FINGERPRINT, stored(b"before"), 60)
            assert body_of(cache, key) == b"before"
            server.restart()  # the pooled socket is now dead; the server is empty
            misses = [body_of(cache, key) for _ in range(3)]
            assert misses == [None, None, None]
            assert cache.breaker.state.value == "closed", "a stale socket is not an outage"
            cache.put(key, FINGERPRINT, stored(b"after"), 60)
            assert body_of(cache, key) == b"after"
        finally:
            cache.close()
