"""Optional fast path: a cache of completed responses in front of PostgreSQL."""

from __future__ import annotations

import logging

from ..settings import Settings
from ..store.memory import is_memory_url
from .base import CachedRecord, NullCache, ResponseCache

log = logging.getLogger("flask_idempotency.cache")


def cache_from_settings(settings: Settings) -> ResponseCache:
    if settings.redis is None and settings.redis_url is None:
        return NullCache()
    if is_memory_url(settings.database_url):
        # A shared cache in front of one process's records would outlive them (a
        # restart forgets the records, not the copies): the cache is off.
        log.warning("idempotency: memory:// keeps no Redis cache; the Redis settings are unused")
        return NullCache()
    from .redis import RedisCache  # imported lazily: redis is an optional extra

    return RedisCache.from_settings(settings)


__all__ = ["CachedRecord", "NullCache", "ResponseCache", "cache_from_settings"]
