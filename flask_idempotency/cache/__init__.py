"""Optional fast path: a cache of completed responses in front of PostgreSQL."""

from __future__ import annotations

from ..settings import Settings
from .base import CachedRecord, NullCache, ResponseCache


def cache_from_settings(settings: Settings) -> ResponseCache:
    if settings.redis is None and settings.redis_url is None:
        return NullCache()
    from .redis import RedisCache  # imported lazily: redis is an optional extra

    return RedisCache.from_settings(settings)


__all__ = ["CachedRecord", "NullCache", "ResponseCache", "cache_from_settings"]
