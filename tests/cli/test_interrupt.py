"""Ctrl-C and SIGTERM stop a long command between batches; it says what it did.

The first signal only sets an event; the command finishes the batch (or record)
in hand, prints its totals and exits 128 + signal. The purge of a real process
is interrupted in ``test_subprocess``.
"""

from __future__ import annotations

import os
import signal

import pytest
from flask import Flask

from flask_idempotency.cli.stop import stop_on_signals
from support.pg_query import query

from .app import create_app
from .conftest import run, seed_abandoned


def test_the_first_signal_sets_the_event_a_second_ctrl_c_raises() -> None:
    before = signal.getsignal(signal.SIGINT)
    with stop_on_signals() as stop:
        assert not stop.is_set()
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.wait(5) and stop.exit_code == 130 and stop.name == "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before
    with stop_on_signals() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.wait(5) and stop.exit_code == 143
    assert signal.getsignal(signal.SIGINT) is before


def test_ctrl_c_stops_recover_once_after_the_record_in_hand(clean_db: str) -> None:
    seen: list[int] = []

    def interrupt_at_the_third() -> None:
        seen.append(1)
        if len(seen) == 3:
            os.kill(os.getpid(), signal.SIGINT)

    app: Flask = create_app(clean_db, {"CLI_TEST_ON_RECOVER": interrupt_at_the_third})
    try:
        seed_abandoned(clean_db, 10)
        result = run(app, "recover", "--once", "--older-than", "0", "--batch-size", "5")
    finally:
        app.extensions["idempotency"].close()
    assert result.exit_code == 130, result.output
    assert result.stdout == "recovered 0, released 3, deferred 0, fenced 0, skipped 0\n"
    assert "interrupted by SIGINT" in result.stderr and "released 3" in result.stderr
    # The rest of the batch was handed back at once, abandoned again for the next run.
    left = query(
        clean_db,
        "SELECT count(*), bool_and(lease_expires_at <= now()) FROM idempotency_records",
    )
    assert left == [(7, True)]
