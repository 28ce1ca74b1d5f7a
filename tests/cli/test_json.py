"""``show --json`` and ``stats --json``: one document with the prose's fields, alone on stdout."""

from __future__ import annotations

import json
from typing import Any

from flask import Flask

from support.pg_query import query

from .conftest import run, seed_expired

SHOW_FIELDS = [
    "record",
    "state",
    "expired",
    "lease_live",
    "age_seconds",
    "created_at",
    "expires_at",
    "completed_at",
    "lease_expires_at",
    "status",
]
STATS_FIELDS = [
    "processing",
    "completed",
    "expired",
    "lease_expired",
    "oldest_processing_seconds",
    "takeovers",
    "abandoned",
    "recoverable",
    "oldest_abandoned_seconds",
    "recovered",
    "recovery_released",
]


def prose_names(output: str) -> list[str]:
    return [line.split(": ", 1)[0] for line in output.splitlines()]


def document(app: Flask, *args: str) -> dict[str, Any]:
    result = run(app, *args, "--json")
    assert result.exit_code == 0, result.output
    parsed: dict[str, Any] = json.loads(result.stdout)
    return parsed


def test_show_json_has_the_prose_fields(cli_app: Flask) -> None:
    sent = {"Idempotency-Key": "shown"}
    assert cli_app.test_client().post("/pay", json={}, headers=sent).status_code == 201
    prose = run(cli_app, "show", "shown")
    shown = document(cli_app, "show", "shown")
    assert list(shown) == prose_names(prose.output) == SHOW_FIELDS
    assert shown["state"] == "completed" and shown["status"] == 201
    assert shown["expired"] is False and shown["lease_live"] is False
    assert shown["lease_expires_at"] is None and "lease_expires_at: -" in prose.output
    assert isinstance(shown["age_seconds"], float)
    assert len(shown["record"]) == 12  # the short label the logs carry, not the key

    with_body = document(cli_app, "show", "shown", "--body")
    assert list(with_body) == [*SHOW_FIELDS, "headers", "body"]
    assert json.loads(with_body["body"]) == {"paid": True}
    assert ["Content-Type", "application/json"] in with_body["headers"]
    prose_body = run(cli_app, "show", "shown", "--body")
    names = prose_names(prose_body.output)  # the body's own lines follow "body: "
    assert names[: len(SHOW_FIELDS) + 2] == [*SHOW_FIELDS, "headers", "body"]


def test_show_json_of_an_in_flight_expired_record(cli_app: Flask, clean_db: str) -> None:
    sent = {"Idempotency-Key": "old"}
    assert cli_app.test_client().post("/pay", json={}, headers=sent).status_code == 201
    query(
        clean_db,
        "UPDATE idempotency_records SET state = 'processing', completed_at = NULL,"
        " status_code = NULL, lease_expires_at = now() + interval '1 minute',"
        " expires_at = now() - interval '1 second'",
    )
    shown = document(cli_app, "show", "old")
    assert shown["state"] == "processing" and shown["expired"] is True
    assert shown["lease_live"] is True and shown["status"] is None
    assert "expired: yes" in run(cli_app, "show", "old").output


def test_stats_json_has_the_prose_fields_as_numbers(cli_app: Flask, clean_db: str) -> None:
    seed_expired(clean_db, 4)
    prose = run(cli_app, "stats")
    figures = document(cli_app, "stats")
    assert list(figures) == prose_names(prose.output) == STATS_FIELDS
    assert figures["expired"] == 4 and "expired: 4" in prose.output
    for name, value in figures.items():
        expected = float if name.endswith("_seconds") else int
        assert type(value) is expected, name


def test_json_of_a_missing_record_leaves_stdout_empty(cli_app: Flask) -> None:
    result = run(cli_app, "show", "absent", "--json")
    assert result.exit_code == 1
    assert result.stdout == "" and "no record" in result.stderr
