"""``flask idempotency ...``: thin commands over the store's maintenance methods."""

from __future__ import annotations

import json
import signal
import threading

import click
from flask import current_app, request
from flask.cli import AppGroup

from . import completer, keys
from .events import outbox
from .events.commands import relay
from .keys import parse_key, record_key
from .state import AppState, app_state
from .store.base import StoreUnavailableError

group = AppGroup("idempotency", help="Maintain the idempotency records.")
group.add_command(relay)


def _state() -> AppState:
    try:
        return app_state()
    except RuntimeError as exc:
        raise click.ClickException(str(exc)) from None


def _record_key(
    key: str, scope: str | None, authorization: str | None, headers: tuple[str, ...]
) -> bytes:
    from .errors import InvalidKey

    try:
        parsed = parse_key(key)
    except InvalidKey:
        raise click.BadParameter("not a valid Idempotency-Key", param_hint="KEY") from None
    assert parsed is not None
    if scope is not None and (authorization is not None or headers):
        raise click.UsageError("give --scope, or --authorization/--header, not both")
    if scope is None:
        scope = _scope_from_headers(authorization, headers)
    return record_key(scope, parsed)


def _parse_header(raw: str) -> tuple[str, str]:
    name, sep, value = raw.partition(":")
    name = name.strip()
    if not sep or not name or any(ch.isspace() for ch in name):
        raise click.BadParameter(f"expected 'Name: value', got {raw!r}", param_hint="--header")
    return name, value.strip(" \t")


def _scope_from_headers(authorization: str | None, headers: tuple[str, ...]) -> str:
    """The scope the app's ``IDEMPOTENCY_SCOPE_FUNC`` gives a request with these headers.

    The request context is built from the headers alone: no route, no body and
    no ``before_request`` hooks. A scope that cannot be computed from headers
    (a route's own ``scope_func``, a user known only to the view) is given
    with ``--scope``.
    """
    from .errors import ScopeUnavailable

    sent = [_parse_header(raw) for raw in headers]
    if authorization is not None:
        if any(name.lower() == "authorization" for name, _ in sent):
            raise click.UsageError("give --authorization or --header 'Authorization: ...'")
        sent.append(("Authorization", authorization))
    state = _state()
    scope_func = state.settings.scope_func
    name = getattr(scope_func, "__qualname__", repr(scope_func))
    app = current_app._get_current_object()  # type: ignore[attr-defined]
    with app.test_request_context(headers=sent):
        try:
            return keys.resolve_scope(scope_func, request)
        except ScopeUnavailable:
            raise click.ClickException(
                f"the app's scope function ({name}) finds no principal in these headers: "
                "give the client's credentials with --authorization or --header, "
                "or the scope itself with --scope"
            ) from None
        except Exception as exc:
            raise click.ClickException(
                f"the app's scope function ({name}) failed for these headers "
                f"({type(exc).__name__}); give the scope itself with --scope"
            ) from exc


scope_option = click.option(
    "--scope",
    default=None,
    help="The scope exactly as the scope function returns it (e.g. user:42), for scopes "
    "that cannot be computed from headers.",
)
authorization_option = click.option(
    "--authorization",
    default=None,
    help="The client's Authorization header value; the scope is computed by the app's "
    "IDEMPOTENCY_SCOPE_FUNC.",
)
header_option = click.option(
    "--header",
    "headers",
    multiple=True,
    metavar="'NAME: VALUE'",
    help="A request header the app's scope function reads (repeatable).",
)


@group.command()
def migrate() -> None:
    """Create or upgrade the tables (safe to run from several processes at once)."""
    state = _state()
    try:
        applied = state.store.migrate(state.settings.migration_dirs)
    except (StoreUnavailableError, FileNotFoundError) as exc:
        raise click.ClickException(str(exc)) from exc
    for name in applied:
        click.echo(f"applied {name}")
    click.echo(f"{len(applied)} migration(s) applied; schema is up to date")


@group.command()
@click.option("--dry-run", is_flag=True, help="Only count the expired records.")
@click.option("--batch-size", default=1000, show_default=True, type=click.IntRange(min=1))
def purge(dry_run: bool, batch_size: int) -> None:
    """Delete records older than their TTL, in batches (no long lock)."""
    state = _state()
    try:
        if dry_run:
            click.echo(f"{state.store.count_expired()} expired record(s) would be deleted")
            expired_events = outbox.count_expired(state.store)
            if expired_events:
                click.echo(f"{expired_events} published event(s) would be deleted")
            return
        deleted = 0
        for keys in state.store.purge(batch_size):
            state.cache.evict(keys)
            deleted += len(keys)
        events = outbox.purge(state.store, batch_size)
    except StoreUnavailableError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"{deleted} expired record(s) deleted")
    if events:
        click.echo(f"{events} published event(s) deleted")


