"""``python -m benchmarks.big_table``: the records table at ten million rows.

Issue 15 asks whether the store still behaves when the table is large:

* **claim and replay latency** through the library's own ``PostgresStore``
  (both claim modes) against an almost empty table and against ``--records``
  rows, interleaved in one run on one server, so the ratio is what counts;
* **purge**: the library's ``purge`` (what ``flask idempotency purge`` runs)
  over the expired part: rows per second, WAL bytes per row, and the p99 of
  first requests running at the same time against the p99 without it;
* **churn**: ``--churn-cycles`` cycles, each inserting a slice of short-lived
  records and purging the slice before it, with autovacuum at its defaults;
  table and index sizes after every cycle show whether DELETE-based purge
  keeps the table bounded or lets it bloat.

Everything runs on a throwaway PostgreSQL server of its own (durable defaults:
``fsync``, ``synchronous_commit = on``; ``max_wal_size = 4GB`` so the fill
is not one long checkpoint storm), never on the machine's shared one. The
server uses pgserver's binaries, or the machine's when those are missing, as
the test suite does. ``--records 10000`` is a smoke run of a few seconds
(``tests/bench/test_bench_big_table.py``).
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg2

from flask_idempotency.settings import Settings
from flask_idempotency.store.base import Claimed, Existing, StoredResponse
from flask_idempotency.store.postgres import PostgresStore

REPO_ROOT = Path(__file__).resolve().parent.parent

#: A realistic stored answer: a charge of about 300 bytes, and its headers.
BODY = (
    b'{"id": "ch_3PqQ4nHgLJ0a9fMt1xYz", "object": "charge", "amount": 2500, '
    b'"currency": "eur", "customer": "cus_Q8r2mZk1Ls9dVx", "description": null, '
    b'"status": "succeeded", "created": 1732454400, "payment": "py_8fN2kq0ZbV7s", '
    b'"metadata": {"order": "ord_1029384756"}, "livemode": false, "refunded": false}'
)
HEADERS = (("Content-Type", "application/json"), ("Request-Id", "req_9Xk2Lm4Pq8Rt"))
RESPONSE = StoredResponse(201, HEADERS, BODY)
#: Server settings beyond the throwaway server's: only what a large fill needs.
SERVER_SETTINGS = {"max_wal_size": "4GB", "checkpoint_timeout": "15min"}

# The fill, in SQL: record keys are SHA-256 digests of realistic scope and key
# text (as digests.record_key makes them); 60 % completed and live, 35 % expired
# (completed or processing, up to a day ago), 5 % processing with a dead lease.
FILL = """
INSERT INTO idempotency_records
    (record_key, fingerprint, state, lock_token, lease_expires_at, created_at,
     expires_at, completed_at, status_code, headers, body)
SELECT sha256(convert_to('apikey:' || (i %% 5000) || chr(31) || 'order-' || i || '-' || %(salt)s,
                         'UTF8')),
       sha256(convert_to('POST /v1/charges ' || i, 'UTF8')),
       CASE WHEN i %% 20 = 0 THEN 'processing' ELSE 'completed' END,
       CASE WHEN i %% 20 = 0 THEN i END,
       CASE WHEN i %% 20 = 0 THEN now() - interval '1 minute' END,
       now() - interval '1 hour',
       CASE WHEN i %% 100 < 35 THEN now() - (i %% 86400) * interval '1 second'
            ELSE now() + (1 + i %% 86400) * interval '1 second' END,
       CASE WHEN i %% 20 = 0 THEN NULL ELSE now() - interval '1 hour' END,
       CASE WHEN i %% 20 = 0 THEN NULL ELSE 201 END,
       CASE WHEN i %% 20 = 0 THEN NULL ELSE %(headers)s::jsonb END,
       CASE WHEN i %% 20 = 0 THEN NULL ELSE %(body)s END
  FROM generate_series(%(start)s::bigint, %(stop)s::bigint) AS i
"""
#: Churn: a slice of records that expire at once (the oldest hour of a day's TTL).
CHURN = """
INSERT INTO idempotency_records
    (record_key, fingerprint, state, created_at, expires_at, completed_at,
     status_code, headers, body)
SELECT sha256(convert_to('churn:' || %(cycle)s || ':' || i, 'UTF8')),
       sha256(convert_to('fp' || i, 'UTF8')), 'completed', now(), now(), now(),
       201, %(headers)s::jsonb, %(body)s
  FROM generate_series(1, %(rows)s::bigint) AS i
