"""``flask idempotency doctor``: each misconfiguration named, with what fixes it.

This file: the command as a whole (exit status, prose and JSON, isolation of
checks, speed). Each check has tests of its own in ``test_doctor_*.py``.
"""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.pg_query import query

from .doctoring import app_on, checks, doctor, migrated

ROOT = Path(__file__).resolve().parents[2]


def autovacuum_on(database_url: str) -> bool:
    """The run's server may have autovacuum off (a test server's speed-up): the
    doctor rightly fails it, and the tests of other checks allow for that."""
    return bool(query(database_url, "SELECT current_setting('autovacuum')::bool")[0][0])


def test_a_forgotten_migrate_is_named_with_its_command(fresh_database_url: str) -> None:
    with app_on(fresh_database_url) as app:
        code, output = doctor(app, "--json")
        assert code == 1
        report = json.loads(output)
        schema = next(c for c in report["checks"] if c["name"] == "schema")
        assert report["ok"] is False and schema["status"] == "fail"
        assert "not applied" in schema["detail"]
        assert "flask idempotency migrate" in schema["fix"]

        app.test_cli_runner().invoke(args=["idempotency", "migrate"])
        code, output = doctor(app)
        assert "OK    schema" in output and "every migration is applied" in output
        if autovacuum_on(fresh_database_url):
            assert code == 0, output


def test_before_migrate_the_checks_reading_our_tables_skip_instead_of_crashing(
    fresh_database_url: str,
) -> None:
    """Issue 39: on a database without the schema, relay (and purge) crashed with
    UndefinedTable; like autovacuum they now skip, and only the schema check fails."""
    with app_on(
        fresh_database_url, IDEMPOTENCY_BROKER_URL="amqp://guest:guest@127.0.0.1:9//"
    ) as app:
        report = json.loads(doctor(app, "--json")[1])
    found = {c["name"]: c for c in report["checks"]}
    for name in ("relay", "purge"):
        assert found[name]["status"] == "warn", found[name]
        assert found[name]["detail"].startswith("skipped: the idempotency schema is not in place")
        assert found[name]["fix"] == "flask idempotency migrate"
    assert [c["name"] for c in report["checks"] if c["status"] == "fail"] == ["schema", "broker"]
    assert not any("could not run" in c["detail"] for c in report["checks"])


def test_unreachable_parts_fail_or_warn_and_the_checks_needing_postgresql_are_skipped(
    clean_db: str,
) -> None:
    with app_on(
        "postgresql://postgres@127.0.0.1:9/none",
        IDEMPOTENCY_DATABASE_OPTIONS={"connect_timeout": 1},
        IDEMPOTENCY_REDIS_URL="redis://127.0.0.1:9/0",
        IDEMPOTENCY_BROKER_URL="amqp://guest:guest@127.0.0.1:9//",
        IDEMPOTENCY_TESTING_DRILLS=True,
    ) as app:
        code, output = doctor(app, "--json")
        statuses = {c["name"]: c["status"] for c in json.loads(output)["checks"]}
        assert code == 1
        assert statuses == {
            "database": "fail",
            "pool": "ok",
            "lease": "ok",
            "scope": "warn",  # global_scope, chosen explicitly
            "cache": "warn",
            "broker": "fail",
            "prometheus": "ok",
            "testing drills": "warn",
        }


