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

A first request is the claim's ``INSERT`` (committed on its own,
asynchronously, as the library's), the business ``INSERT`` and the completion
with the ``COMMIT``, next to ``bare`` (``BEGIN``, ``INSERT``, ``COMMIT``). All of
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
import statistics
from collections.abc import Callable

import psycopg2

from .app import INSERT_CHARGE, database_url, prepare_database
from .claim_shapes import BODY, HEADERS, TIMEOUTS, backend_seconds

#: The copies of the records table, by sequence name.
TABLES = {"today": "bench_records_today", "hot": "bench_records_hot"}

CLAIM = """
SET LOCAL synchronous_commit TO off;
INSERT INTO {table}
    (record_key, fingerprint, state, lock_token, lease_expires_at, created_at, expires_at)
VALUES (%(key)s, %(key)s, 'processing', %(token)s, now() + interval '30 s', now(),
        now() + interval '1 day')
ON CONFLICT (record_key) DO NOTHING
RETURNING true
"""

#: The library's completion (``sql.COMPLETE_BODY``'s ``UPDATE``), on a copy.
COMPLETE_TODAY = """
UPDATE {table}
   SET state = 'completed', status_code = %(status)s, headers = %(headers)s, body = %(body)s,
       completed_at = now(), lock_token = NULL, lease_expires_at = NULL,
       expires_at = greatest(expires_at, now() + (expires_at - created_at)),
       recovery = NULL, phases = NULL
 WHERE record_key = %(key)s AND lock_token = %(token)s AND state = 'processing'
"""
#: The same, leaving ``expires_at`` alone: with no index on the columns it sets
#: (``state``, ``lease_expires_at``, ``recovery``), the update can be HOT.
COMPLETE_HOT = """
UPDATE {table}
   SET state = 'completed', status_code = %(status)s, headers = %(headers)s, body = %(body)s,
       completed_at = now(), lock_token = NULL, lease_expires_at = NULL,
       recovery = NULL, phases = NULL
 WHERE record_key = %(key)s AND lock_token = %(token)s AND state = 'processing'
"""


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
    def first_request(table: str, complete: str) -> Callable[[], None]:
        claim, complete = CLAIM.format(table=table), complete.format(table=table)

        def run() -> None:
            params = {
                "key": hashlib.sha256(secrets.token_bytes(16)).digest(),
                "token": secrets.randbits(62),
                "status": 201,
                "headers": HEADERS,
                "body": BODY,
            }
            cur.execute(TIMEOUTS + claim, params)
            if cur.fetchone() is None:
                raise RuntimeError("a new key's claim inserted nothing")
            cur.execute("BEGIN;\n" + INSERT_CHARGE, (1000, "usd"))
            cur.fetchone()
            cur.execute(TIMEOUTS + complete + ";\nCOMMIT", params)

        return run

    def bare() -> None:
        cur.execute("BEGIN;\n" + INSERT_CHARGE, (1000, "usd"))
        cur.fetchone()
        cur.execute("COMMIT")

    return {
        "bare": bare,
        "today": first_request(TABLES["today"], COMPLETE_TODAY),
        "hot": first_request(TABLES["hot"], COMPLETE_HOT),
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
        pid = conn.get_backend_pid()
        runs = sequences(cur)
        names = list(runs)
        found: dict[str, list[float]] = {name: [] for name in names}
        for name in names:
            for _ in range(50):
                runs[name]()  # warm: plans, caches
        for round_no in range(rounds):
            shift = round_no % len(names)
            for name in names[shift:] + names[:shift]:
                start = backend_seconds(pid)
                for _ in range(chunk):
                    runs[name]()
                found[name].append((backend_seconds(pid) - start) / chunk * 1e6)
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
    base = statistics.median(found["bare"])
    print(f"backend CPU per first request, medians of {args.rounds} rounds of {args.chunk}")
    for name, figures in found.items():
        median = statistics.median(figures)
        hot = f"  HOT updates {shares[name]:.0%}" if name in shares else ""
        print(f"{name:<8}{median:8.1f} us  {median - base:+8.1f} over bare{hot}")


if __name__ == "__main__":
    main()
