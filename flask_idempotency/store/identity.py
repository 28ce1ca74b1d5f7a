"""The database's identity: a random id migration 0011 writes once.

The Redis cache derives its keys' namespace and the key that seals its entries
from it (``cache/keyring.py``), so two deployments sharing one Redis stay apart.
It never changes, so the cache reads it once per process.
"""

from __future__ import annotations

from typing import Any

#: The id (``schema/0011_deployment_identity.sql``), made here if its row is gone
#: (a ``TRUNCATE`` of the extension's tables): ``migrate`` would not make it
#: again, its ledger says 0011 is applied, and without an id the cache stays off.
#: Usually nothing is inserted and this is one index read. Two processes that
#: find the row gone at once: one inserts, the other's insert waits for it and
#: does nothing, and its statement's snapshot, older than that row, sees none;
#: a second statement, with a snapshot of its own, does.
DEPLOYMENT_ID = """
WITH made AS (
    INSERT INTO idempotency_deployment (id)
    SELECT decode(md5(random()::text || random()::text || clock_timestamp()::text
                      || pg_backend_pid()::text), 'hex')
    WHERE NOT EXISTS (SELECT FROM idempotency_deployment)
    ON CONFLICT (only_row) DO NOTHING
    RETURNING id
)
SELECT id FROM made UNION ALL SELECT id FROM idempotency_deployment
"""


def database_identity(store: Any) -> bytes:
    """The id, under the store's timeouts (``StoreUnavailableError`` while
    PostgreSQL does not answer, a schema error before migration 0011)."""
    for _ in range(2):  # the second read sees a row a concurrent first read made
        rows = store.read(DEPLOYMENT_ID)
        if rows:
            return bytes(rows[0][0])
    raise LookupError("idempotency_deployment has no row yet")
