"""The relay and the completer seen recently: heartbeats written by each run,
read by the doctor where the worker is needed."""

from __future__ import annotations

import logging
import re

import pytest

from flask_idempotency.cli.doctor.base import OK, WARN
from flask_idempotency.events.outbox import OutboxEvent
from flask_idempotency.events.relay import Relay
from flask_idempotency.store.heartbeat import Heartbeat
from support.pg_query import query

from .app import create_app
from .doctoring import app_on, check, migrated


class Discard:
    """An event publisher that confirms every event (the relay's broker side)."""

    def publish(self, event: OutboxEvent) -> bool:
        return True

    def close(self) -> None:
        pass


def test_no_relay_is_needed_without_events_or_broker(clean_db: str) -> None:
    with app_on(clean_db) as app:
        migrated(app)
        found = check(app, "relay")
    assert found.status == OK and "not needed" in found.detail


def test_the_relay_is_warned_about_until_it_runs_and_again_once_it_stops(clean_db: str) -> None:
    with app_on(clean_db, IDEMPOTENCY_BROKER_URL="amqp://guest:guest@127.0.0.1:9//") as app:
        migrated(app)
        found = check(app, "relay")
        assert found.status == WARN and found.detail.startswith("never seen"), found
        assert found.fix == "run `flask idempotency relay` (a service, or cron)"

        Relay(app.extensions["idempotency"].store, Discard()).run(once=True)
        found = check(app, "relay")
        assert found.status == OK and re.match(r"last seen \d s ago on .+:\d+$", found.detail), (
            found
        )

        query(clean_db, "UPDATE idempotency_heartbeats SET last_run_at = now() - interval '1 hour'")
        found = check(app, "relay")
        # (the broker check before it waits a retry on the unreachable broker)
        assert found.status == WARN and re.match(r"last seen 36\d\d s ago", found.detail), found
        assert check(app, "relay", stale_after=7200).status == OK


def test_pending_events_make_the_relay_needed_without_a_broker(clean_db: str) -> None:
    with app_on(clean_db) as app:
        migrated(app)
        query(
            clean_db,
            "INSERT INTO idempotency_outbox (id, event_type, payload, expires_at) "
            "VALUES ('evt_doctor', 'doctor.tested', '{}', now() + interval '1 day')",
        )
        found = check(app, "relay")
    assert found.status == WARN and "1 event(s) wait in the outbox" in found.detail, found


def test_the_completer_is_needed_where_a_route_declares_recover(clean_db: str) -> None:
    app = create_app(clean_db)  # its /pay route declares recover=
    try:
        found = check(app, "completer")
        assert found.status == WARN, found
        assert found.detail == "never seen, and 1 route(s) declare recover="

        result = app.test_cli_runner().invoke(args=["idempotency", "recover", "--once"])
        assert result.exit_code == 0, result.output
        found = check(app, "completer")
        assert found.status == OK and found.detail.startswith("last seen"), found
    finally:
        app.extensions["idempotency"].close()

    with app_on(clean_db) as plain:  # no recover= route: nothing to warn about
        assert check(plain, "completer").status == OK


def test_a_heartbeat_is_written_at_most_once_per_interval(clean_db: str) -> None:
    now = [1000.0]
    with app_on(clean_db) as app:
        migrated(app)
        store = app.extensions["idempotency"].store
        heartbeat = Heartbeat(store, "relay", interval=30.0, clock=lambda: now[0])
        heartbeat.beat()
        query(
            clean_db, "UPDATE idempotency_heartbeats SET last_run_at = now() - interval '1 minute'"
        )
        now[0] += 29.0
        heartbeat.beat()  # too soon: not written
        assert store.last_runs()["relay"][0] >= 59
        now[0] += 1.0
        heartbeat.beat()
        assert store.last_runs()["relay"][0] < 5


def test_a_heartbeat_that_cannot_be_written_never_stops_the_worker(
    fresh_database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """An unmigrated database has no heartbeats table: logged once, not raised."""
    now = [0.0]
    with app_on(fresh_database_url) as app:
        heartbeat = Heartbeat(
            app.extensions["idempotency"].store, "completer", interval=1.0, clock=lambda: now[0]
        )
        with caplog.at_level(logging.WARNING, "flask_idempotency"):
            for _ in range(3):
                heartbeat.beat()
                now[0] += 2.0
    warnings = [r for r in caplog.records if "heartbeat not recorded" in r.getMessage()]
    assert len(warnings) == 1
