"""Migrations only add: the files the previous release did not have change nothing it
uses (``sql_rules``), and the files it had are still the ones it applied.

Read from the files alone, so it also runs where no server does. The extension's
schema (``flask_idempotency/schema``) and the example app's (``migrations/``,
applied by its workers through ``IDEMPOTENCY_MIGRATION_DIRS``) roll the same way.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import NoReturn

import pytest

from support.gunicorn_server import REPO_ROOT

from .rollout import PREVIOUS_COMMIT
from .sql_rules import defined_routines, statements, violations

#: Each directory of migrations, and the last of its files the previous release had.
DIRECTORIES = {"flask_idempotency/schema": "0009", "migrations": "0003"}


def _files(directory: str) -> list[Path]:
    return sorted((REPO_ROOT / directory).glob("[0-9][0-9][0-9][0-9]_*.sql"))


def _split(directory: str) -> tuple[list[Path], list[Path]]:
    """(the previous release's files, the files after them)."""
    last = DIRECTORIES[directory]
    files = _files(directory)
    return [f for f in files if f.name[:4] <= last], [f for f in files if f.name[:4] > last]


@pytest.mark.parametrize("directory", sorted(DIRECTORIES))
def test_files_after_the_previous_release_only_add(directory: str) -> None:
    released, added = _split(directory)
    assert released, f"no migrations found in {directory}"
    seen = [f.read_text("utf-8") for f in released]
    problems = []
    for path in added:
        source = path.read_text("utf-8")
        problems += [f"{path.name}: {v}" for v in violations(source, defined_routines(seen))]
        seen.append(source)
    assert not problems, "not add-only:\n" + "\n".join(problems)


def _git(*args: str) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            ["git", "-C", str(REPO_ROOT), *args],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except FileNotFoundError as exc:
        _unavailable(f"git is not installed: {exc}")


def _previous_text(path: str) -> str | None:
    """``path`` as the previous release had it; None if it had no such file."""
    commit = _git("cat-file", "-e", f"{PREVIOUS_COMMIT}^{{commit}}")
    if commit.returncode != 0:
        _unavailable(
            f"commit {PREVIOUS_COMMIT} is not in {REPO_ROOT}: {commit.stderr.strip()} "
            "(a shallow clone? `git fetch --unshallow` brings the history back)"
        )
    shown = _git("show", f"{PREVIOUS_COMMIT}:{path}")
    return shown.stdout if shown.returncode == 0 else None


def _unavailable(message: str) -> NoReturn:
    """No history to compare with: a failure under CI, else a skip that says why."""
    if os.environ.get("CI"):
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


@pytest.mark.parametrize("directory", sorted(DIRECTORIES))
def test_the_previous_release_files_are_unchanged(directory: str) -> None:
    """A database the previous release migrated never runs its files again: a change
    to one would leave upgraded and new databases different. Comments may change."""
    released, added = _split(directory)
    for path in released:
        before = _previous_text(f"{directory}/{path.name}")
        assert before is not None, f"{path.name} is not a file of the previous release"
        assert statements(path.read_text("utf-8")) == statements(before), (
            f"{directory}/{path.name} changed since the previous release"
        )
    following = _previous_text(f"{directory}/{added[0].name}") if added else None
    assert following is None, f"{added[0].name} was in the previous release: update DIRECTORIES"


# The rules themselves, on statements that break the previous release's workers and
# on statements that do not (the files after 0009 may not exist yet).

EARLIER = {"idempotency_complete", "idempotency_claim_in_transaction_rw"}

BREAKING = [
    ("DROP INDEX IF EXISTS idempotency_records_recoverable_idx;", "DROP"),
    ("ALTER TABLE idempotency_records DROP COLUMN phases;", "DROP"),
    ("ALTER TABLE idempotency_records DROP CONSTRAINT x;", "DROP"),
    ("ALTER TABLE idempotency_records RENAME COLUMN body TO answer;", "RENAME"),
    ("ALTER TABLE idempotency_records ALTER COLUMN status_code TYPE integer;", "type"),
    ("ALTER TABLE t ALTER status_code SET DATA TYPE integer;", "type"),
    ("ALTER TABLE idempotency_records ALTER COLUMN fingerprint SET NOT NULL;", "SET NOT NULL"),
    ("ALTER TABLE t ADD COLUMN version smallint NOT NULL;", "without a default"),
    ("ALTER TABLE t ADD COLUMN a text, ADD COLUMN b int NOT NULL;", "column b"),
    ("TRUNCATE idempotency_records;", "TRUNCATE"),
    (
        "CREATE OR REPLACE FUNCTION idempotency_complete(p bytea) RETURNS void"
        " LANGUAGE sql AS $$ SELECT 1 $$;",
        "CREATE OR REPLACE of the function idempotency_complete",
    ),
    (
        'CREATE OR REPLACE FUNCTION public."idempotency_complete"(p bytea) RETURNS void'
        " LANGUAGE sql AS $$ SELECT 1 $$;",
        "CREATE OR REPLACE",
    ),
    (
        "CREATE FUNCTION idempotency_claim_in_transaction_rw(a bytea, b bigint) RETURNS void"
        " LANGUAGE sql AS $$ SELECT 1 $$;",
        "a new function named",
    ),
    (
        "CREATE FUNCTION idempotency_v2(p bytea) RETURNS void LANGUAGE plpgsql AS $body$"
        " BEGIN DROP TABLE idempotency_outbox; END $body$;",
        "DROP",
    ),
]

ADD_ONLY = [
    "ALTER TABLE idempotency_records ADD COLUMN IF NOT EXISTS fingerprint_version smallint;",
    "ALTER TABLE t ADD COLUMN v smallint NOT NULL DEFAULT 1, ADD COLUMN w text;",
    "ALTER TABLE t ADD COLUMN v smallint; ALTER TABLE t ALTER COLUMN v SET DEFAULT 1;",
    "ALTER TABLE t ADD COLUMN v int DEFAULT 0; ALTER TABLE t ALTER COLUMN v SET NOT NULL;",
    "ALTER TABLE t ADD CONSTRAINT t_v CHECK (v IS NULL OR v > 0) NOT VALID;",
    "CREATE TABLE IF NOT EXISTS idempotency_new (id bigint PRIMARY KEY, x text NOT NULL);",
    "CREATE INDEX IF NOT EXISTS t_idx ON idempotency_records (record_key);",
    "-- DROP TABLE idempotency_records; (a comment)\nSELECT 'DROP TABLE x; RENAME';",
    "/* ALTER TABLE t DROP COLUMN c */ CREATE OR REPLACE FUNCTION idempotency_claim_v2(k bytea)"
    " RETURNS void LANGUAGE plpgsql AS $$ BEGIN PERFORM 1; END $$;",
    "CREATE OR REPLACE FUNCTION idempotency_complete_v2(p bytea) RETURNS void"
    " LANGUAGE sql AS $$ SELECT 'dropped; renamed' $$;",
]


@pytest.mark.parametrize(("sql", "reason"), BREAKING)
def test_the_rules_refuse_what_breaks_old_workers(sql: str, reason: str) -> None:
    found = violations(sql, EARLIER)
    assert found, sql
    assert any(reason in v.reason for v in found), [str(v) for v in found]


@pytest.mark.parametrize("sql", ADD_ONLY)
def test_the_rules_let_additions_through(sql: str) -> None:
    assert violations(sql, EARLIER) == []


def test_the_rules_would_have_refused_the_previous_release_last_file() -> None:
    """0009 dropped an index and a CHECK and replaced two functions in place: fine
    before rolling upgrades were promised, caught by the rules now."""
    released, _ = _split("flask_idempotency/schema")
    *earlier, last = released
    found = violations(last.read_text("utf-8"), defined_routines(p.read_text() for p in earlier))
    reasons = " | ".join(v.reason for v in found)
    assert "DROP" in reasons
    assert "CREATE OR REPLACE of the function idempotency_complete" in reasons
    assert "CREATE OR REPLACE of the function idempotency_insert_completed" in reasons
