"""Progress of purge, recover --once and relay --once: a bar on a terminal, lines in a log."""

from __future__ import annotations

import io
import os
import re
import secrets
from collections.abc import Iterator

import pytest
from flask import Flask

from flask_idempotency.cli.progress import Progress
from support.clock import FakeClock
from support.pg_query import query

from .conftest import count, run, seed_abandoned, seed_events, seed_expired

LINE = re.compile(r"^(?P<label>[a-z ]+): (?P<done>\d+)(/(?P<total>\d+) \(\d+%\))?, \d+/s, ")


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def progress_lines(stderr: str, label: str) -> list[tuple[int, int | None]]:
    found = []
    for line in stderr.splitlines():
        match = LINE.match(line)
        if match and match["label"] == label:
            total = int(match["total"]) if match["total"] else None
            found.append((int(match["done"]), total))
    return found


def test_off_a_terminal_a_line_per_interval_and_none_for_a_short_run() -> None:
    clock, log = FakeClock(), io.StringIO()
    with Progress("deleting", total=100, interval=10, stream=log, clock=clock) as progress:
        progress.advance(10)
        clock.now += 5
        progress.advance(10)
        assert log.getvalue() == ""  # under 10 s: nothing yet
        clock.now += 5
        progress.advance(20)
        clock.now += 20
        progress.advance(10)
    assert log.getvalue().splitlines() == [
        "deleting: 40/100 (40%), 4/s, 0:00:10 elapsed",
        "deleting: 50/100 (50%), 2/s, 0:00:30 elapsed",
    ]


def test_a_total_overtaken_grows_and_an_unknown_total_counts() -> None:
    clock, log = FakeClock(), io.StringIO()
    progress = Progress("x", total=2, interval=0, stream=log, clock=clock)
    clock.now += 1
    progress.advance(3)  # rows that expired after the count
    assert progress.line() == "x: 3/3 (100%), 3/s, 0:00:01 elapsed"
    unknown = Progress("y", interval=0, stream=log, clock=clock)
    clock.now += 2
    unknown.advance(4)
    assert unknown.line() == "y: 4, 2/s, 0:00:02 elapsed"


def test_on_a_terminal_clicks_bar_shows_done_total_rate_and_elapsed() -> None:
    tty = Terminal()
    with Progress("deleting", total=10, stream=tty) as progress:
        for _ in range(5):
            progress.advance(2)
        progress.advance(1)  # one more than counted: the bar grows, never overflows
    shown = tty.getvalue()
    assert "\r" in shown and "deleting" in shown
    assert "4/10" in shown and "11/11" in shown and "/s" in shown and "elapsed" in shown
    with Progress("recovering", stream=tty) as unknown:  # no total: a position only
        unknown.advance(3)
    assert "recovering" in tty.getvalue() and "]  3  " in tty.getvalue()


def test_purge_reports_each_batch_when_asked_and_ends_with_totals(
    cli_app: Flask, clean_db: str
) -> None:
    seed_expired(clean_db, 35)
    query(
        clean_db,
        "INSERT INTO idempotency_outbox (id, event_type, payload, published_at, expires_at)"
        " SELECT 'evt_' || i, 't', '{}', now(), now() - interval '1 s'"
        " FROM generate_series(1, 12) AS i",
    )
    result = run(cli_app, "purge", "--batch-size", "10", "--progress-interval", "0")
    assert result.exit_code == 0, result.output
    assert progress_lines(result.stderr, "deleting expired records") == [
        (10, 35),
        (20, 35),
        (30, 35),
        (35, 35),
    ]
    assert progress_lines(result.stderr, "deleting published events") == [(10, 12), (12, 12)]
    assert result.stdout == "35 expired record(s) deleted\n12 published event(s) deleted\n"
    assert count(clean_db) == 0 and count(clean_db, "idempotency_outbox") == 0


def test_recover_once_reports_each_record(cli_app: Flask, clean_db: str) -> None:
    seed_abandoned(clean_db, 12)
    result = run(cli_app, "recover", "--once", "--older-than", "0", "--batch-size", "5",
                 "--progress-interval", "0")  # fmt: skip
    assert result.exit_code == 0, result.output
    lines = progress_lines(result.stderr, "recovering abandoned records")
    assert lines == [(n, None) for n in range(1, 13)]
    assert "recovered 0, released 12" in result.stdout
    assert count(clean_db) == 0


@pytest.fixture
def exchange() -> Iterator[tuple[str, str]]:
    """A topic exchange with a queue taking every ``cli.*`` event; deleted afterwards."""
    url = os.environ.get("AMQP_URL")
    if not url:
        if os.environ.get("CI"):
            pytest.fail("AMQP_URL is unset under CI")
        pytest.skip("AMQP_URL is unset: no RabbitMQ")
    import kombu

    name = "tcli" + secrets.token_hex(4)
    ex = kombu.Exchange(name, type="topic", durable=True)
    with kombu.Connection(url, connect_timeout=5) as conn:
        channel = conn.channel()
        ex(channel).declare()
        queue = kombu.Queue(name, bindings=[kombu.binding(ex, routing_key="cli.*")])
        queue(channel).declare()
        yield url, name
        channel.queue_delete(name)
        channel.exchange_delete(name)


def test_relay_once_reports_each_batch_against_the_pending_count(
    cli_app: Flask, clean_db: str, exchange: tuple[str, str]
) -> None:
    url, name = exchange
    seed_events(clean_db, 25)
    args = ["relay", "--once", "--broker-url", url, "--exchange", name, "--batch-size", "10"]
    result = run(cli_app, *args, "--progress-interval", "0")
    assert result.exit_code == 0, result.output
    lines = progress_lines(result.stderr, "publishing events")
    assert lines == [(10, 25), (20, 25), (25, 25)]
    assert result.stdout == "25 event(s) published, 0 deferred\n"
    pending = "SELECT count(*) FROM idempotency_outbox WHERE published_at IS NULL"
    assert query(clean_db, pending) == [(0,)]
