"""``python -m benchmarks.claim_shapes``: old and new claim and completion statements.

A first request's claim and completion, in both claim modes, sent as the
library sends them now (a new key's ``CLAIM_NEW_BODY``, the completions
prepared) and as it sent them before (the full claim, the completion
function's call; the transaction mode's calls parsed each time), next to
``bare`` (``BEGIN``, ``INSERT``, ``COMMIT``). Everything runs on one
connection, so on one PostgreSQL backend, interleaved in chunks, rounds
rotated: the backend's CPU (``/proc/PID/schedstat``, nanoseconds) is compared
within the same process and the same minutes. Run it on the database's
machine, with ``BENCH_DATABASE_URL``::

    python -m benchmarks.claim_shapes --rounds 30
"""

from __future__ import annotations

import argparse
import hashlib
import random
import secrets
import statistics
from collections.abc import Callable

import psycopg2

from flask_idempotency.store import sql

from .app import INSERT_CHARGE, database_url, prepare_database

HEADERS = '[["Content-Type", "application/json"]]'
BODY = b'{"amount": 1000, "currency": "usd", "id": 123456, "status": "succeeded"}'
TIMEOUTS = sql.timeouts_sql(5.0, 2.0)


def backend_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/schedstat") as stat:
        return int(stat.read().split()[0]) / 1e9


def bare(cur: psycopg2.extensions.cursor) -> Callable[[], None]:
    """``BEGIN``, the business ``INSERT``, ``COMMIT``: the baseline every probe subtracts."""

    def run() -> None:
        cur.execute("BEGIN;\n" + INSERT_CHARGE, (1000, "usd"))
        cur.fetchone()
        cur.execute("COMMIT")

    return run


def interleaved(
    pid: int, runs: dict[str, Callable[[], None]], rounds: int, chunk: int
) -> dict[str, list[float]]:
    """Each sequence's backend CPU per run (us) in each round, on the backend ``pid``:
    every sequence warmed first, then taken ``chunk`` runs at a time in turn, the
    order rotated each round, so a slow minute falls on all of them alike."""
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
    return found


def report(
    found: dict[str, list[float]], rounds: int, chunk: int, notes: dict[str, str] | None = None
) -> None:
    """Each sequence's median and its difference to ``bare``, with its note if any."""
    base = statistics.median(found["bare"])
    print(f"backend CPU per first request, medians of {rounds} rounds of {chunk}")
    for name, figures in found.items():
        median = statistics.median(figures)
        note = (notes or {}).get(name, "")
        print(f"{name:<22}{median:8.1f} us  {median - base:+8.1f} over bare{note}")


def sequences(cur: psycopg2.extensions.cursor) -> dict[str, Callable[[], None]]:
    def row(claim: str, complete: str) -> Callable[[], None]:
        def first_request() -> None:
            key, token = hashlib.sha256(secrets.token_bytes(16)).digest(), random.getrandbits(62)
            params = {"key": key, "fp": key, "token": token, "lease": 30.0, "ttl": 86400.0,
                      "recovery": None}  # fmt: skip
            cur.execute(TIMEOUTS + sql.ASYNC_COMMIT_PREFIX + claim, params)
            cur.fetchall()
            cur.execute("BEGIN;\n" + INSERT_CHARGE, (1000, "usd"))
            cur.fetchone()
            cur.execute(TIMEOUTS + complete + ";\nCOMMIT", (key, token, 201, HEADERS, BODY))

        return first_request

    def transaction(claim: str, complete: str) -> Callable[[], None]:
        def first_request() -> None:
            key = hashlib.sha256(secrets.token_bytes(16)).digest()
            cur.execute(claim, (key, random.getrandbits(62), random.getrandbits(62)))
            cur.fetchall()
            cur.execute(INSERT_CHARGE, (1000, "usd"))
            cur.fetchone()
            cur.execute(TIMEOUTS + complete, (key, key, 86400.0, 201, HEADERS, BODY))

        return first_request

    return {
        "bare": bare(cur),
        "row, before": row(sql.EXECUTE_CLAIM, sql.COMPLETE),
        "row, now": row(sql.EXECUTE_CLAIM_NEW, sql.EXECUTE_COMPLETE),
        "transaction, before": transaction(sql.CLAIM_IN_TRANSACTION, sql.INSERT_COMPLETED),
        "transaction, now": transaction(
            "BEGIN;\n" + sql.EXECUTE_CLAIM_IN_TRANSACTION, sql.EXECUTE_INSERT_COMPLETED
        ),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.claim_shapes", description=__doc__)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--chunk", type=int, default=200, help="requests per turn")
    args = parser.parse_args(argv)
    dsn = database_url()
    prepare_database(dsn, [])
    conn = psycopg2.connect(dsn)
    conn.autocommit = True
    try:
        cur = conn.cursor()
        cur.execute(sql.PREPARE_CLAIM)
        cur.execute("BEGIN;\n" + sql.PREPARE_CLAIM_IN_TRANSACTION + "COMMIT")
        found = interleaved(conn.get_backend_pid(), sequences(cur), args.rounds, args.chunk)
    finally:
        conn.close()
    report(found, args.rounds, args.chunk)


if __name__ == "__main__":
    main()