def test_a_check_that_raises_is_a_fail_line_and_the_others_still_run(
    clean_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(ctx: object) -> None:
        raise ZeroDivisionError("division by zero")

    # The package, not the click command of the same name in flask_idempotency.cli.
    package = importlib.import_module("flask_idempotency.cli.doctor")
    replaced = tuple((n, broken if n == "clock" else f, needs) for n, f, needs in package.CHECKS)
    monkeypatch.setattr(package, "CHECKS", replaced)
    with app_on(clean_db) as app:
        migrated(app)
        code, output = doctor(app)
    assert code == 1
    assert "Traceback" not in output
    assert re.search(r"^FAIL  clock +the check could not run: ZeroDivisionError", output, re.M)
    # Every other check still has its line, the summary too.
    for name in ("database", "schema", "autovacuum", "pool", "lease", "scope", "completer"):
        assert re.search(rf"^(OK|WARN|FAIL) +{name} ", output, re.M), name
    assert re.search(r"^\d+ checks: \d+ ok, \d+ warn, [1-9]\d* fail$", output, re.M)


def test_prose_shows_one_line_per_check_with_the_fix_under_each_problem(clean_db: str) -> None:
    with app_on(clean_db, IDEMPOTENCY_TESTING_DRILLS=True) as app:
        migrated(app)
        code, output = doctor(app)
    lines = output.splitlines()
    drills = next(i for i, line in enumerate(lines) if "testing drills" in line)
    assert lines[drills].startswith("WARN  testing drills")
    assert lines[drills + 1].strip() == "-> turn it off outside test configurations"
    assert lines[-1].startswith(
        f"{sum(1 for line in lines if line[:4] in ('OK  ', 'WARN', 'FAIL'))} checks:"
    )


def test_on_healthy_servers_the_doctor_takes_well_under_two_seconds(
    clean_db: str, clean_redis: str
) -> None:
    with app_on(clean_db, IDEMPOTENCY_REDIS_URL=clean_redis) as app:
        migrated(app)
        checks(app)  # connections opened, modules imported: what a CLI start pays
        started = time.monotonic()
        found = checks(app)
        elapsed = time.monotonic() - started
    assert elapsed < 2.0, {name: c.ms for name, c in found.items()}
    assert {"cache", "redis memory"} <= set(found)


def test_doctor_through_a_real_process_on_a_sound_setup(clean_db: str, tmp_path: Path) -> None:
    """The example app, migrated: no check fails (but autovacuum, where the run's
    server has it off) and the exit status says so."""
    env = {"DATABASE_URL": clean_db, "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    flask = [sys.executable, "-m", "flask", "--app", "example_app"]
    subprocess.run(
        [*flask, "idempotency", "migrate"], cwd=tmp_path, env=env, check=True, capture_output=True
    )
    done = subprocess.run(
        [
            *flask,
            "idempotency",
            "doctor",
            "--json",
            "--gunicorn-config",
            str(ROOT / "gunicorn.conf.py"),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    report = json.loads(done.stdout)
    failed = [c["name"] for c in report["checks"] if c["status"] == "fail"]
    if autovacuum_on(clean_db):
        assert done.returncode == 0 and report["ok"] is True, done.stdout
    else:
        assert failed == ["autovacuum"] and done.returncode == 1, done.stdout
    names = [c["name"] for c in report["checks"]]
    assert names[:2] == ["database", "schema"]
    assert {"pool", "lease", "scope", "prometheus", "relay", "completer"} <= set(names)
    assert all(isinstance(c["ms"], float) for c in report["checks"])


def test_the_operations_page_shows_what_the_doctor_prints(clean_db: str, clean_redis: str) -> None:
    """docs/operations.md's sample is a real run: the same checks, in the same order,
    in the same layout, as the doctor prints for an app with Redis and no broker."""
    page = (ROOT / "docs" / "operations.md").read_text()
    sample = page.split("## What it prints", 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    shown = re.findall(r"^(?:OK|WARN|FAIL) +(\S+(?: \S+)?)  ", sample, re.M)
    with app_on(clean_db, IDEMPOTENCY_REDIS_URL=clean_redis) as app:
        migrated(app)
        code, output = doctor(app)
    printed = re.findall(r"^(?:OK|WARN|FAIL) +(\S+(?: \S+)?)  ", output, re.M)
    assert len(shown) == 16
    assert [name.strip() for name in shown] == [name.strip() for name in printed]
    assert re.search(r"^16 checks: \d+ ok, \d+ warn, \d+ fail$", sample, re.M)
    assert re.search(r"^ +-> ", sample, re.M)  # a fix, under its problem
