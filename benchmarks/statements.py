"""``python -m benchmarks.statements``: where a first request's database cost goes.

The full benchmark says how much CPU the extension adds per first request and
splits it by process (app, PostgreSQL, Redis). This probe splits PostgreSQL's
share by statement. On one connection, with nothing else queued, it runs the
database work of one first request many times, for each of these sequences,
interleaved over rounds:

* ``bare``: ``BEGIN``, the business ``INSERT``, ``COMMIT`` (no idempotency);
* ``row``: the library's row-mode first request through ``PostgresStore``, built
  from ``Settings`` as ``Idempotency`` builds it: the claim (committed on its
  own, asynchronously), ``BEGIN``, the ``INSERT``, the completion with the
  ``COMMIT``;
* ``transaction``: the transaction claim mode: ``BEGIN`` with the claim, the
  ``INSERT``, the completed record's ``INSERT`` with the ``COMMIT``;
* ``row texts`` and ``transaction texts``: the same statements, the
  store's own texts (``PostgresStore.statements``), sent on a plain psycopg2
  connection: the difference to ``row`` and ``transaction`` is what the store's
  pool adds per request (SQLAlchemy's check-out and check-in);
* ``transaction claim only``: that claim and a ``ROLLBACK``, against
  ``BEGIN`` and ``ROLLBACK`` alone (``begin+rollback``): the claim's own cost;
* ``hand-written``: what ``sqla-handwritten`` (``benchmarks.sqla``) sends, at the
  driver: ``BEGIN``, its key's ``INSERT ... ON CONFLICT DO NOTHING``, the
  business ``INSERT``, the ``UPDATE`` storing the answer, ``COMMIT`` (every
  statement planned afresh, as SQLAlchemy's ``text()`` sends it);
* ``bare + record``: ``bare`` with the completed record inserted before its
  ``COMMIT`` (the store's own ``insert_completed`` text): what storing the
  answer durably costs, without any claim;
* ``bare + savepoint``: ``bare`` with ``SAVEPOINT`` before the ``INSERT`` and
  ``RELEASE SAVEPOINT`` after it: what a ``db.session`` joined to the request's
  transaction adds per session transaction, at the driver;
* ``sqlalchemy bare`` and ``sqlalchemy + savepoint`` (when SQLAlchemy is
  installed): the same two through a SQLAlchemy ``Connection``
  (``begin()``, ``begin_nested()``, ``execute()``, ``commit()``), so the
  difference between them is the savepoint's whole cost, SQLAlchemy included.

The store sends one text per operation (``PostgresStore.statements``), each as
one simple query, nothing prepared: the row-mode claim is parsed and planned
on every call; the completions and the transaction-mode claim are calls of the
schema's functions, whose inner statements PostgreSQL plans once per session
and keeps. So ``row`` and ``transaction`` send exactly what a request's claim
and completion send.

For each it prints the backend's CPU (from ``/proc``, so run it on the
database's machine), this process's CPU (driver, library and socket calls)
and the WAL written, per request, and the difference to ``bare``. It needs
the benchmark's database (``BENCH_DATABASE_URL``, migrated on start).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import secrets
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib.util import find_spec
from typing import Any

import psycopg2

from flask_idempotency.settings import Settings
from flask_idempotency.store.base import Claimed, StoredResponse
from flask_idempotency.store.postgres import PostgresStore
from flask_idempotency.store.request import PostgresRequest
from flask_idempotency.store.sql import CLAIM_IN_TRANSACTION, advisory_locks, response_params

from .app import INSERT_CHARGE, database_url, prepare_database

#: The benchmark app's answer, as the extension stores it.
RESPONSE = StoredResponse(
    201,
    (("Content-Type", "application/json"),),
    b'{"amount": 1000, "currency": "usd", "id": 123456, "status": "succeeded"}',
)
TTL = 86400.0
LEASE = 30.0


@dataclass(frozen=True)
class Cost:
    backend_us: float
    client_us: float
    wall_us: float
    wal_bytes: float


class Probe:
    """A store per claim mode (a pool of one connection each, so one backend), and
    a plain connection for the sequences without the extension."""

    def __init__(self, dsn: str) -> None:
        self.stores = {mode: store_for(dsn, mode) for mode in ("row", "transaction")}
        self.plain = psycopg2.connect(dsn)
        self.plain.autocommit = True
        self.side = psycopg2.connect(dsn)
        self.side.autocommit = True
        self.sqlalchemy: Any = None
        if find_spec("sqlalchemy") is not None:
            import sqlalchemy

            url = dsn.replace("postgresql://", "postgresql+psycopg2://", 1)
            engine = sqlalchemy.create_engine(url, pool_size=1, max_overflow=0)
            self.sqlalchemy = engine.connect()

    def close(self) -> None:
        for store in self.stores.values():
            store.close()
        self.plain.close()
        self.side.close()
        if self.sqlalchemy is not None:
            self.sqlalchemy.close()
            self.sqlalchemy.engine.dispose()

    def backend_pid(self, connection: str) -> int:
        """The backend of ``"plain"`` or of a claim mode's pooled connection."""
        if connection == "plain":
            return int(self.plain.get_backend_pid())
        if connection == "sqlalchemy":
            return int(self.sqlalchemy.connection.driver_connection.get_backend_pid())
        tx = self.stores[connection].begin()
        try:
            pid: int = tx.connection().get_backend_pid()
        finally:
            tx.close()
        return pid

    def wal_lsn(self) -> str:
        with self.side.cursor() as cur:
            cur.execute("SELECT pg_current_wal_insert_lsn()::text")
            row = cur.fetchone()
        assert row is not None
        return str(row[0])

    def wal_between(self, start: str, end: str) -> float:
        with self.side.cursor() as cur:
            cur.execute("SELECT pg_wal_lsn_diff(%s::pg_lsn, %s::pg_lsn)", (end, start))
            row = cur.fetchone()
        assert row is not None
        return float(row[0])


