"""Exit status, stable for scripts: 0 done, 1 failed, 2 usage (130/143: test_interrupt)."""

from __future__ import annotations

from flask import Flask

from support.dead_store import make_unreachable

from .app import create_app
from .conftest import run, seed_expired


def test_done_is_0(cli_app: Flask, clean_db: str) -> None:
    seed_expired(clean_db, 3)
    for args in (
        ["migrate"],
        ["stats"],
        ["stats", "--json"],
        ["purge", "--dry-run"],
        ["purge"],
        ["recover", "--once"],
    ):
        result = run(cli_app, *args)
        assert result.exit_code == 0, (args, result.output)


def test_usage_errors_are_2(cli_app: Flask) -> None:
    for args in (
        ["purge", "--batch-size", "0"],
        ["purge", "--no-such-option"],
        ["show"],  # KEY missing
        ["show", "not a valid key"],
        ["show", "k", "--header", "no colon"],
        ["stats", "extra"],
        ["recover", "--older-than", "-1"],
        ["no-such-command"],
    ):
        result = run(cli_app, *args)
        assert result.exit_code == 2, (args, result.output)
        assert "Traceback" not in result.output


def test_failures_are_1(cli_app: Flask, clean_db: str) -> None:
    assert run(cli_app, "show", "absent").exit_code == 1
    assert run(cli_app, "show", "absent", "--json").exit_code == 1
    assert run(cli_app, "unlock", "absent").exit_code == 1
    no_broker = run(cli_app, "relay", "--once")
    assert no_broker.exit_code == 1 and "no broker" in no_broker.output

    transaction_mode = create_app(clean_db, {"IDEMPOTENCY_CLAIM_MODE": "transaction"})
    try:
        refused = run(transaction_mode, "recover", "--once")
        assert refused.exit_code == 1 and "IDEMPOTENCY_CLAIM_MODE" in refused.output
    finally:
        transaction_mode.extensions["idempotency"].close()


def test_an_unreachable_database_is_1_without_a_traceback(clean_db: str) -> None:
    app = create_app(clean_db, {"IDEMPOTENCY_AUTO_MIGRATE": False})
    make_unreachable(app)
    try:
        for args in (["purge", "--yes"], ["stats", "--json"], ["show", "k"], ["unlock", "k"]):
            result = run(app, *args)
            assert result.exit_code == 1, (args, result.output)
            # An uncaught exception is exit 1 too: the runner keeps it instead of
            # printing its traceback. Only click's own exit is a one-line error.
            assert isinstance(result.exception, SystemExit), (args, result.exception)
            assert result.output.startswith("Error: "), (args, result.output)
            assert result.stdout == ""  # no half document for a script to parse
    finally:
        app.extensions["idempotency"].close()


def test_every_command_shows_an_example_in_its_help(cli_app: Flask) -> None:
    for command in (
        "",
        "migrate",
        "purge",
        "show",
        "stats",
        "recover",
        "unlock",
        "relay",
        "doctor",
    ):
        args = [command, "--help"] if command else ["--help"]
        result = run(cli_app, *args)
        assert result.exit_code == 0, result.output
        assert "Example" in result.output, command
        assert "flask --app example_app idempotency" in result.output, command
    assert "Exit status" in run(cli_app, "--help").output
