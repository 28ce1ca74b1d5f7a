"""``python -m benchmarks.hot_completion``: what the HOT completion saves.

A row-mode first request writes its record twice: the claim inserts it, the
completion updates it. Until migration 0009 that update was never HOT
(heap-only): it changed ``state``, ``lease_expires_at`` and ``recovery``, which
the recoverable-claims index named (its key and its ``WHERE``), and
``expires_at``, which the purge's index is on. So each completion wrote a new
entry into every index of the table, where a HOT update writes none.

This probe measures the difference, on two copies of the records table made
for it (``LIKE idempotency_records INCLUDING ALL``, dropped at the end):

* ``before``: the indexes of migration 0006 (the recoverable-claims index on
  ``lease_expires_at``), the ``CHECK`` on ``state``, the default fill factor,
  and the completion moving ``expires_at`` a whole TTL past itself, as before
  0009;
* ``now``: the table as the installed schema has it (indexes, fill factor),
  and the completion as the library sends it.

A first request is the library's own statements, prepared as it prepares them
and pointed at a copy: the new key's claim (committed on its own,
asynchronously), the business ``INSERT``, and the completion with the
``COMMIT``, next to ``bare`` (``BEGIN``, ``INSERT``, ``COMMIT``). All of
it runs on one connection, so on one PostgreSQL backend, interleaved in
chunks, rounds rotated; the backend's CPU comes from ``/proc/PID/schedstat``
(nanoseconds), so run it on the database's machine, with
``BENCH_DATABASE_URL``::

    python -m benchmarks.hot_completion --rounds 30

It prints each sequence's backend CPU per first request, its difference to
``bare``, and the share of each copy's updates that were HOT.
"""

from __future__ import annotations

import argparse
import hashlib
import secrets
from collections.abc import Callable

import psycopg2

from flask_idempotency.store import sql

from .app import INSERT_CHARGE, database_url, prepare_database
from .claim_shapes import BODY, HEADERS, TIMEOUTS, bare, interleaved, report

#: The copies of the records table, by sequence name.
TABLES = {"before": "bench_records_before", "now": "bench_records_now"}
#: The completion's ``SET`` item that moves ``expires_at`` (migration 0009), and
#: what it was before.
EXPIRY_NOW = "expires_at = greatest(expires_at, now() + (expires_at - created_at) * 0.9)"
EXPIRY_BEFORE = "expires_at = greatest(expires_at, now() + (expires_at - created_at))"
#: The ``CHECK`` on ``state`` of migration 0001, for the ``before`` copy.
CHECK_BEFORE = "ALTER TABLE {table} ADD CHECK (state IN ('processing', 'completed'))"
#: The recoverable-claims index of migration 0006, for the ``before`` copy.
INDEX_BEFORE = (
    "CREATE INDEX ON {table} (lease_expires_at) WHERE state = 'processing' AND recovery IS NOT NULL"
)


def prepare_on(table: str, *, before: bool) -> str:
    """The library's prepared statements (``sql.PREPARE_CLAIM``: the claims and the
    completion) on a copy of the records table, named after the copy; with
    ``before``, the completion moves ``expires_at`` as it did before migration 0009."""
    prepare = sql.PREPARE_CLAIM.replace("idempotency_records", table)
    prepare = prepare.replace("PREPARE idempotency_", f"PREPARE {table}_")
    if EXPIRY_NOW not in prepare:
        raise RuntimeError("the completion's expires_at changed: update this probe")
    return prepare.replace(EXPIRY_NOW, EXPIRY_BEFORE) if before else prepare


def executed_on(table: str, statement: str) -> str:
    """One of the library's ``EXECUTE``s (``sql.EXECUTE_CLAIM_NEW``,
    ``sql.EXECUTE_COMPLETE``), of the statements ``prepare_on(table)`` prepared."""
    return statement.replace("EXECUTE idempotency_", f"EXECUTE {table}_")


