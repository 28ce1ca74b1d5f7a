"""``EnginePool.connection(discard=True)``: the connection never goes back to the pool.

``inspect_schema`` reads with it in ``init_app``, where an app built before a fork
must not leave its workers a socket of the parent's; an error the server answered
(not an outage) used to take the flag back and return the connection.
"""

from __future__ import annotations

import pytest
import sqlalchemy

from flask_idempotency.store.base import StoreUnavailableError
from flask_idempotency.store.pool import EnginePool


def _fail(pool: EnginePool, *, discard: bool) -> int:
    """The server process of the connection that failed."""
    with pytest.raises(StoreUnavailableError):
        with pool.connection(discard=discard) as conn, conn.cursor() as cur:
            cur.execute("SELECT pg_backend_pid()")
            pid: int = cur.fetchone()[0]
            cur.execute("SELECT 1/0")  # answered by a live server: not unreachable
    return pid


def _next_pid(pool: EnginePool) -> int:
    with pool.connection() as conn, conn.cursor() as cur:
        cur.execute("SELECT pg_backend_pid()")
        pid: int = cur.fetchone()[0]
        return pid


def test_a_connection_to_discard_is_discarded_after_an_answered_error_too(
    database_url: str,
) -> None:
    engine = sqlalchemy.create_engine(database_url, pool_size=1, max_overflow=0)
    try:
        pool = EnginePool(engine)
        assert _fail(pool, discard=True) != _next_pid(pool)  # closed, a new one made
        # The same error keeps an ordinary connection for the next checkout.
        assert _fail(pool, discard=False) == _next_pid(pool)
    finally:
        engine.dispose()
