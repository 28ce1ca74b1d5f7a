"""``flask idempotency relay``: a thin command over :class:`~.relay.Relay`."""

from __future__ import annotations

import click
from flask.cli import with_appcontext

from ..events import outbox
from ..events.relay import DEFAULT_BATCH_SIZE, DEFAULT_POLL_INTERVAL, BrokerUnavailable, Relay
from ..store.base import StoreUnavailableError
from .progress import Progress, batch_size_option, interval_option
from .stop import exit_interrupted, stop_on_signals
from .target import command_state


@click.command(
    epilog="""\b
Examples:
  flask --app example_app idempotency relay                  # a service
  flask --app example_app idempotency relay --once           # drain the backlog, exit
  flask --app example_app idempotency relay --once --broker-url amqp://guest:guest@mq:5672/
"""
)
@with_appcontext
@click.option("--once", is_flag=True, help="Publish what is pending, then exit (cron, tests).")
@click.option("--broker-url", help="Broker URL; default: the app's IDEMPOTENCY_BROKER_URL.")
@click.option(
    "--exchange", help='Exchange; default: the app\'s IDEMPOTENCY_BROKER_OPTIONS["exchange"].'
)
@batch_size_option(DEFAULT_BATCH_SIZE, "Events per transaction.")
@click.option(
    "--poll-interval",
    default=DEFAULT_POLL_INTERVAL,
    show_default=True,
    type=click.FloatRange(min=0.01),
    help="Seconds between looks at an empty outbox.",
)
@interval_option
def relay(
    once: bool,
    broker_url: str | None,
    exchange: str | None,
    batch_size: int,
    poll_interval: float,
    progress_interval: float,
) -> None:
    """Publish pending events to the broker, with confirms, and mark them published.

    Runs until SIGTERM or Ctrl-C (finishing its batch, exit 0), waiting out
    broker and database outages with backoff; several may run at once. With
    --once it publishes what is pending, showing its progress, and exits: 1 if
    the broker or database is unreachable, 130 if Ctrl-C stopped it between
    batches.
    """
    from ..events.amqp import Publisher, redact  # kombu, only when the command runs

    state = command_state()
    url = broker_url or state.settings.broker_url
    if not url:
        raise click.ClickException("no broker: set IDEMPOTENCY_BROKER_URL or give --broker-url")
    if url.startswith("memory:"):
        raise click.ClickException(
            "memory:// lives in one process: nothing else could consume it "
            "(without a broker, run flask_idempotency.events.EmbeddedEvents instead)"
        )
    exchange = exchange or state.settings.events_exchange
    worker = Relay(
        state.store,
        Publisher(url, exchange),
        batch_size=batch_size,
        poll_interval=poll_interval,
    )
    click.echo(f"relaying events to {redact(url)} exchange {exchange!r}", err=True)
    with stop_on_signals() as stop:
        try:
            if once:
                total = int(outbox.counts(state.store)["due"])
                with Progress(
                    "publishing events", total=total, interval=progress_interval
                ) as progress:
                    stats = worker.run(stop, once=True, on_batch=progress.advance)
            else:
                stats = worker.run(stop)
        except (BrokerUnavailable, StoreUnavailableError) as exc:
            raise click.ClickException(
                f"{exc} ({worker.stats.published} event(s) published before it)"
            ) from exc
    click.echo(f"{stats.published} event(s) published, {stats.deferred} deferred")
    if once and stop.is_set():
        exit_interrupted(stop, f"{stats.published} event(s) published")