def create_copies(cur: psycopg2.extensions.cursor) -> None:
    cur.execute("SELECT reloptions FROM pg_class WHERE relname = 'idempotency_records'")
    row = cur.fetchone()
    options = ", ".join(row[0]) if row and row[0] else ""
    for table in TABLES.values():
        cur.execute(f"DROP TABLE IF EXISTS {table}")
        cur.execute(f"CREATE TABLE {table} (LIKE idempotency_records INCLUDING ALL)")
    if options:  # (LIKE copies no storage parameters)
        cur.execute(f"ALTER TABLE {TABLES['now']} SET ({options})")
    # The copy of the recovery index is the partial one; find it by its WHERE.
    before = TABLES["before"]
    cur.execute(
        "SELECT indexname FROM pg_indexes WHERE tablename = %s AND indexdef LIKE '%%WHERE%%'",
        (before,),
    )
    for (index,) in cur.fetchall():
        cur.execute(f"DROP INDEX {index}")
    cur.execute(INDEX_BEFORE.format(table=before))
    cur.execute(CHECK_BEFORE.format(table=before))


def hot_shares(cur: psycopg2.extensions.cursor) -> dict[str, float]:
    """Each copy's HOT updates, as a share of its updates (the statistics flushed first)."""
    cur.execute("SELECT pg_stat_force_next_flush()")
    cur.execute("SELECT 1")  # (the flush happens as the backend goes idle)
    found = {}
    for name, table in TABLES.items():
        cur.execute(
            "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relname = %s",
            (table,),
        )
        updated, hot = cur.fetchone() or (0, 0)
        found[name] = hot / updated if updated else 0.0
    return found


def sequences(cur: psycopg2.extensions.cursor) -> dict[str, Callable[[], None]]:
    def first_request(table: str, *, before: bool) -> Callable[[], None]:
        cur.execute(prepare_on(table, before=before))
        claim = TIMEOUTS + sql.ASYNC_COMMIT_PREFIX + executed_on(table, sql.EXECUTE_CLAIM_NEW)
        complete = TIMEOUTS + executed_on(table, sql.EXECUTE_COMPLETE) + ";\nCOMMIT"

        def run() -> None:
            key, token = hashlib.sha256(secrets.token_bytes(16)).digest(), secrets.randbits(62)
            params = {"key": key, "fp": key, "token": token, "lease": 30.0, "ttl": 86400.0,
                      "recovery": None}  # fmt: skip
            cur.execute(claim, params)
            row = cur.fetchone()
            if row is None or row[0] is not True:
                raise RuntimeError("a new key's claim claimed nothing")
            cur.execute("BEGIN;\n" + INSERT_CHARGE, (1000, "usd"))
            cur.fetchone()
            cur.execute(complete, (key, token, 201, HEADERS, BODY))

        return run

    return {
        "bare": bare(cur),
        "before": first_request(TABLES["before"], before=True),
        "now": first_request(TABLES["now"], before=False),
    }


def measure(dsn: str, rounds: int, chunk: int) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Per sequence, its backend CPU per first request in each round (us); per copy,
    the share of its updates that were HOT. The copies are dropped at the end."""
    prepare_database(dsn, [])  # the business table, and the records table to copy
    conn = psycopg2.connect(dsn)
    conn.autocommit = True
    try:
        cur = conn.cursor()
        create_copies(cur)
        found = interleaved(conn.get_backend_pid(), sequences(cur), rounds, chunk)
        return found, hot_shares(cur)
    finally:
        try:
            with conn.cursor() as cur:
                for table in TABLES.values():
                    cur.execute(f"DROP TABLE IF EXISTS {table}")
        finally:
            conn.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.hot_completion", description=__doc__
    )
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--chunk", type=int, default=200, help="requests per turn")
    args = parser.parse_args(argv)
    found, shares = measure(database_url(), args.rounds, args.chunk)
    notes = {name: f"  HOT updates {share:.0%}" for name, share in shares.items()}
    report(found, args.rounds, args.chunk, notes)


if __name__ == "__main__":
    main()
