"""Optional fast path: a cache of completed responses in front of PostgreSQL."""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from typing import Any

from ..settings import Settings
from ..store.identity import database_identity
from ..store.memory import is_memory_url
from .base import CachedRecord, ResponseCache
from .keyring import secrets_from_config

log = logging.getLogger("flask_idempotency.cache")

#: Said at start, and by ``flask idempotency doctor``, when Redis is set up but
#: no secret is: the cache stays off rather than trust what Redis holds.
NO_SECRET = (
    "idempotency: Redis is configured but the app has no SECRET_KEY, so the Redis "
    "cache is OFF and PostgreSQL answers every replay: cached answers are signed "
    "with a key derived from SECRET_KEY, and an unsigned cache would let whoever "
    "can write to Redis decide what clients get. Set SECRET_KEY."
)


def cache_from_settings(settings: Settings, config: Mapping[str, Any], store: Any) -> ResponseCache:
    """The cache ``settings`` ask for, sealed with ``config``'s ``SECRET_KEY`` (and
    ``SECRET_KEY_FALLBACKS``) and ``store``'s database identity; or none."""
    if settings.redis is None and settings.redis_url is None:
        return ResponseCache()
    if is_memory_url(settings.database_url):
        # A shared cache in front of one process's records would outlive them (a
        # restart forgets the records, not the copies): the cache is off.
        log.warning("idempotency: memory:// keeps no Redis cache; the Redis settings are unused")
        return ResponseCache()
    try:
        from .redis import RedisCache, client_for_settings  # lazily: an optional extra
    except ModuleNotFoundError as exc:
        if exc.name != "redis":
            raise
        raise RuntimeError(
            "IDEMPOTENCY_REDIS_URL needs redis-py: pip install 'flask-idempotency[redis]'"
        ) from exc

    secrets = secrets_from_config(config)
    if not secrets:
        client, owned = client_for_settings(settings)  # a malformed URL still stops the start
        if owned:
            client.close()
        log.error(NO_SECRET)
        return ResponseCache()

    return RedisCache(
        settings, secrets=secrets, identity=functools.partial(database_identity, store)
    )


__all__ = ["CachedRecord", "ResponseCache", "cache_from_settings"]