def store_for(dsn: str, claim_mode: str, pool_size: int = 1) -> PostgresStore:
    """The store ``Idempotency`` builds for ``IDEMPOTENCY_DATABASE_URL = dsn`` with
    these settings (its own SQLAlchemy engine, defaults for everything else)."""
    settings = Settings(database_url=dsn, pool_size=pool_size, claim_mode=claim_mode)
    return PostgresStore.from_settings(settings)


def backend_cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def new_key() -> tuple[bytes, bytes]:
    record_key = hashlib.sha256(secrets.token_bytes(16)).digest()
    return record_key, hashlib.sha256(record_key).digest()


#: ``sqla-handwritten``'s statements (``benchmarks.sqla``), as psycopg2 sends them.
HANDWRITTEN_CLAIM = (
    "INSERT INTO bench_sqla_keys (key, fingerprint) VALUES (%s, %s) "
    "ON CONFLICT (key) DO NOTHING RETURNING true"
)
HANDWRITTEN_COMPLETE = "UPDATE bench_sqla_keys SET status = %s, body = %s WHERE key = %s"


def business_insert(tx: PostgresRequest) -> None:
    with tx.connection().cursor() as cur:
        cur.execute(INSERT_CHARGE, (1000, "usd"))
        cur.fetchone()


def first_request(store: PostgresStore) -> None:
    """The database work of one first request, as the extension does it."""
    record_key, fingerprint = new_key()
    tx = store.begin()
    try:
        claimed = tx.claim(record_key, fingerprint, lease=LEASE, ttl=TTL)
        assert isinstance(claimed, Claimed), claimed
        business_insert(tx)
        tx.complete(record_key, claimed.token, RESPONSE)
    finally:
        tx.close()


def sequences(probe: Probe) -> dict[str, tuple[str, Callable[[], None]]]:
    """Each sequence, with the connection (so the backend) it runs on."""
    row, transaction = probe.stores["row"], probe.stores["transaction"]
    plain = probe.plain

    def bare() -> None:
        with plain.cursor() as cur:
            cur.execute("BEGIN")
            cur.execute(INSERT_CHARGE, (1000, "usd"))
            cur.fetchone()
            cur.execute("COMMIT")

    def hand_written() -> None:
        key = secrets.token_hex(16)
        fingerprint = hashlib.sha256(key.encode()).digest()
        with plain.cursor() as cur:
            cur.execute("BEGIN")
            cur.execute(HANDWRITTEN_CLAIM, (key, fingerprint))
            cur.fetchone()
            cur.execute(INSERT_CHARGE, (1000, "usd"))
            cur.fetchone()
            cur.execute(HANDWRITTEN_COMPLETE, (201, RESPONSE.body.decode(), key))
            cur.execute("COMMIT")

    def bare_and_record() -> None:
        # Transaction mode's completion (the completed record's INSERT, then the
        # COMMIT, in one round trip) on a transaction with no claim before it.
        record_key, fingerprint = new_key()
        with plain.cursor() as cur:
            cur.execute("BEGIN")
            cur.execute(INSERT_CHARGE, (1000, "usd"))
            cur.fetchone()
            cur.execute(
                transaction.statements.insert_completed,
                (record_key, fingerprint, TTL, *response_params(RESPONSE)),
            )

    def row_texts() -> None:
        # ``row``'s statements, the store's own texts, on the plain connection: what
        # they cost PostgreSQL apart from the store's pool (its check-out and check-in).
        record_key, fingerprint = new_key()
        params = {"key": record_key, "fp": fingerprint, "token": 7, "lease": LEASE, "ttl": TTL,
                  "recovery": None}  # fmt: skip
        with plain.cursor() as cur:
            cur.execute(row.statements.claim, params)
            assert cur.fetchone() is not None
            cur.execute("BEGIN")
            cur.execute(INSERT_CHARGE, (1000, "usd"))
            cur.fetchone()
            cur.execute(row.statements.complete, (record_key, 7, *response_params(RESPONSE)))

    def transaction_texts() -> None:
        # The same for ``transaction``: the claim opens the transaction, the completed
        # record's INSERT rides on the COMMIT.
        record_key, fingerprint = new_key()
        with plain.cursor() as cur:
            cur.execute(
                CLAIM_IN_TRANSACTION,
                (record_key, *advisory_locks(record_key, fingerprint)),
            )
            cur.fetchall()
            cur.execute(INSERT_CHARGE, (1000, "usd"))
            cur.fetchone()
            cur.execute(
                transaction.statements.insert_completed,
                (record_key, fingerprint, TTL, *response_params(RESPONSE)),
            )

    def bare_and_savepoint() -> None:
        with plain.cursor() as cur:
            cur.execute("BEGIN")
            cur.execute("SAVEPOINT sa_savepoint_1")
            cur.execute(INSERT_CHARGE, (1000, "usd"))
            cur.fetchone()
            cur.execute("RELEASE SAVEPOINT sa_savepoint_1")
            cur.execute("COMMIT")

    def begin_rollback() -> None:
        with plain.cursor() as cur:
            cur.execute("BEGIN")
            cur.execute("ROLLBACK")

    def claim_only() -> None:
        record_key, fingerprint = new_key()
        tx = transaction.begin()
        try:
            tx.claim(record_key, fingerprint, lease=LEASE, ttl=TTL)
        finally:
            tx.close()  # the ROLLBACK

    found = {
        "bare": ("plain", bare),
        "row": ("row", lambda: first_request(row)),
        "transaction": ("transaction", lambda: first_request(transaction)),
        "hand-written": ("plain", hand_written),
        "bare + record": ("plain", bare_and_record),
        "begin+rollback": ("plain", begin_rollback),
        "transaction claim only": ("transaction", claim_only),
        "bare + savepoint": ("plain", bare_and_savepoint),
        "row texts": ("plain", row_texts),
        "transaction texts": ("plain", transaction_texts),
    }
    if probe.sqlalchemy is not None:
        found.update(sqlalchemy_sequences(probe.sqlalchemy))
    return found


