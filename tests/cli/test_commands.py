"""``flask idempotency migrate | purge | show | unlock`` through the CLI runner."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from flask import Flask

from flask_idempotency import global_scope
from flask_idempotency.store import migrations
from support.dead_store import make_unreachable
from support.pg_query import query

MakeApp = Callable[..., Flask]


def run(app: Flask, *args: str, stdin: str | None = None, env: dict[str, str] | None = None) -> Any:
    return app.test_cli_runner().invoke(args=["idempotency", *args], input=stdin, env=env)


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
    applied = {r[0] for r in query(database_url, "SELECT name FROM idempotency_schema_migrations")}
    assert names <= applied


def test_purge_deletes_expired_records_in_batches(make_app: MakeApp, database_url: str) -> None:
    app = make_app()
    for i in range(7):
        charge(app, f"key-{i}")
    query(
        database_url,
        "UPDATE idempotency_records SET expires_at = now() - interval '1 minute'"
        " WHERE record_key IN (SELECT record_key FROM idempotency_records LIMIT 5)",
    )
    dry = run(app, "purge", "--dry-run")
    assert "5 expired record(s) would be deleted" in dry.output
    assert query(database_url, "SELECT count(*) FROM idempotency_records") == [(7,)]
    result = run(app, "purge", "--batch-size", "2")
    assert result.exit_code == 0
    assert "5 expired record(s) deleted" in result.output
    assert query(database_url, "SELECT count(*) FROM idempotency_records") == [(2,)]
    assert run(app, "purge", "--batch-size", "0").exit_code != 0


def test_show_prints_state_and_body_only_on_request(make_app: MakeApp) -> None:
    app = make_app()
    charge(app, "shown-key", amount=987654321)
    plain = run(app, "show", "shown-key", "--authorization", stdin="Bearer sk_1\n")
    assert plain.exit_code == 0, plain.output
    assert "state: completed" in plain.output
    assert "status: 201" in plain.output
    assert "987654321" not in plain.output
    with_body = run(app, "show", "shown-key", "--authorization", "--body", stdin="Bearer sk_1\n")
    assert '"amount":987654321' in with_body.output.replace(" ", "")
    other_scope = run(app, "show", "shown-key", "--authorization", stdin="Bearer sk_2\n")
    assert other_scope.exit_code != 0
    assert "no record" in other_scope.output
    assert run(app, "show", "bad key").exit_code != 0


def test_unlock_releases_a_stuck_processing_record(make_app: MakeApp, database_url: str) -> None:
    app = make_app()
    charge(app, "stuck")
    query(database_url, "UPDATE idempotency_records SET state = 'processing', lock_token = 1")
    assert charge(app, "stuck").status_code == 409
    result = run(app, "unlock", "stuck", "--authorization", stdin="Bearer sk_1\n")
    assert result.exit_code == 0, result.output
    assert charge(app, "stuck").status_code == 201
    assert run(app, "unlock", "stuck", "--authorization", stdin="Bearer sk_1\n").exit_code != 0


def test_cli_reports_an_unreachable_database(make_app: MakeApp) -> None:
    app = make_app(IDEMPOTENCY_AUTO_MIGRATE=False)
    make_unreachable(app)
    result = run(app, "purge")
    assert result.exit_code != 0
    assert "Traceback" not in result.output


def test_stats_and_metrics_count_what_happened(make_app: MakeApp, database_url: str) -> None:
    app = make_app()
    charge(app, "a")
    charge(app, "a")
    charge(app, "a", amount=2)
    charge(app, "b", status=500)
    query(
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


@pytest.fixture
def example_app(clean_db: str) -> Iterator[Flask]:
    """The example payments API, which scopes records by the API key's owner."""
    from example_app import create_app
    from example_app.processor_client import InProcessProcessorClient
    from example_app.processor_core import FakeProcessor

    app = create_app(
        {
            "TESTING": True,
            "DATABASE_URL": clean_db,
            "REDIS_URL": None,
            "PROCESSOR_URL": None,
            "PROCESSOR_CLIENT": InProcessProcessorClient(FakeProcessor(), 2.0),
        }
    )
    yield app
    app.extensions["idempotency"].close()


def test_show_and_unlock_find_the_example_apps_records_by_authorization(
    example_app: Flask, clean_db: str
) -> None:
    """The README's own commands: the scope is the app's (the API key's owner),
    computed from the given header by the app's scope function."""
    body = {"amount": 1500, "currency": "usd", "customer": "cus_1", "source": "tok_visa"}
    sent = {"Authorization": "Bearer sk_test_cli", "Idempotency-Key": "order-1"}
    assert example_app.test_client().post("/v1/charges", json=body, headers=sent).status_code == 201

    shown = run(example_app, "show", "order-1", "--authorization", stdin="Bearer sk_test_cli\n")
    assert shown.exit_code == 0, shown.output
    assert "state: completed" in shown.output and "status: 201" in shown.output
    as_header = run(example_app, "show", "order-1", "--header", "authorization: Bearer sk_test_cli")
    assert as_header.exit_code == 0, as_header.output
    other = run(example_app, "show", "order-1", "--authorization", stdin="Bearer sk_test_other\n")
    assert other.exit_code != 0 and "no record" in other.output

    query(clean_db, "UPDATE idempotency_records SET state = 'processing', lock_token = 1")
    unlocked = run(
        example_app, "unlock", "order-1", "--authorization", stdin="Bearer sk_test_cli\n"
    )
    assert unlocked.exit_code == 0, unlocked.output
    assert query(clean_db, "SELECT count(*) FROM idempotency_records") == [(0,)]


