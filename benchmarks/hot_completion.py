"""``python -m benchmarks.hot_completion``: what a HOT completion would save.

A row-mode first request writes its record twice: the claim inserts it, the
completion updates it. That update is never HOT (heap-only): it changes
``state``, ``lease_expires_at`` and ``recovery``, which the recoverable-claims
index names (its key and its ``WHERE``), and ``expires_at``, which the purge's
index is on. So each completion writes a new entry into every index of the
table, where a HOT update writes none.

This probe measures what that costs, on two copies of the records table made
for it (``LIKE idempotency_records INCLUDING ALL``, dropped at the end):

* ``today``: the same indexes, and the completion's ``SET`` list as the
  library sends it;
* ``hot``: without the recoverable-claims index, and a completion that leaves
  ``expires_at`` as the claim set it (a record would then live its TTL from its
  claim, not from its completion).

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
TABLES = {"today": "bench_records_today", "hot": "bench_records_hot"}
#: The completion's ``SET`` item that changes the purge index's column.
EXTEND_EXPIRY = "expires_at = greatest("


def prepare_on(table: str, *, keep_expiry: bool) -> str:
    """The library's prepared statements (``sql.PREPARE_CLAIM``: the claims and the
    completion) on a copy of the records table, named after the copy; with
    ``keep_expiry``, the completion without the ``SET`` item that moves ``expires_at``."""
    prepare = sql.PREPARE_CLAIM.replace("idempotency_records", table)
    prepare = prepare.replace("PREPARE idempotency_", f"PREPARE {table}_")
    if keep_expiry:
        kept = [line for line in prepare.splitlines() if EXTEND_EXPIRY not in line]
        if len(kept) == len(prepare.splitlines()):
            raise RuntimeError("the completion no longer moves expires_at: update this probe")
        prepare = "\n".join(kept)
    return prepare


def executed_on(table: str, statement: str) -> str:
    """One of the library's ``EXECUTE``s (``sql.EXECUTE_CLAIM_NEW``,
    ``sql.EXECUTE_COMPLETE``), of the statements ``prepare_on(table)`` prepared."""
    return statement.replace("EXECUTE idempotency_", f"EXECUTE {table}_")


def create_copies(cur: psycopg2.extensions.cursor) -> None:
    for table in TABLES.values():
        cur.execute(f"DROP TABLE IF EXISTS {table}")
        cur.execute(f"CREATE TABLE {table} (LIKE idempotency_records INCLUDING ALL)")
    # The copy of the partial index is named after its table; find it by its WHERE.
    cur.execute(
        "SELECT indexname FROM pg_indexes WHERE tablename = %s AND indexdef LIKE '%%WHERE%%'",
        (TABLES["hot"],),
    )
    for (index,) in cur.fetchall():
        cur.execute(f"DROP INDEX {index}")


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
    def first_request(table: str, *, keep_expiry: bool) -> Callable[[], None]:
        cur.execute(prepare_on(table, keep_expiry=keep_expiry))
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
        "today": first_request(TABLES["today"], keep_expiry=False),
        "hot": first_request(TABLES["hot"], keep_expiry=True),
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
