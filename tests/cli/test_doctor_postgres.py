"""The doctor's PostgreSQL checks, each made to fail (or warn) and pass on real servers.

Server settings are changed per database or per role in a database of the
test's own (``fresh_database_url``, dropped after the test), or on a throwaway
server, never on the run's shared server.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import pytest

from flask_idempotency.cli.doctor import database
from flask_idempotency.cli.doctor.base import FAIL, OK, WARN, Check
from support.pg_query import query
from support.pgbouncer_server import ThrowawayPgBouncer, find_pgbouncer
from support.postgres_server import ThrowawayPostgres
from support.waiting import wait_until

from .doctoring import app_on, check, migrated

#: Completed records, ``n`` of them (the autovacuum tests' churn).
SEED = """
INSERT INTO idempotency_records (record_key, fingerprint, state, created_at, expires_at,
                                 completed_at, status_code)
SELECT sha256(convert_to('doctor-' || i, 'UTF8')), '\\x00', 'completed',
       now(), now() + interval '1 day', now(), 201
  FROM generate_series(1, %s) AS i
"""


def dbname(url: str) -> str:
    return url.rsplit("/", 1)[1].split("?")[0]


# -- PgBouncer -----------------------------------------------------------------------


def test_a_direct_connection_is_no_pgbouncer(clean_db: str) -> None:
    with app_on(clean_db) as app:
        found = check(app, "pgbouncer")
    assert found.status == OK and "connected straight to PostgreSQL" in found.detail


@pytest.mark.skipif(
    find_pgbouncer() is None, reason="no pgbouncer binary (apt-get install pgbouncer)"
)
def test_pgbouncer_in_transaction_mode_is_named_and_fine(clean_db: str) -> None:
    """The extension prepares no statements and keeps no session state between
    transactions: PgBouncer's transaction pooling needs no setting, and the doctor
    only says what sits between the app and PostgreSQL."""
    with ThrowawayPgBouncer(clean_db, pool_size=4) as bouncer:
        with app_on(bouncer.url_for(dbname(clean_db))) as app:
            found = check(app, "pgbouncer")
    assert found.status == OK, found
    assert "PgBouncer" in found.detail and "transaction mode" in found.detail


@pytest.mark.skipif(
    find_pgbouncer() is None, reason="no pgbouncer binary (apt-get install pgbouncer)"
)
def test_pgbouncer_in_session_mode_is_named(clean_db: str) -> None:
    with ThrowawayPgBouncer(clean_db, pool_mode="session", pool_size=4) as bouncer:
        with app_on(bouncer.url_for(dbname(clean_db))) as app:
            found = check(app, "pgbouncer")
    assert found.status == OK and "session mode" in found.detail, found


# -- session timeouts ------------------------------------------------------------------


def test_idle_in_transaction_timeout_shorter_than_the_lease_fails(
    fresh_database_url: str,
) -> None:
    name = dbname(fresh_database_url)
    query(
        fresh_database_url, f"ALTER DATABASE {name} SET idle_in_transaction_session_timeout = '5s'"
    )
    with app_on(fresh_database_url, IDEMPOTENCY_LEASE=30) as app:
        found = check(app, "session timeouts")
        assert found.status == FAIL, found
        assert "idle_in_transaction_session_timeout 5 s" in found.detail
        assert f"set by ALTER DATABASE {name}" in found.detail
        assert found.fix is not None and found.fix.startswith(f"ALTER DATABASE {name} SET")

        query(
            fresh_database_url, f"ALTER DATABASE {name} RESET idle_in_transaction_session_timeout"
        )
        app.extensions["idempotency"].store.pool.discard_idle()  # new sessions read it
        found = check(app, "session timeouts")
    assert found.status == OK, found


def test_a_role_statement_timeout_shorter_than_a_route_lease_warns(
    fresh_database_url: str,
) -> None:
    name = dbname(fresh_database_url)
    query(
        fresh_database_url, f"ALTER ROLE postgres IN DATABASE {name} SET statement_timeout = '40s'"
    )
    try:
        with app_on(fresh_database_url, IDEMPOTENCY_LEASE=30) as app:
            assert check(app, "session timeouts").status == OK  # 40 s > the app's lease
            _route_with_lease(app, 60)
            found = check(app, "session timeouts")
        assert found.status == WARN, found
        assert "statement_timeout 40 s" in found.detail and "(60 s)" in found.detail
        assert f"ALTER ROLE postgres IN DATABASE {name}" in found.detail
    finally:
        query(fresh_database_url, f"ALTER ROLE postgres IN DATABASE {name} RESET ALL")


def _route_with_lease(app: object, lease: float) -> None:
    from flask import Flask

    from flask_idempotency.decorators import RouteDecorator

    assert isinstance(app, Flask)

    @app.post("/slow")
    @RouteDecorator(True)(lease=lease, ttl=3600)
    def slow() -> str:
        return "ok"


# -- autovacuum ------------------------------------------------------------------------


@pytest.fixture
def autovacuuming() -> Iterator[str]:
    """A database on a throwaway server with autovacuum on (PostgreSQL's default)."""
    with ThrowawayPostgres() as server:
        yield server.dsn_for("postgres")


def test_autovacuum_turned_off_on_the_records_table_fails(autovacuuming: str) -> None:
    with app_on(autovacuuming) as app:
        migrated(app)
        found = check(app, "autovacuum")
        assert found.status == OK, found
        assert "vacuumed after 50 + 0.2 x live rows" in found.detail

        query(autovacuuming, "ALTER TABLE idempotency_records SET (autovacuum_enabled = false)")
        found = check(app, "autovacuum")
    assert found.status == FAIL, found
    assert "autovacuum_enabled = false on idempotency_records" in found.detail
    assert found.fix == "ALTER TABLE idempotency_records RESET (autovacuum_enabled)"


def test_autovacuum_off_on_the_server_fails(clean_db: str) -> None:
    """The run's server: its autovacuum setting decides which way this goes."""
    on = query(clean_db, "SELECT current_setting('autovacuum')::bool")[0][0]
    with app_on(clean_db) as app:
        migrated(app)
        found = check(app, "autovacuum")
    if on:
        assert found.status == OK, found
    else:
        assert found.status == FAIL and "off on the server" in found.detail, found


def _wait_for_inserts(dsn: str, rows: int) -> None:
    """Until the statistics show ``rows`` inserted into the records table."""
    reported = "SELECT n_tup_ins FROM pg_stat_user_tables WHERE relname = 'idempotency_records'"
    wait_until(
        lambda: query(dsn, reported) == [(rows,)],
        10.0,
        f"{rows} inserts reported",
        describe=lambda: str(query(dsn, reported)),
    )


def _wait_for(app: object, status: str, timeout: float = 10.0) -> Check:
    """The cumulative statistics reach the views within a second or so of a commit."""
    deadline = time.monotonic() + timeout
    while True:
        found = check(app, "autovacuum")  # type: ignore[arg-type]
        if found.status == status or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def test_dead_rows_piling_up_warn_until_vacuumed(autovacuuming: str) -> None:
    with app_on(autovacuuming) as app:
        migrated(app)
        # A trigger autovacuum never reaches: the rows stay dead until VACUUM.
        query(
            autovacuuming,
            "ALTER TABLE idempotency_records SET (autovacuum_vacuum_threshold = 2000000000)",
        )
        query(autovacuuming, SEED, (12_000,))
        query(autovacuuming, "DELETE FROM idempotency_records")
        found = _wait_for(app, WARN)
        assert found.status == WARN, found
        assert "autovacuum is behind the table's churn" in found.detail
        assert "autovacuum_vacuum_scale_factor" in (found.fix or "")

        query(autovacuuming, "VACUUM idempotency_records")
        found = _wait_for(app, OK)
    assert found.status == OK, found


def test_a_large_table_under_the_default_scale_factor_warns(
    autovacuuming: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(database, "LARGE_TABLE", 1_000)  # a million rows, scaled down
    with app_on(autovacuuming) as app:
        migrated(app)
        query(autovacuuming, SEED, (3_000,))
        # A backend reports its inserts as it exits, after its client has gone: an
        # ANALYZE that counted the rows first would see them added a second time.
        _wait_for_inserts(autovacuuming, 3_000)
        query(autovacuuming, "ANALYZE idempotency_records")
        found = _wait_for(app, WARN)
        assert found.status == WARN, found
        assert "with autovacuum_vacuum_scale_factor 0.2, 600 rows die" in found.detail

        query(
            autovacuuming,
            "ALTER TABLE idempotency_records SET (autovacuum_vacuum_scale_factor = 0.01)",
        )
        found = check(app, "autovacuum")
    assert found.status == OK and "0.01 x live rows" in found.detail, found


# -- clock skew --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shift", "status"),
    [(0.0, OK), (-2.0, WARN), (2.0, WARN), (5.0, FAIL), (-5.0, FAIL)],
)
def test_clock_skew_warns_past_a_second_and_fails_past_half_a_lease(
    clean_db: str, shift: float, status: str
) -> None:
    with app_on(clean_db, IDEMPOTENCY_LEASE=8) as app:
        found = check(app, "clock", clock=lambda: time.time() + shift)
    assert found.status == status, found
    shown = float(re.search(r"is ([\d.]+) s", found.detail).group(1))  # type: ignore[union-attr]
    assert abs(shown - abs(shift)) < 0.2, found
    assert ("ahead of" if shift > 0 else "behind") in found.detail or shift == 0
    if status != OK:
        assert "NTP" in (found.fix or "")
    if status == FAIL:
        assert "half the shortest lease (4 s)" in found.detail
