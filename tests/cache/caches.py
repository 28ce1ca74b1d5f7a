"""Caches the tests build themselves, sealed the way an application's would be."""

from __future__ import annotations

import functools
from typing import Any

from flask import Flask

from flask_idempotency.cache.redis import RedisCache
from flask_idempotency.settings import Settings
from flask_idempotency.store.identity import database_identity

#: The test apps' ``SECRET_KEY``: what an attacker without it cannot sign with.
SECRET = "test-secret-of-the-cache-tests"
#: The database identity of a cache built without a database.
IDENTITY = bytes(range(16))


def standalone(settings: Settings, **options: Any) -> RedisCache:
    """A cache of ``settings`` with no database behind it (a fixed identity)."""
    return RedisCache(settings, secrets=[SECRET.encode()], identity=lambda: IDENTITY, **options)


def redis_key(cache: RedisCache, record_key: bytes) -> str:
    """The Redis key of a record's entry: ``{prefix}:{<database identity>}:{<hex>}``."""
    ring = cache.keyring.get()
    assert ring is not None, "the database's identity is not known yet"
    return f"{cache.prefix}:{ring.namespace}:{{{record_key.hex()}}}"


def rebuilt(app: Flask, **options: Any) -> RedisCache:
    """A new cache for ``app``, as ``init_app`` builds it (its secret, its database)."""
    state = app.extensions["idempotency"]
    return RedisCache(
        state.settings,
        secrets=[str(app.config["SECRET_KEY"]).encode()],
        identity=functools.partial(database_identity, state.store),
        **options,
    )