def sqlalchemy_sequences(conn: Any) -> dict[str, tuple[str, Callable[[], None]]]:
    """``bare`` and ``bare + savepoint`` through a SQLAlchemy ``Connection``."""
    from sqlalchemy import text

    insert = text(INSERT_CHARGE.replace("%s", ":amount", 1).replace("%s", ":currency", 1))
    params = {"amount": 1000, "currency": "usd"}

    def sqlalchemy_bare() -> None:
        with conn.begin():
            conn.execute(insert, params).first()

    def sqlalchemy_savepoint() -> None:
        with conn.begin():
            with conn.begin_nested():
                conn.execute(insert, params).first()

    return {
        "sqlalchemy bare": ("sqlalchemy", sqlalchemy_bare),
        "sqlalchemy + savepoint": ("sqlalchemy", sqlalchemy_savepoint),
    }


def measure(probe: Probe, connection: str, run: Callable[[], None], requests: int) -> Cost:
    pid = probe.backend_pid(connection)
    for _ in range(min(200, requests)):
        run()  # warm: plans, caches, the pool's connection
    lsn = probe.wal_lsn()
    backend = backend_cpu_seconds(pid)
    client, wall = time.process_time(), time.perf_counter()
    for _ in range(requests):
        run()
    wall = time.perf_counter() - wall
    client = time.process_time() - client
    backend = backend_cpu_seconds(pid) - backend
    wal = probe.wal_between(lsn, probe.wal_lsn())
    return Cost(
        backend / requests * 1e6, client / requests * 1e6, wall / requests * 1e6, wal / requests
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.statements", description=__doc__)
    parser.add_argument("--requests", type=int, default=3000, help="per sequence and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--database-url", default=None)
    args = parser.parse_args(argv)
    dsn = args.database_url or database_url()
    prepare_database(dsn, ["sqla-handwritten"])
    probe = Probe(dsn)
    results: dict[str, list[Cost]] = {}
    try:
        runs = sequences(probe)
        names = list(runs)
        for round_no in range(args.rounds):
            order = names[round_no % len(names) :] + names[: round_no % len(names)]
            for name in order:
                connection, run = runs[name]
                cost = measure(probe, connection, run, args.requests)
                results.setdefault(name, []).append(cost)
    finally:
        probe.close()
    report(results, args)


def median_of(costs: list[Cost], field: str) -> float:
    return float(statistics.median(getattr(cost, field) for cost in costs))


def report(results: dict[str, list[Cost]], args: Any) -> None:
    print(
        f"per request, medians of {args.rounds} interleaved rounds of {args.requests} "
        "(one connection; CPU from /proc and this process)"
    )
    print(
        f"{'sequence':<24}{'backend us':>11}{'client us':>11}{'wall us':>9}{'WAL B':>8}"
        f"{'+backend':>10}{'+client':>9}"
    )
    base_backend = median_of(results["bare"], "backend_us")
    base_client = median_of(results["bare"], "client_us")
    for name, costs in results.items():
        backend = median_of(costs, "backend_us")
        client = median_of(costs, "client_us")
        print(
            f"{name:<24}{backend:>11.0f}{client:>11.0f}{median_of(costs, 'wall_us'):>9.0f}"
            f"{median_of(costs, 'wal_bytes'):>8.0f}{backend - base_backend:>+10.0f}"
            f"{client - base_client:>+9.0f}"
        )


if __name__ == "__main__":
    main()
