"""A store that cannot reach PostgreSQL, for outage tests on an app built against a
live one: the app's store is pointed at a port nothing listens on, and back."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from flask import Flask

from flask_idempotency.settings import Settings
from flask_idempotency.store.pool import EnginePool, build_engine

#: Nothing listens on the discard port: a connect is refused at once.
DEAD_DSN = "postgresql://postgres@127.0.0.1:9/none"


def dead_pool() -> EnginePool:
    engine = build_engine(
        Settings(database_url=DEAD_DSN, pool_size=2, pool_timeout=1.0, connect_timeout=2)
    )
    return EnginePool(engine, owned=True)


@contextmanager
def store_unreachable(app: Flask) -> Iterator[None]:
    """Within the block, the app's store connects to :data:`DEAD_DSN`."""
    store = app.extensions["idempotency"].store
    live, dead = store.pool, dead_pool()
    dead.observer = live.observer
    store.pool = dead
    try:
        yield
    finally:
        store.pool = live
        dead.close()


def make_unreachable(app: Flask) -> None:
    """From now on the app's store connects to :data:`DEAD_DSN`."""
    store = app.extensions["idempotency"].store
    dead = dead_pool()
    dead.observer = store.pool.observer
    store.pool.close()
    store.pool = dead
