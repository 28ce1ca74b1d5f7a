"""``flask idempotency ...``: thin commands over the store's maintenance methods.

How they talk to an operator lives in small modules of its own: progress
(``progress.py``), stopping between batches (``stop.py``), prose or JSON
(``output.py``) and confirmation (``prompts.py``); ``relay.py`` is the relay command,
``records.py`` the commands about one record (``show``, ``unlock``).

Exit status, stable for scripts: 0 done; 1 failed (store unreachable, no such
record, a "no" at a prompt); 2 usage (bad option, or ``--yes`` missing where a
script must give it); 130 / 143 stopped between batches by SIGINT / SIGTERM.
"""

from __future__ import annotations

import json

import click
from flask import current_app
from flask.cli import AppGroup

from .. import completer
from ..events import outbox
from ..store.base import StoreUnavailableError
from . import doctor as diagnosis  # the package; `doctor` below is its command
from .doctor.base import DEFAULT_STALE_AFTER, Options
from .output import echo_document, json_option
from .progress import Progress, batch_size_option, interval_option
from .prompts import confirm, yes_option
from .records import show, unlock
from .relay import relay
from .stop import exit_interrupted, stop_on_signals
from .target import command_state

GROUP_EPILOG = """\b
Example:
  flask --app example_app idempotency stats --json

\b
Exit status:
  0    done
  1    failed: store unreachable, no such record, "no" at a prompt
  2    usage: a bad option, or --yes missing where a script must give it
  130  stopped between batches by Ctrl-C (143: by SIGTERM)
"""


group = AppGroup(
    "idempotency",
    help="Maintain the idempotency records: migrate, purge, inspect, unlock, recover, "
    "relay events.",
    epilog=GROUP_EPILOG,
)
group.add_command(relay)
group.add_command(show)
group.add_command(unlock)


@group.command(
    epilog="""\b
Example:
  flask --app example_app idempotency migrate
"""
)
def migrate() -> None:
    """Create or upgrade the tables (safe to run from several processes at once).

    Every missing migration is applied in one transaction under an advisory
    lock: an interrupted run applies none of them, and the next run starts over.
    """
    state = command_state()
    try:
        applied = state.store.migrate(state.settings.migration_dirs)
    except FileNotFoundError as exc:
        raise click.ClickException(str(exc)) from exc
    for name in applied:
        click.echo(f"applied {name}")
    click.echo(f"{len(applied)} migration(s) applied; schema is up to date")


@group.command(
    epilog="""\b
Examples:
  flask --app example_app idempotency purge --dry-run   # count only
  flask --app example_app idempotency purge             # says what it will delete, asks
  flask --app example_app idempotency purge --yes --batch-size 5000
  # crontab: no question off a terminal; a progress line every 60 s
  0 3 * * * flask --app example_app idempotency purge --progress-interval 60
"""
)
@click.option("--dry-run", is_flag=True, help="Only count the expired records and events.")
@batch_size_option(1000, "Rows deleted per transaction.")
@yes_option
@interval_option
def purge(dry_run: bool, batch_size: int, yes: bool, progress_interval: float) -> None:
    """Delete records past their TTL, and published events past theirs, in batches.

    Each batch is its own short transaction (no long lock; purges running side
    by side skip each other's rows) and its keys leave the Redis cache too. On a
    terminal it first says how many rows it will delete and asks (--yes to
    skip); off a terminal (cron) it goes ahead. Progress goes to standard error,
    the totals to standard output. Ctrl-C stops between batches (exit 130).
    """
    state = command_state()
    records = state.store.count_expired()
    events = int(outbox.counts(state.store)["expired"])
    if dry_run:  # both counts, even 0: what the purge would delete, rows of each table
        click.echo(f"{records} expired record(s) would be deleted")
        click.echo(f"{events} published event(s) would be deleted")
        return
    if records or events:
        confirm(
            f"{records} expired record(s) and {events} published event(s) will be deleted, "
            f"{batch_size} per transaction.",
            "Delete them?",
            yes=yes,
        )
    deleted_records = deleted_events = 0
    with stop_on_signals() as stop:
        try:
            if records:
                with Progress(
                    "deleting expired records", total=records, interval=progress_interval
                ) as progress:
                    for batch in state.store.purge(batch_size):
                        state.cache.evict(batch)
                        deleted_records += len(batch)
                        progress.advance(len(batch))
                        if stop.is_set():
                            break
            if events and not stop.is_set():
                with Progress(
                    "deleting published events", total=events, interval=progress_interval
                ) as progress:
                    for count in outbox.purge_batches(state.store, batch_size):
                        deleted_events += count
                        progress.advance(count)
                        if stop.is_set():
                            break
        except StoreUnavailableError as exc:
            raise click.ClickException(
                f"{exc} (after deleting {deleted_records} record(s) and {deleted_events} event(s))"
            ) from exc
    click.echo(f"{deleted_records} expired record(s) deleted")
    if deleted_events:
        click.echo(f"{deleted_events} published event(s) deleted")
    if stop.is_set():
        exit_interrupted(stop, f"{deleted_records} record(s) and {deleted_events} event(s)")


