"""``flask idempotency doctor``: each misconfiguration named, with what fixes it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from flask import Flask

from flask_idempotency import Idempotency, global_scope

ROOT = Path(__file__).resolve().parents[2]


def make_app(database_url: str, **config: object) -> Flask:
    app = Flask(__name__)
    app.config.update(IDEMPOTENCY_DATABASE_URL=database_url, IDEMPOTENCY_SCOPE_FUNC=global_scope)
    app.config.update(config)
    Idempotency(app)
    return app


def doctor(app: Flask, *args: str) -> tuple[int, str]:
    result = app.test_cli_runner().invoke(args=["idempotency", "doctor", *args])
    return result.exit_code, result.output


def test_a_forgotten_migrate_is_named_with_its_command(fresh_database_url: str) -> None:
    app = make_app(fresh_database_url)
    try:
        code, output = doctor(app, "--json")
        assert code == 1
        report = json.loads(output)
        schema = next(c for c in report["checks"] if c["name"] == "schema")
        assert report["ok"] is False and schema["status"] == "fail"
        assert "not applied" in schema["detail"]
        assert "flask idempotency migrate" in schema["fix"]

        app.test_cli_runner().invoke(args=["idempotency", "migrate"])
        code, output = doctor(app)
        assert code == 0, output
        assert "every migration is applied" in output
    finally:
        app.extensions["idempotency"].close()


def test_unreachable_parts_fail_or_warn(clean_db: str) -> None:
    app = make_app(
        "postgresql://postgres@127.0.0.1:9/none",
        IDEMPOTENCY_CONNECT_TIMEOUT=1,
        IDEMPOTENCY_REDIS_URL="redis://127.0.0.1:9/0",
        IDEMPOTENCY_BROKER_URL="amqp://guest:guest@127.0.0.1:9//",
        IDEMPOTENCY_TESTING_DRILLS=True,
    )
    try:
        code, output = doctor(app, "--json")
        statuses = {c["name"]: c["status"] for c in json.loads(output)["checks"]}
        assert code == 1
        assert statuses == {
            "database": "fail",
            "cache": "warn",
            "broker": "fail",
            "pool": "ok",
            "testing drills": "warn",
        }
    finally:
        app.extensions["idempotency"].close()


def test_doctor_through_a_real_process_on_a_sound_setup(clean_db: str) -> None:
    """The example app, migrated: every check passes and the exit status is 0."""
    env = {"DATABASE_URL": clean_db, "PATH": "/usr/bin:/bin"}
    flask = [sys.executable, "-m", "flask", "--app", "example_app"]
    subprocess.run(
        [*flask, "idempotency", "migrate"], cwd=ROOT, env=env, check=True, capture_output=True
    )
    done = subprocess.run(
        [*flask, "idempotency", "doctor", "--json"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["ok"] is True
    assert [c["name"] for c in report["checks"]][:2] == ["database", "schema"]
