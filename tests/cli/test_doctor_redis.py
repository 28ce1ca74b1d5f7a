"""The doctor's Redis checks on a throwaway redis-server reconfigured with CONFIG SET
(never the run's shared Redis): reachable, eviction policy, memory headroom."""

from __future__ import annotations

import redis

from flask_idempotency.cli.doctor.base import FAIL, OK, WARN
from support.redis_server import ThrowawayRedis

from .doctoring import app_on, check, checks


def configure(server: ThrowawayRedis, **settings: object) -> redis.Redis:  # type: ignore[type-arg]
    client = redis.Redis.from_url(server.url)
    for name, value in settings.items():
        client.config_set(name.replace("_", "-"), value)  # type: ignore[arg-type]
    return client


def test_no_maxmemory_is_fine_for_keys_that_all_expire(
    clean_db: str, throwaway_redis: ThrowawayRedis
) -> None:
    configure(throwaway_redis, maxmemory=0, maxmemory_policy="noeviction")
    with app_on(clean_db, IDEMPOTENCY_REDIS_URL=throwaway_redis.url) as app:
        found = checks(app)
    assert found["cache"].status == OK
    assert found["redis memory"].status == OK
    assert "no maxmemory" in found["redis memory"].detail


def test_noeviction_warns_and_fails_once_full_while_an_evicting_policy_passes(
    clean_db: str, throwaway_redis: ThrowawayRedis
) -> None:
    client = configure(throwaway_redis, maxmemory="512mb", maxmemory_policy="noeviction")
    with app_on(clean_db, IDEMPOTENCY_REDIS_URL=throwaway_redis.url) as app:
        found = check(app, "redis memory")
        assert found.status == WARN, found
        assert "maxmemory-policy noeviction: once full, writes are refused" in found.detail
        assert found.fix is not None and "volatile-lru" in found.fix

        used = int(client.info("memory")["used_memory"])
        client.config_set("maxmemory", used + 4096)  # full: within 95 %
        found = check(app, "redis memory")
        assert found.status == FAIL, found
        assert "full, every SET is refused (OOM)" in found.detail

        client.config_set("maxmemory-policy", "allkeys-lru")
        found = check(app, "redis memory")
        assert found.status == OK and "evicts when full" in found.detail, found

        client.config_set("maxmemory-policy", "volatile-lru")
        found = check(app, "redis memory")
        assert found.status == WARN and "only keys with a TTL can be evicted" in found.detail

        client.config_set("maxmemory", "512mb")
        assert check(app, "redis memory").status == OK
    client.close()


def test_an_unreachable_redis_warns_and_its_memory_is_not_asked(
    clean_db: str, throwaway_redis: ThrowawayRedis
) -> None:
    url = throwaway_redis.url
    throwaway_redis.stop()
    with app_on(clean_db, IDEMPOTENCY_REDIS_URL=url) as app:
        found = checks(app)
    assert found["cache"].status == WARN
    assert "redis memory" not in found
