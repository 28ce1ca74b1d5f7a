"""PgBouncer in transaction-pooling mode between the payments API and PostgreSQL.

The app connects to a throwaway PgBouncer (``pool_mode = transaction``, config
written by the test, see support/pgbouncer_server.py) in front of a database of
its own on the run's PostgreSQL, with the extension's default settings: it
prepares no statements and keeps no session state, so nothing is to be turned
off for a pooler. The reliability suite's storm and crash tests run through it
unchanged, in both claim modes; a smaller test checks what the extension's
``SET LOCAL``s and its completion-with-``COMMIT`` do when clients share one
server connection, and that they leave nothing behind on it.

Skipped, with the reason, where no ``pgbouncer`` binary can be found (``.ci/run``
installs Debian's package when it can).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import psycopg2
import pytest
import sqlalchemy
from reliability import test_crash, test_storm
from reliability.figures import Figures
from reliability.stack import Stack, StackOptions, drop_stale_databases, own_database

from flask_idempotency.settings import Settings
from flask_idempotency.store.base import Claimed, Existing, LeaseHold, StoredResponse
from flask_idempotency.store.postgres import PostgresStore
from support.pgbouncer_server import ThrowawayPgBouncer, find_pgbouncer

pytestmark = [
    pytest.mark.topology,
    pytest.mark.skipif(
        find_pgbouncer() is None,
        reason="no pgbouncer binary: `apt-get install pgbouncer` (.ci/run does so when it can)",
    ),
]

#: Server connections PgBouncer may open to the database: fewer than the app's
#: 4 workers x 4 threads, so in row mode clients really take turns on them.
POOL_SIZE = 12


@pytest.fixture(scope="module")
def bouncer(database_url: str) -> Iterator[ThrowawayPgBouncer]:
    drop_stale_databases(database_url)
    with ThrowawayPgBouncer(database_url, pool_size=POOL_SIZE) as running:
        yield running
        print(f"--- pgbouncer log ---\n{running.log_path.read_text(errors='replace')[-4000:]}")


@contextlib.contextmanager
def bounced_stack(
    database_url: str, bouncer: ThrowawayPgBouncer, claim_mode: str, options: StackOptions
) -> Iterator[Stack]:
    """A stack whose app reaches its own database only through ``bouncer``, with the
    example app's settings (the extension's defaults but for the claim mode); the
    test's own queries go straight to PostgreSQL."""
    with own_database(database_url) as url:
        dbname = url.rsplit("/", 1)[1]
        env = {
            **options.extra_env,
            "DATABASE_URL": bouncer.url_for(dbname),
            "IDEMPOTENCY_CLAIM_MODE": claim_mode,
        }
        stack = Stack(
            database_url=url, redis_url=None, options=dataclasses.replace(options, extra_env=env)
        )
        try:
            yield stack.start()
        finally:
            stack.close()


def _bouncer_figures(bouncer: ThrowawayPgBouncer, dbname: str) -> dict[str, object]:
    stats = [row for row in bouncer.show("STATS") if row["database"] == dbname]
    pools = [row for row in bouncer.show("POOLS") if row["database"] == dbname]
    return {
        "pgbouncer_transactions": sum(int(str(row["total_xact_count"])) for row in stats),
        "pgbouncer_queries": sum(int(str(row["total_query_count"])) for row in stats),
        "pgbouncer_server_connections": sum(
            int(str(row[name])) for row in pools for name in ("sv_active", "sv_idle", "sv_used")
        ),
    }


@pytest.mark.parametrize("claim_mode", ["row", "transaction"])
def test_storm_through_pgbouncer(
    database_url: str,
    bouncer: ThrowawayPgBouncer,
    claim_mode: str,
    api_key: str,
    run_id: str,
    figures: Figures,
) -> None:
    """200 keys x 20 simultaneous duplicates: each key runs once, replays are the same bytes."""
    with bounced_stack(database_url, bouncer, claim_mode, StackOptions()) as stack:
        test_storm.test_storm_executes_each_key_exactly_once(stack, api_key, run_id, figures)
        figures(**_bouncer_figures(bouncer, stack.database_url.rsplit("/", 1)[1]))