def test_show_says_when_the_scope_function_finds_no_principal(example_app: Flask) -> None:
    for args, stdin in (
        ([], None),
        (["--authorization"], "Basic dXNlcjpwdw==\n"),
        (["--header", "X-Other: 1"], None),
    ):
        result = run(example_app, "show", "order-1", *args, stdin=stdin)
        assert result.exit_code != 0
        assert "finds no principal" in result.output and "--scope" in result.output
        assert "Traceback" not in result.output


def test_scope_options_are_checked(make_app: MakeApp) -> None:
    app = make_app()
    both = run(app, "show", "k", "--scope", "user:1", "--authorization", stdin="Bearer sk_1\n")
    assert both.exit_code != 0 and "not both" in both.output
    bad = run(app, "show", "k", "--header", "no colon here")
    assert bad.exit_code != 0 and "Name: value" in bad.output
    twice = run(
        app, "show", "k", "--authorization", "--header", "Authorization: Bearer b", stdin="a\n"
    )
    assert twice.exit_code != 0


def test_show_takes_a_raw_scope_and_the_global_scope_needs_no_option(make_app: MakeApp) -> None:
    user_app = make_app(IDEMPOTENCY_SCOPE_FUNC=lambda req: "user:42")
    charge(user_app, "by-user")
    assert "state: completed" in run(user_app, "show", "by-user", "--scope", "user:42").output
    assert run(user_app, "show", "by-user", "--scope", "user:7").exit_code != 0

    single = make_app(IDEMPOTENCY_SCOPE_FUNC=global_scope)
    charge(single, "shared")
    result = run(single, "show", "shared")
    assert result.exit_code == 0, result.output
    assert "state: completed" in result.output


def test_a_failing_scope_function_is_reported_without_a_traceback(make_app: MakeApp) -> None:
    def needs_a_view(req: Any) -> str:
        raise KeyError("user")

    app = make_app(IDEMPOTENCY_SCOPE_FUNC=needs_a_view)
    result = run(app, "show", "k", "--authorization", stdin="Bearer sk_1\n")
    assert result.exit_code != 0
    assert "failed for these headers" in result.output and "--scope" in result.output
    assert "Traceback" not in result.output


def test_a_clients_secret_never_needs_the_command_line(example_app: Flask, clean_db: str) -> None:
    """Contract section 7: the record is found from the environment or standard input;
    the old ``--authorization VALUE`` no longer takes a value (it would be in ``ps``)."""
    sent = {"Authorization": "Bearer sk_test_env", "Idempotency-Key": "order-env"}
    body = {"amount": 1500, "currency": "usd", "customer": "cus_1", "source": "tok_visa"}
    assert example_app.test_client().post("/v1/charges", json=body, headers=sent).status_code == 201

    env = {"IDEMPOTENCY_CLIENT_AUTHORIZATION": "Bearer sk_test_env"}
    by_env = run(example_app, "show", "order-env", "--authorization", env=env)
    assert by_env.exit_code == 0 and "state: completed" in by_env.output, by_env.output
    by_name = run(
        example_app, "show", "order-env", "--header", "Authorization", stdin="Bearer sk_test_env\n"
    )
    assert by_name.exit_code == 0 and "state: completed" in by_name.output, by_name.output
    nothing = run(example_app, "show", "order-env", "--authorization", stdin="")
    assert nothing.exit_code != 0 and "IDEMPOTENCY_CLIENT_AUTHORIZATION" in nothing.output
    old_style = run(example_app, "show", "order-env", "--authorization", "Bearer sk_test_env")
    assert old_style.exit_code != 0  # the value is now an unexpected extra argument

    shown = run(example_app, "show", "order-env", "--authorization", "--body", env=env)
    assert shown.exit_code == 0 and '"amount":1500' in shown.output.replace(" ", "")
    help_text = run(example_app, "show", "--help").output
    assert "WARNING" in help_text and "standard input" in help_text


def test_purge_dry_run_counts_records_and_events_as_purge_deletes_them(
    make_app: MakeApp, database_url: str
) -> None:
    """Issue 39: the dry run names both tables a purge deletes from, even at 0."""
    app = make_app()
    charge(app, "expired-key")
    query(database_url, "UPDATE idempotency_records SET expires_at = now() - interval '1 minute'")
    assert run(app, "purge", "--dry-run").output == (
        "1 expired record(s) would be deleted\n0 published event(s) would be deleted\n"
    )
    query(
        database_url,
        "INSERT INTO idempotency_outbox (id, event_type, payload, published_at, expires_at)"
        " SELECT 'evt_dry_' || i, 't', '{}', now(), now() - interval '1 s'"
        " FROM generate_series(1, 3) AS i",
    )
    dry = run(app, "purge", "--dry-run")
    assert (
        dry.output
        == "1 expired record(s) would be deleted\n3 published event(s) would be deleted\n"
    )
    assert query(database_url, "SELECT count(*) FROM idempotency_outbox") == [(3,)]
    purged = run(app, "purge", "--yes")
    assert purged.output == "1 expired record(s) deleted\n3 published event(s) deleted\n"
