"""``flask idempotency migrate | purge | show | unlock`` through the CLI runner."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import psycopg2
from flask import Flask

from flask_idempotency.store import migrations

MakeApp = Callable[..., Flask]


def run(app: Flask, *args: str) -> Any:
    return app.test_cli_runner().invoke(args=["idempotency", *args])


def execute(database_url: str, query: str) -> list[tuple[Any, ...]]:
    with psycopg2.connect(database_url) as conn, conn.cursor() as cur:
        cur.execute(query)
        rows = cur.fetchall() if cur.description else []
    conn.close()
    return rows


def charge(app: Flask, key: str, auth: str = "Bearer sk_1", **body: Any) -> Any:
    return app.test_client().post(
        "/charges", json=body, headers={"Idempotency-Key": key, "Authorization": auth}
    )


def test_migrate_is_idempotent_and_safe_in_parallel(make_app: MakeApp, database_url: str) -> None:
    app = make_app()
    result = run(app, "migrate")
    assert result.exit_code == 0, result.output
    assert "0 migration(s) applied" in result.output
    errors: list[BaseException] = []

    def migrate() -> None:
        try:
            app.extensions["idempotency"].store.migrate()
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=migrate) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    names = {n for n, _ in migrations.package_migrations()}
    applied = {
        r[0] for r in execute(database_url, "SELECT name FROM idempotency_schema_migrations")
    }
    assert names <= applied


def test_purge_deletes_expired_records_in_batches(make_app: MakeApp, database_url: str) -> None:
    app = make_app()
    for i in range(7):
        charge(app, f"key-{i}")
    execute(
        database_url,
        "UPDATE idempotency_records SET expires_at = now() - interval '1 minute'"
        " WHERE record_key IN (SELECT record_key FROM idempotency_records LIMIT 5)",
    )
    dry = run(app, "purge", "--dry-run")
    assert "5 expired record(s) would be deleted" in dry.output
    assert execute(database_url, "SELECT count(*) FROM idempotency_records") == [(7,)]
    result = run(app, "purge", "--batch-size", "2")
    assert result.exit_code == 0
    assert "5 expired record(s) deleted" in result.output
    assert execute(database_url, "SELECT count(*) FROM idempotency_records") == [(2,)]
    assert run(app, "purge", "--batch-size", "0").exit_code != 0


def test_show_prints_state_and_body_only_on_request(make_app: MakeApp) -> None:
    app = make_app()
    charge(app, "shown-key", amount=987654321)
    plain = run(app, "show", "shown-key", "--authorization", "Bearer sk_1")
    assert plain.exit_code == 0, plain.output
    assert "state: completed" in plain.output
    assert "status: 201" in plain.output
    assert "987654321" not in plain.output
    with_body = run(app, "show", "shown-key", "--authorization", "Bearer sk_1", "--body")
    assert '"amount":987654321' in with_body.output.replace(" ", "")
    other_scope = run(app, "show", "shown-key", "--authorization", "Bearer sk_2")
    assert other_scope.exit_code != 0
    assert "no record" in other_scope.output
    assert run(app, "show", "bad key").exit_code != 0


def test_unlock_releases_a_stuck_processing_record(make_app: MakeApp, database_url: str) -> None:
    app = make_app()
    charge(app, "stuck")
    execute(database_url, "UPDATE idempotency_records SET state = 'processing', lock_token = 1")
    assert charge(app, "stuck").status_code == 409
    result = run(app, "unlock", "stuck", "--authorization", "Bearer sk_1")
    assert result.exit_code == 0, result.output
    assert charge(app, "stuck").status_code == 201
    assert run(app, "unlock", "stuck", "--authorization", "Bearer sk_1").exit_code != 0


def test_cli_reports_an_unreachable_database(make_app: MakeApp) -> None:
    app = make_app(IDEMPOTENCY_AUTO_MIGRATE=False)
    app.extensions["idempotency"].store.pool._dsn = "postgresql://postgres@127.0.0.1:9/none"
    result = run(app, "purge")
    assert result.exit_code != 0
    assert "Traceback" not in result.output


def test_stats_and_metrics_count_what_happened(make_app: MakeApp, database_url: str) -> None:
    app = make_app()
    charge(app, "a")
    charge(app, "a")
    charge(app, "a", amount=2)
    charge(app, "b", status=500)
    execute(
        database_url,
        "INSERT INTO idempotency_records (record_key, fingerprint, state, lock_token,"
        " lease_expires_at, expires_at) VALUES ('\\x01', '\\x02', 'processing', 1,"
        " now() - interval '1 minute', now() + interval '1 day')",
    )
    result = run(app, "stats")
    assert result.exit_code == 0, result.output
    assert "completed: 1" in result.output
    assert "processing: 1" in result.output
    assert "lease_expired: 1" in result.output
    with app.app_context():
        metrics = app.extensions["idem"].metrics()
    assert metrics["executed"] == 2
    assert metrics["completed"] == 1
    assert metrics["released"] == 1
    assert metrics["replayed_from_store"] == 1
    assert metrics["key_reused"] == 1
