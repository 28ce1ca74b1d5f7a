"""``purge`` and ``unlock`` of a live record ask first on a terminal; ``--yes`` skips.

A terminal is staged by replacing ``prompts.interactive`` (the runner's
stdin is a pipe); ``test_subprocess`` asks through a real pseudo-terminal.
"""

from __future__ import annotations

import pytest
from flask import Flask

from flask_idempotency.cli import prompts as cli_confirm
from support.pg_query import query

from .conftest import count, run, seed_expired

LIVE_LEASE = """
UPDATE idempotency_records
   SET state = 'processing', lock_token = 1, completed_at = NULL, status_code = NULL,
       lease_expires_at = now() + interval '30 seconds'
"""
DEAD_LEASE = "UPDATE idempotency_records SET lease_expires_at = now() - interval '1 minute'"


@pytest.fixture
def terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli_confirm, "interactive", lambda: True)


def pay(app: Flask, key: str) -> None:
    response = app.test_client().post("/pay", json={}, headers={"Idempotency-Key": key})
    assert response.status_code == 201


@pytest.mark.usefixtures("terminal")
def test_purge_on_a_terminal_says_what_it_will_delete_and_asks(
    cli_app: Flask, clean_db: str
) -> None:
    seed_expired(clean_db, 5)
    pay(cli_app, "kept")
    declined = run(cli_app, "purge", input="n\n")
    assert declined.exit_code == 1
    assert "5 expired record(s) and 0 published event(s) will be deleted" in declined.stderr
    assert "Delete them? [y/N]" in declined.stderr
    assert declined.stdout == ""
    assert count(clean_db) == 6

    accepted = run(cli_app, "purge", input="y\n")
    assert accepted.exit_code == 0, accepted.output
    assert accepted.stdout == "5 expired record(s) deleted\n"
    assert count(clean_db) == 1


@pytest.mark.usefixtures("terminal")
def test_purge_yes_and_an_empty_purge_do_not_ask(cli_app: Flask, clean_db: str) -> None:
    seed_expired(clean_db, 3)
    result = run(cli_app, "purge", "--yes")
    assert result.exit_code == 0 and "Delete them?" not in result.output
    assert "3 expired record(s) deleted" in result.stdout
    nothing = run(cli_app, "purge")
    assert nothing.exit_code == 0 and "Delete them?" not in nothing.output
    assert run(cli_app, "purge", "--dry-run").exit_code == 0


def test_purge_off_a_terminal_goes_ahead_as_cron_runs_it(cli_app: Flask, clean_db: str) -> None:
    seed_expired(clean_db, 4)
    result = run(cli_app, "purge")
    assert result.exit_code == 0, result.output
    assert result.output == "4 expired record(s) deleted\n"  # no question, no plan
    assert count(clean_db) == 0


@pytest.mark.usefixtures("terminal")
def test_unlock_of_a_record_whose_lease_is_renewed_asks_on_a_terminal(
    cli_app: Flask, clean_db: str
) -> None:
    pay(cli_app, "in-flight")
    query(clean_db, LIVE_LEASE)
    declined = run(cli_app, "unlock", "in-flight", input="n\n")
    assert declined.exit_code == 1
    assert "is in flight" in declined.stderr and "payment can be made twice" in declined.stderr
    assert "Unlock it? [y/N]" in declined.stderr
    assert count(clean_db) == 1

    accepted = run(cli_app, "unlock", "in-flight", input="y\n")
    assert accepted.exit_code == 0, accepted.output
    assert accepted.stdout == "released\n"
    assert count(clean_db) == 0


def test_unlock_of_a_live_record_off_a_terminal_needs_yes(cli_app: Flask, clean_db: str) -> None:
    pay(cli_app, "in-flight")
    query(clean_db, LIVE_LEASE)
    refused = run(cli_app, "unlock", "in-flight")
    assert refused.exit_code == 2
    assert "is in flight" in refused.output and "give --yes" in refused.output
    assert count(clean_db) == 1
    forced = run(cli_app, "unlock", "in-flight", "--yes")
    assert forced.exit_code == 0 and forced.stdout == "released\n"
    assert count(clean_db) == 0


@pytest.mark.usefixtures("terminal")
def test_unlock_of_a_record_whose_holder_died_does_not_ask(cli_app: Flask, clean_db: str) -> None:
    pay(cli_app, "stuck")
    query(clean_db, LIVE_LEASE)
    query(clean_db, DEAD_LEASE)
    result = run(cli_app, "unlock", "stuck")
    assert result.exit_code == 0, result.output
    assert "Unlock it?" not in result.output
    assert count(clean_db) == 0


def test_unlock_leaves_a_completed_record_alone(cli_app: Flask, clean_db: str) -> None:
    pay(cli_app, "done")
    result = run(cli_app, "unlock", "done", "--yes")
    assert result.exit_code == 1 and "no processing record" in result.output
    assert count(clean_db) == 1