@group.command()
@click.argument("key")
@scope_option
@authorization_option
@header_option
@click.option("--body", "show_body", is_flag=True, help="Also print the stored body.")
def show(
    key: str,
    scope: str | None,
    authorization: str | None,
    headers: tuple[str, ...],
    show_body: bool,
) -> None:
    """Show one record: state, ages, status code."""
    state = _state()
    rkey = _record_key(key, scope, authorization, headers)
    try:
        info = state.store.info(rkey)
    except StoreUnavailableError as exc:
        raise click.ClickException(str(exc)) from exc
    if info is None:
        raise click.ClickException("no record for that key and scope")
    lines = {
        "state": info.state + (" (expired)" if info.expired else ""),
        "age_seconds": round(info.age_seconds, 3),
        "created_at": info.created_at.isoformat(),
        "expires_at": info.expires_at.isoformat(),
        "completed_at": info.completed_at.isoformat() if info.completed_at else None,
        "lease_expires_at": info.lease_expires_at.isoformat() if info.lease_expires_at else None,
        "status": info.status,
    }
    for name, value in lines.items():
        click.echo(f"{name}: {value}")
    if show_body:
        click.echo("headers: " + json.dumps([list(h) for h in info.headers]))
        body = info.body or b""
        click.echo("body: " + body.decode("utf-8", "replace"))


@group.command()
def stats() -> None:
    """Table-wide figures: records by state, expired rows awaiting purge, stuck leases,
    abandoned records and what ``recover`` made of them."""
    state = _state()
    try:
        figures = state.store.stats()
        figures.update(completer.stats(state.store))
    except StoreUnavailableError as exc:
        raise click.ClickException(str(exc)) from exc
    for name, value in figures.items():
        click.echo(f"{name}: {value:g}")


@group.command()
@click.option(
    "--older-than",
    default=completer.DEFAULT_OLDER_THAN,
    show_default=True,
    type=click.FloatRange(min=0),
    help="Only records whose lease ended at least this many seconds ago (a client's "
    "own retry gets that long to come first).",
)
@click.option("--once", is_flag=True, help="One pass, then exit (cron, tests).")
@click.option(
    "--batch-size",
    default=completer.DEFAULT_BATCH_SIZE,
    show_default=True,
    type=click.IntRange(min=1),
    help="Records taken over per statement.",
)
@click.option(
    "--interval",
    default=completer.DEFAULT_INTERVAL,
    show_default=True,
    type=click.FloatRange(min=0.1),
    help="Seconds between passes when looping.",
)
def recover(older_than: float, once: bool, batch_size: int, interval: float) -> None:
    """Finish abandoned attempts (holder dead, lease ended) of routes that declare
    recover=: store the answer their recovery gives, or release them.

    Runs until SIGTERM or Ctrl-C (finishing the record in hand), or one pass with
    --once; several may run at once. Needs IDEMPOTENCY_CLAIM_MODE = "row".
    """
    _state()
    app = current_app._get_current_object()  # type: ignore[attr-defined]
    try:
        recoverer = completer.Recoverer(app, older_than=older_than, batch_size=batch_size)
    except RuntimeError as exc:
        raise click.ClickException(str(exc)) from None
    if not recoverer.routes:
        click.echo("no route of this app declares recover=", err=True)
    stop = threading.Event()
    if not once and threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: stop.set())
    try:
        totals = recoverer.run(stop, once=once, interval=interval)
    except StoreUnavailableError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(completer.describe(totals))


@group.command()
@click.argument("key")
@scope_option
@authorization_option
@header_option
def unlock(
    key: str, scope: str | None, authorization: str | None, headers: tuple[str, ...]
) -> None:
    """Release a stuck processing record so the next request with the key runs."""
    state = _state()
    rkey = _record_key(key, scope, authorization, headers)
    try:
        released = state.store.unlock(rkey)
    except StoreUnavailableError as exc:
        raise click.ClickException(str(exc)) from exc
    if not released:
        raise click.ClickException("no processing record for that key and scope")
    state.cache.evict([rkey])
    click.echo("released")