@pytest.mark.parametrize("claim_mode", ["row", "transaction"])
def test_crash_through_pgbouncer(
    database_url: str,
    bouncer: ThrowawayPgBouncer,
    claim_mode: str,
    api_key: str,
    run_id: str,
    figures: Figures,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Workers SIGKILLed mid-request (their PgBouncer clients vanish mid-transaction):
    one effective charge per key after the retries, nothing left processing."""
    monkeypatch.setenv("IDEMPOTENCY_CLAIM_MODE", claim_mode)  # what the crash test asserts on
    options = StackOptions(
        workers=test_crash.WORKERS,
        lease_seconds=test_crash.LEASE,
        processor_timeout=test_crash.PROCESSOR_TIMEOUT,
    )
    with bounced_stack(database_url, bouncer, claim_mode, options) as stack:
        test_crash.test_killed_workers_leave_exactly_one_charge_per_key(
            stack, api_key, run_id, figures
        )
        figures(**_bouncer_figures(bouncer, stack.database_url.rsplit("/", 1)[1]))


#: What a client could leave on a shared server session: the extension's ``SET LOCAL``s,
#: the settings its schema functions run under (``SET`` clauses of the functions),
#: and what a driver sets for an isolation level or a read-only session.
SESSION_SETTINGS = ("statement_timeout", "lock_timeout", "synchronous_commit", "enable_seqscan",
                    "plan_cache_mode", "default_transaction_isolation",
                    "default_transaction_read_only")  # fmt: skip


def _session_state(url: str) -> dict[str, str]:
    """The settings above and the statements prepared in the session that serves a new
    client of ``url`` (behind a one-connection PgBouncer, the only server session)."""
    conn = psycopg2.connect(url, connect_timeout=5)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            values = {}
            for name in SESSION_SETTINGS:
                cur.execute(f"SHOW {name}")
                row = cur.fetchone()
                assert row is not None
                values[name] = str(row[0])
            cur.execute("SELECT count(*) FROM pg_prepared_statements")
            row = cur.fetchone()
            assert row is not None
            values["prepared statements"] = str(row[0])
            return values
    finally:
        conn.close()


#: Requests per test below: more than psycopg 3's ``prepare_threshold`` (5), after
#: which it would prepare a query it runs through its own cursor.
REQUESTS = 8


@contextlib.contextmanager
def default_store(bounced: str, claim_mode: str, driver: str) -> Iterator[PostgresStore]:
    """The store ``Idempotency`` builds with default settings but for the claim mode:
    on ``IDEMPOTENCY_DATABASE_URL`` (psycopg2), or on an application's psycopg 3
    engine given as ``engine=`` (the driver's own defaults, ``prepare_threshold``
    included)."""
    settings = Settings(database_url=bounced, pool_size=3, claim_mode=claim_mode)
    if driver == "psycopg2":
        store = PostgresStore.from_settings(settings)
        try:
            yield store
        finally:
            store.close()
        return
    url = bounced.replace("postgresql://", "postgresql+psycopg://", 1)
    engine = sqlalchemy.create_engine(url, pool_size=3, max_overflow=0)
    store = PostgresStore.from_settings(settings, engine=engine)
    try:
        yield store
    finally:
        store.close()
        engine.dispose()


def view_statement(conn: Any, driver: str) -> None:
    """The view's own statement. psycopg 3 would prepare a query its own cursor runs
    ``prepare_threshold`` times; behind a transaction pooler an application turns
    that off for its own queries (``prepare_threshold=None`` on its engine, or
    ``prepare=False``), which the extension's statements do not need: they go
    through a client-side cursor, which prepares nothing."""
    if driver == "psycopg":
        conn.execute("SELECT 1", prepare=False)
        return
    with conn.cursor() as cur:
        cur.execute("SELECT 1")


@pytest.mark.parametrize("driver", ["psycopg2", "psycopg"])
@pytest.mark.parametrize("claim_mode", ["row", "transaction"])
def test_set_local_and_commit_stay_in_their_transaction(
    database_url: str, claim_mode: str, driver: str
) -> None:
    """One server connection behind PgBouncer, shared by the extension's clients and
    another one, with default settings: every ``SET LOCAL`` ends with the round trip
    that sent it (nothing leaks into the next client's transaction), no statement is
    left prepared on the session, the completion and its ``COMMIT`` go in one round
    trip, the lease keeper's renewal goes through on a client of its own, and
    claims, completions and replays behave as direct."""
    with own_database(database_url) as url, ThrowawayPgBouncer(database_url, pool_size=1) as pgb:
        bounced = pgb.url_for(url.rsplit("/", 1)[1])
        baseline = _session_state(bounced)
        assert baseline["prepared statements"] == "0"
        with default_store(bounced, claim_mode, driver) as store:
            store.migrate()
            response = StoredResponse(201, (("Content-Type", "application/json"),), b'{"ok":1}')
            for n in range(REQUESTS):
                key = f"key-{n}".encode()
                request = store.begin()
                claimed = request.claim(key, b"fp", lease=30, ttl=60)
                assert isinstance(claimed, Claimed)
                if request.holds_lease:
                    # Row mode: the keeper renews on its own connection, another client.
                    assert store.renew([LeaseHold(key, claimed.token, 30.0)]) == 1
                # Another client, same single server connection? Not while a transaction
                # is open on it: the business transaction (BEGIN .. COMMIT) pins it.
                view_statement(request.connection(), driver)
                request.complete(key, claimed.token, response)
                request.close()
                assert _session_state(bounced) == baseline
                replay = store.begin()
                existing = replay.claim(key, b"fp", lease=30, ttl=60)
                replay.close()
                assert isinstance(existing, Existing) and existing.response == response
            assert _session_state(bounced) == baseline
            pools = [row for row in pgb.show("POOLS") if row["database"] != "pgbouncer"]
            assert sum(int(str(row["sv_active"])) + int(str(row["sv_idle"])) for row in pools) <= 1