"""
SIZES = """
SELECT pg_relation_size('idempotency_records'),
       pg_indexes_size('idempotency_records'),
       pg_total_relation_size('idempotency_records'),
       (SELECT n_live_tup FROM pg_stat_user_tables WHERE relname = 'idempotency_records'),
       (SELECT n_dead_tup FROM pg_stat_user_tables WHERE relname = 'idempotency_records'),
       (SELECT autovacuum_count FROM pg_stat_user_tables WHERE relname = 'idempotency_records')
"""


def headers_json() -> str:
    import json

    return json.dumps([list(pair) for pair in HEADERS])


Params = Sequence[Any] | Mapping[str, Any] | None


def execute(dsn: str, sql: str, params: Params = None, *, fetch: bool = False) -> list[Any]:
    conn = psycopg2.connect(dsn)
    conn.autocommit = True  # VACUUM and CREATE DATABASE refuse a transaction block
    try:
        with conn.cursor() as cur:
            cur.execute(sql, params)
            return list(cur.fetchall()) if fetch else []
    finally:
        conn.close()


def fill(dsn: str, records: int, salt: str, chunk: int = 1_000_000) -> float:
    """Insert ``records`` rows in chunks of ``chunk``; returns seconds."""
    started = time.monotonic()
    params = {"salt": salt, "headers": headers_json(), "body": psycopg2.Binary(BODY)}
    for start in range(1, records + 1, chunk):
        stop = min(start + chunk - 1, records)
        execute(dsn, FILL, params | {"start": start, "stop": stop})
        rate = stop / (time.monotonic() - started)
        print(f"  filled {stop:,} of {records:,} ({rate:,.0f} rows/s)", flush=True)
    return time.monotonic() - started


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class Latencies:
    """Milliseconds per operation, by (table, mode, operation)."""

    samples: dict[tuple[str, str, str], list[float]] = field(default_factory=dict)

    def add(self, table: str, mode: str, op: str, ms: float) -> None:
        self.samples.setdefault((table, mode, op), []).append(ms)


def first_request(store: PostgresStore, key: bytes) -> None:
    """What a first request does: claim, BEGIN (the view asks for the connection),
    the completion with its COMMIT."""
    request = store.begin()
    try:
        claimed = request.claim(key, b"fp", lease=30, ttl=86400)
        assert isinstance(claimed, Claimed), claimed
        request.connection()
        request.complete(key, claimed.token, RESPONSE)
    finally:
        request.close()


def replay(store: PostgresStore, key: bytes) -> None:
    """What a replay from PostgreSQL does: the claim finds the completed record."""
    request = store.begin()
    try:
        found = request.claim(key, b"fp", lease=30, ttl=86400)
        assert isinstance(found, Existing) and found.response is not None, found
    finally:
        request.close()


class KeyMaker:
    """Fresh record keys, never repeated across threads."""

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix
        self._n = 0
        self._lock = threading.Lock()

    def __call__(self) -> bytes:
        with self._lock:
            self._n += 1
            n = self._n
        return hashlib.sha256(f"{self._prefix}:{n}".encode()).digest()


def run_threads(threads: int, work: Callable[[int], None]) -> None:
    workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()


def measure_latency(
    stores: dict[tuple[str, str], PostgresStore],
    *,
    threads: int,
    per_block: int,
    rounds: int,
) -> Latencies:
    """Blocks of first requests and replays on each (table, mode), interleaved
    round by round, ``threads`` at a time."""
    found = Latencies()
    new_key = KeyMaker(f"latency-{time.time()}")
    for round_no in range(rounds):
        order = list(stores.items())
        if round_no % 2:
            order.reverse()
        for (table, mode), store in order:
            replay_keys = [new_key() for _ in range(threads)]
            for key in replay_keys:
                first_request(store, key)

            def work(
                i: int,
                store: PostgresStore = store,
                table: str = table,
                mode: str = mode,
                replay_keys: list[bytes] = replay_keys,
            ) -> None:
                replay_key = replay_keys[i]
                for _ in range(per_block):
                    key = new_key()
                    t0 = time.perf_counter()
                    first_request(store, key)
                    t1 = time.perf_counter()
                    replay(store, replay_key)
                    t2 = time.perf_counter()
                    found.add(table, mode, "first", (t1 - t0) * 1e3)
                    found.add(table, mode, "replay", (t2 - t1) * 1e3)

            run_threads(threads, work)
    return found


@contextmanager
def background_first_requests(store: PostgresStore, threads: int) -> Iterator[list[float]]:
    """First requests in a loop from ``threads`` threads until the block ends;
    yields the list their latencies (ms) are appended to."""
    latencies: list[float] = []
    stop = threading.Event()
    new_key = KeyMaker(f"background-{time.time()}")

    def loop(_: int) -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            first_request(store, new_key())
            latencies.append((time.perf_counter() - t0) * 1e3)

    runner = threading.Thread(target=run_threads, args=(threads, loop))
    runner.start()
    try:
        yield latencies
    finally:
        stop.set()
        runner.join()


def wal_lsn(dsn: str) -> str:
    return str(execute(dsn, "SELECT pg_current_wal_lsn()", fetch=True)[0][0])


def wal_bytes(dsn: str, since: str) -> int:
    rows = execute(dsn, "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s)", (since,), fetch=True)
    return int(rows[0][0])


def purge_all(store: PostgresStore, batch_size: int) -> int:
    return sum(len(keys) for keys in store.purge(batch_size))


def sizes(dsn: str) -> dict[str, float]:
    """Relation sizes, the exact row count, and the statistics' dead tuples and
    autovacuum count (those two lag by up to a second or so)."""
    heap, indexes, total, _, dead, autovacuums = execute(dsn, SIZES, fetch=True)[0]
    live = execute(dsn, "SELECT count(*) FROM idempotency_records", fetch=True)[0][0]
    return {
        "heap_mb": heap / 2**20,
        "indexes_mb": indexes / 2**20,
        "total_mb": total / 2**20,
        "rows": float(live or 0),
        "dead": float(dead or 0),
        "autovacuums": float(autovacuums or 0),
    }


def start_server() -> object:
    sys.path.insert(0, str(REPO_ROOT / "tests"))
    from support.postgres_server import ThrowawayPostgres

    return ThrowawayPostgres(settings=SERVER_SETTINGS).start()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.big_table", description=__doc__)
    parser.add_argument("--records", type=int, default=10_000_000)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--per-block", type=int, default=100, help="operations per thread")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=1000, help="purge's, as the CLI's")
    parser.add_argument("--churn-cycles", type=int, default=24)
    parser.add_argument(
        "--churn-rows", type=int, default=0, help="rows per cycle (default: records / 24)"
    )
    parser.add_argument(
        "--vacuum-every",
        type=int,
        default=0,
        help="run a plain VACUUM every N churn cycles: an autovacuum that keeps pace "
        "(the compressed churn is far faster than autovacuum's once-a-minute nap)",
    )
    parser.add_argument(
        "--autovacuum",
        default="",
        help="storage parameters for the churn, e.g. "
        "'autovacuum_vacuum_scale_factor=0.01,autovacuum_vacuum_cost_delay=0' (default: the "
        "server's defaults)",
    )
    args = parser.parse_args(argv)
    churn_rows = args.churn_rows or max(args.records // 24, 100)

    server = start_server()
    admin: str = server.dsn  # type: ignore[attr-defined]
    try:
        version = execute(admin, "SHOW server_version", fetch=True)[0][0]
        print(f"PostgreSQL {version}, settings {SERVER_SETTINGS}, fsync and synchronous_commit on")
        dsns: dict[str, str] = {}
        for table in ("empty", "big"):
            execute(admin, f"CREATE DATABASE {table}")
            dsns[table] = server.dsn_for(table)  # type: ignore[attr-defined]
        # Each (table, mode) is the store Idempotency builds for that database and
        # claim mode: its own engine, a connection per thread and two to spare.
        stores = {
            (t, mode): PostgresStore.from_settings(
                Settings(database_url=dsns[t], pool_size=args.threads + 2, claim_mode=mode)
            )
            for t in dsns
            for mode in ("row", "transaction")
        }
        for table in dsns:
            stores[(table, "row")].migrate()

        print(f"fill: {args.records:,} records")
        fill_seconds = fill(dsns["big"], args.records, salt="big")
        fill(dsns["empty"], 1000, salt="empty")
        t0 = time.monotonic()
        for dsn in dsns.values():
            execute(dsn, "VACUUM (ANALYZE) idempotency_records")
        print(f"fill {fill_seconds:.0f} s, VACUUM ANALYZE {time.monotonic() - t0:.0f} s")
        big_sizes = sizes(dsns["big"])
        print("big table: " + ", ".join(f"{k} {v:,.0f}" for k, v in big_sizes.items()))

        plan = execute(
            dsns["big"],
            "EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF, SUMMARY OFF)"
            " SELECT state FROM idempotency_records WHERE record_key = %s",
            (psycopg2.Binary(hashlib.sha256(b"x").digest()),),
            fetch=True,
        )
        print("lookup plan: " + " / ".join(str(r[0]).strip() for r in plan))

        print(f"latency: {args.rounds} rounds x {args.threads} threads x {args.per_block}")
        found = measure_latency(
            stores, threads=args.threads, per_block=args.per_block, rounds=args.rounds
        )
        print("| mode | operation | empty p50 ms | big p50 ms | ratio | empty p99 | big p99 |")
        print("|---|---|---:|---:|---:|---:|---:|")
        for mode in ("row", "transaction"):
            for op in ("first", "replay"):
                e = found.samples[("empty", mode, op)]
                b = found.samples[("big", mode, op)]
                e50, b50 = statistics.median(e), statistics.median(b)
                print(
                    f"| {mode} | {op} | {e50:.2f} | {b50:.2f} | {b50 / e50:.2f} "
                    f"| {percentile(e, 0.99):.2f} | {percentile(b, 0.99):.2f} |"
                )

        big_row = stores[("big", "row")]
        expired = big_row.count_expired()
        seconds = 4.0
        with background_first_requests(big_row, 2) as quiet:
            time.sleep(seconds)
        lsn = wal_lsn(dsns["big"])
        with background_first_requests(big_row, 2) as during:
            t0 = time.monotonic()
            purged = purge_all(big_row, args.batch_size)
            purge_seconds = time.monotonic() - t0
        wal = wal_bytes(dsns["big"], lsn)
        print(
            f"purge: {purged:,} of {expired:,} expired rows in {purge_seconds:.1f} s = "
            f"{purged / purge_seconds:,.0f} rows/s (batch {args.batch_size}); "
            f"WAL {wal / max(purged, 1):,.0f} bytes/row (includes {len(during):,} concurrent "
            f"first requests' WAL, about {len(during) / max(purged, 1):.3f} per purged row)"
        )
        print(
            f"concurrent first requests, 2 threads: p50/p99 {statistics.median(quiet):.2f}/"
            f"{percentile(quiet, 0.99):.2f} ms without purge ({len(quiet)} requests), "
            f"{statistics.median(during):.2f}/{percentile(during, 0.99):.2f} ms during "
            f"({len(during)} requests)"
        )
        after_purge = sizes(dsns["big"])
        print("after purge: " + ", ".join(f"{k} {v:,.0f}" for k, v in after_purge.items()))

        if args.autovacuum:
            execute(dsns["big"], f"ALTER TABLE idempotency_records SET ({args.autovacuum})")
        print(
            f"churn: {args.churn_cycles} cycles of {churn_rows:,} rows (insert, then purge); "
            f"autovacuum: {args.autovacuum or 'server defaults'}"
            + (f"; VACUUM every {args.vacuum_every} cycles" if args.vacuum_every else "")
        )
        print("| cycle | heap MB | indexes MB | total MB | rows | dead | autovacuums |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        params = {"headers": headers_json(), "body": psycopg2.Binary(BODY), "rows": churn_rows}
        churn_started = time.monotonic()
        for cycle in range(1, args.churn_cycles + 1):
            execute(dsns["big"], CHURN, params | {"cycle": cycle})
            purge_all(big_row, args.batch_size)
            if args.vacuum_every and cycle % args.vacuum_every == 0:
                execute(dsns["big"], "VACUUM idempotency_records")
            s = sizes(dsns["big"])
            print(
                f"| {cycle} | {s['heap_mb']:,.0f} | {s['indexes_mb']:,.0f} | {s['total_mb']:,.0f} "
                f"| {s['rows']:,.0f} | {s['dead']:,.0f} | {s['autovacuums']:.0f} |",
                flush=True,
            )
        churned = churn_rows * args.churn_cycles
        print(
            f"churn: {churned:,} rows in and out in {time.monotonic() - churn_started:.0f} s "
            f"({churned / (time.monotonic() - churn_started):,.0f} rows/s in and out)"
        )
        for store in stores.values():
            store.close()
    finally:
        server.close()  # type: ignore[attr-defined]


if __name__ == "__main__":
    main()
