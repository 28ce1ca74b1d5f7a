"""The doctor's checks of the services beside PostgreSQL: Redis and the broker.

Redis is only a cache here: it fails open, so a Redis that does not answer is
a warning. Its eviction policy is judged the same way: evicting our keys is
what a cache is for (``volatile-*`` and ``allkeys-*`` are fine, every key we
write has a TTL); ``noeviction`` with a ``maxmemory`` is the one that fails,
because once full every ``SET`` is refused (and any other writer sharing the
server is refused with it).
"""

from __future__ import annotations

from typing import Any

from ...cache.keyring import secrets_from_config
from .base import WARN, Check, Context, fail, ok, ping, warn

#: Share of ``maxmemory`` in use above which a ``noeviction`` Redis refuses writes
#: any minute now (and above which a ``volatile-*`` one may find nothing to evict).
FULL_SHARE = 0.95
#: Seconds the doctor waits for Redis (the cache's own timeout is tens of ms).
REDIS_TIMEOUT = 2.0


def configured(ctx: Context) -> bool:
    settings = ctx.state.settings
    return settings.redis_url is not None or settings.redis is not None


def cache(ctx: Context) -> Check:
    if not configured(ctx):
        return ok("no Redis configured: PostgreSQL answers every replay")
    if not secrets_from_config(ctx.app.config):
        # Redis is not trusted: without a secret to sign entries with, the cache is
        # off. Nothing breaks, which is why it must be said loudly here.
        return fail(
            "Redis is configured but the app has no SECRET_KEY: the Redis cache is off "
            "(cached answers are signed with a key derived from it), PostgreSQL answers "
            "every replay",
            "set SECRET_KEY, the same on every worker (SECRET_KEY_FALLBACKS for rotation)",
        )
    # Whatever redis-py raises is a warning: the cache fails open anyway.
    return ping(
        "Redis",
        lambda: _client(ctx).ping(),
        reason=lambda exc: f" ({type(exc).__name__}); replays fall back to PostgreSQL",
        fix="check IDEMPOTENCY_REDIS_URL and the server",
        status=WARN,
    )


def _client(ctx: Context) -> Any:
    """A client with a timeout an operator can wait for: the app's own
    (``IDEMPOTENCY_REDIS``) as it is, else one built from the URL."""

    def build() -> Any:
        settings = ctx.state.settings
        if settings.redis is not None:
            return settings.redis
        import redis

        client = redis.Redis.from_url(
            str(settings.redis_url),
            socket_timeout=REDIS_TIMEOUT,
            socket_connect_timeout=REDIS_TIMEOUT,
        )
        ctx.closers.append(client.close)
        return client

    return ctx.once("redis client", build)


def redis_memory(ctx: Context) -> Check | None:
    """``maxmemory-policy`` and the headroom under ``maxmemory``, from ``INFO memory``
    (which managed services answer even where ``CONFIG`` is renamed away)."""
    if not configured(ctx):
        return None
    info = _client(ctx).info("memory")
    policy = str(info.get("maxmemory_policy", "unknown"))
    used = int(info.get("used_memory", 0))
    limit = int(info.get("maxmemory", 0))
    if limit == 0:
        return ok(f"no maxmemory ({_mib(used)} used): keys leave by their TTL only")
    share = used / limit
    figures = f"{_mib(used)} of {_mib(limit)} ({share:.0%}), maxmemory-policy {policy}"
    if policy == "noeviction" and share >= FULL_SHARE:
        return fail(
            f"{figures}: full, every SET is refused (OOM): the cache stops filling "
            "and so does every other writer of this server",
            "CONFIG SET maxmemory-policy volatile-lru (or allkeys-lru for a Redis "
            "that is only a cache), or raise maxmemory",
        )
    if policy == "noeviction":
        return warn(
            f"{figures}: once full, writes are refused instead of old keys evicted",
            "CONFIG SET maxmemory-policy volatile-lru (or allkeys-lru)",
        )
    if policy.startswith("volatile") and share >= FULL_SHARE:
        return warn(
            f"{figures}: full, and only keys with a TTL can be evicted; if keys without "
            "one fill it, writes are refused",
            "raise maxmemory, or give the other keys a TTL",
        )
    return ok(f"{figures}: evicts when full, as a cache should")


def _mib(size: int) -> str:
    return f"{size / 1048576:.1f} MiB"


def broker(ctx: Context) -> Check:
    url = ctx.state.settings.broker_url
    if not url:
        return ok("no broker configured (the relay needs one to publish)")
    from ...events.amqp import connect, redact  # the broker client, only when asked

    def reach() -> None:
        with connect(url, timeout=3.0) as connection:
            connection.ensure_connection(max_retries=1)

    return ping(
        redact(url),
        reach,
        reason=lambda exc: f" ({type(exc).__name__})",
        fix="check IDEMPOTENCY_BROKER_URL and the broker",
    )
