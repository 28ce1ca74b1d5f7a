"""PgBouncer in transaction-pooling mode between the payments API and PostgreSQL.

The app connects to a throwaway PgBouncer (``pool_mode = transaction``, config
written by the test, see support/pgbouncer_server.py) in front of a database of
its own on the run's PostgreSQL, with ``IDEMPOTENCY_DATABASE_OPTIONS["prepare_statements"]`` off.
The reliability suite's storm and crash tests run through it unchanged, in both
claim modes; a smaller test checks what the extension's ``SET LOCAL``s and its
completion-with-``COMMIT`` do when clients share one server connection.

Skipped, with the reason, where no ``pgbouncer`` binary can be found (``.ci/run``
installs Debian's package when it can).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import psycopg2
import pytest
from reliability import test_crash, test_storm
from reliability.figures import Figures
from reliability.stack import Stack, StackOptions, drop_stale_databases, own_database

from flask_idempotency.store.base import Claimed, Existing, StoredResponse
from flask_idempotency.store.pool import ConnectionPool
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
#: The app through PgBouncer: nothing prepared (a later transaction of the same
#: client may run on another server connection).
BOUNCED_APP = "support.topology_wsgi:app"


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
    """A stack whose app reaches its own database only through ``bouncer``; the test's
    own queries go straight to PostgreSQL."""
    with own_database(database_url) as url:
        dbname = url.rsplit("/", 1)[1]
        env = {
            **options.extra_env,
            "DATABASE_URL": bouncer.url_for(dbname),
            "IDEMPOTENCY_CLAIM_MODE": claim_mode,
            "TOPOLOGY_IDEMPOTENCY_DATABASE_OPTIONS": '{"prepare_statements": false}',
        }
        stack = Stack(
            database_url=url, redis_url=None, options=dataclasses.replace(options, extra_env=env)
        )
        stack.app.wsgi_app = BOUNCED_APP
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


SESSION_SETTINGS = ("statement_timeout", "lock_timeout", "synchronous_commit", "enable_seqscan",
                    "plan_cache_mode")  # fmt: skip


def _session_settings(url: str) -> dict[str, str]:
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
            return values
    finally:
        conn.close()


@pytest.mark.parametrize("claim_mode", ["row", "transaction"])
def test_set_local_and_commit_stay_in_their_transaction(database_url: str, claim_mode: str) -> None:
    """One server connection behind PgBouncer, shared by the extension's clients and
    another one: every ``SET LOCAL`` ends with the round trip that sent it (nothing
    leaks into the next client's transaction), the completion and its ``COMMIT``
    go in one round trip, and claims, completions and replays behave as direct."""
    with own_database(database_url) as url, ThrowawayPgBouncer(database_url, pool_size=1) as pgb:
        bounced = pgb.url_for(url.rsplit("/", 1)[1])
        baseline = _session_settings(bounced)
        store = PostgresStore(
            ConnectionPool(bounced, max_size=3), prepare_statements=False, claim_mode=claim_mode
        )
        try:
            store.migrate()
            response = StoredResponse(201, (("Content-Type", "application/json"),), b'{"ok":1}')
            for n in range(3):
                key = f"key-{n}".encode()
                request = store.begin()
                claimed = request.claim(key, b"fp", lease=30, ttl=60)
                assert isinstance(claimed, Claimed)
                # Another client, same single server connection? Not while a transaction
                # is open on it: the business transaction (BEGIN .. COMMIT) pins it.
                with request.connection().cursor() as cur:
                    cur.execute("SELECT 1")
                request.complete(key, claimed.token, response)
                request.close()
                assert _session_settings(bounced) == baseline
                replay = store.begin()
                existing = replay.claim(key, b"fp", lease=30, ttl=60)
                replay.close()
                assert isinstance(existing, Existing) and existing.response == response
            assert _session_settings(bounced) == baseline
            pools = [row for row in pgb.show("POOLS") if row["database"] != "pgbouncer"]
            assert sum(int(str(row["sv_active"])) + int(str(row["sv_idle"])) for row in pools) <= 1
        finally:
            store.close()