@group.command(
    epilog="""\b
Examples:
  flask --app example_app idempotency stats
  flask --app example_app idempotency stats --json | jq .lease_expired
"""
)
@json_option
def stats(as_json: bool) -> None:
    """Table-wide figures: records by state, expired rows awaiting purge, stuck leases,
    abandoned records and what recover made of them."""
    state = command_state()
    figures = state.store.stats()
    # Abandoned records now and the completer's totals.
    figures.update(state.postgres_store("table statistics").recovery_stats())
    # Counts are whole numbers; only durations keep a fraction.
    document = {
        name: round(value, 3) if name.endswith("_seconds") else int(value)
        for name, value in figures.items()
    }
    echo_document(document, as_json=as_json)


@group.command(
    epilog="""\b
Examples:
  flask --app example_app idempotency recover --once               # cron
  flask --app example_app idempotency recover --older-than 300     # a service
"""
)
@click.option(
    "--older-than",
    default=completer.DEFAULT_OLDER_THAN,
    show_default=True,
    type=click.FloatRange(min=0),
    help="Only records whose lease ended at least this many seconds ago (a client's "
    "own retry gets that long to come first).",
)
@click.option("--once", is_flag=True, help="One pass, then exit (cron, tests).")
@batch_size_option(completer.DEFAULT_BATCH_SIZE, "Records taken over per statement.")
@click.option(
    "--interval",
    default=completer.DEFAULT_INTERVAL,
    show_default=True,
    type=click.FloatRange(min=0.1),
    help="Seconds between passes when looping.",
)
@interval_option
def recover(
    older_than: float, once: bool, batch_size: int, interval: float, progress_interval: float
) -> None:
    """Finish abandoned attempts (holder dead, lease ended) of routes that declare
    recover=: store the answer their recovery gives, or release them.

    Runs until SIGTERM or Ctrl-C (finishing the record in hand, exit 0), or one
    pass with --once, showing its progress; Ctrl-C stops a --once pass after the
    record in hand (exit 130). Several may run at once. Needs
    IDEMPOTENCY_CLAIM_MODE = "row".
    """
    command_state()
    app = current_app._get_current_object()  # type: ignore[attr-defined]
    try:
        recoverer = completer.Recoverer(app, older_than=older_than, batch_size=batch_size)
    except RuntimeError as exc:
        raise click.ClickException(str(exc)) from None
    if not recoverer.routes:
        click.echo("no route of this app declares recover=", err=True)
    with stop_on_signals() as stop:
        try:
            if once:
                with Progress("recovering abandoned records", interval=progress_interval) as bar:
                    totals = recoverer.run(stop, once=True, on_outcome=lambda _: bar.advance(1))
            else:
                totals = recoverer.run(stop, interval=interval)
        except StoreUnavailableError as exc:
            raise click.ClickException(
                f"{exc} (before it: {completer.describe(recoverer.totals)})"
            ) from exc
    click.echo(completer.describe(totals))
    if once and stop.is_set():
        exit_interrupted(stop, completer.describe(totals))


@group.command(
    epilog="""\b
Examples:
  flask --app example_app idempotency doctor
  flask --app wsgi idempotency doctor --gunicorn-config gunicorn.conf.py --processor-timeout 10
  flask --app example_app idempotency doctor --json | jq '.checks[] | select(.status != "ok")'
"""
)
@click.option(
    "--gunicorn-config",
    type=click.Path(exists=True, dir_okay=False),
    help="gunicorn's configuration file, to check the pool against its threads (default: "
    "the one GUNICORN_CMD_ARGS names, else ./gunicorn.conf.py if there is one).",
)
@click.option(
    "--processor-timeout",
    type=click.FloatRange(min=0, min_open=True),
    metavar="SECONDS",
    help="The longest a view waits on its downstream (say, the card processor's client "
    "timeout): checked against the leases and TTLs.",
)
@click.option(
    "--stale-after",
    type=click.FloatRange(min=0, min_open=True),
    default=DEFAULT_STALE_AFTER,
    show_default=True,
    metavar="SECONDS",
    help="Warn when the relay or the completer (where needed) has not run for this long.",
)
@json_option
def doctor(
    gunicorn_config: str | None,
    processor_timeout: float | None,
    stale_after: float,
    as_json: bool,
) -> None:
    """Check the deployment before it goes live: one line per check, OK, WARN or
    FAIL with what to run or set.

    PostgreSQL (answers, schema current, PgBouncer and prepared statements,
    session timeouts against the lease, autovacuum of the records table, clock
    skew), the pool against gunicorn's threads, leases (renewal < lease < TTL,
    per route), scopes of requests without credentials, Redis (answers,
    eviction policy, memory), the broker, Prometheus' multiprocess directory,
    and when the relay and the completer last ran. Exits 1 if a check fails.
    """
    app = current_app._get_current_object()  # type: ignore[attr-defined]
    checks = diagnosis.diagnose(
        command_state(), app, Options(gunicorn_config, processor_timeout, stale_after)
    )
    result = diagnosis.document(checks)
    click.echo(json.dumps(result, indent=2) if as_json else "\n".join(diagnosis.lines(checks)))
    if not result["ok"]:
        raise click.exceptions.Exit(1)
