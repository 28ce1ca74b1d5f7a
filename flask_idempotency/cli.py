"""``flask idempotency ...``: thin commands over the store's maintenance methods."""

from __future__ import annotations

import json
from typing import Any

import click
from flask import current_app
from flask.cli import AppGroup

from .keys import parse_key, record_key
from .store.base import StoreUnavailableError

group = AppGroup("idempotency", help="Maintain the idempotency records.")


def _state() -> Any:
    try:
        return current_app.extensions["idempotency"]
    except KeyError:
        raise click.ClickException("flask_idempotency is not initialised on this app") from None


def _record_key(key: str, scope: str | None, authorization: str | None) -> bytes:
    from .errors import InvalidKey
    from .keys import default_scope_from_header

    try:
        parsed = parse_key(key)
    except InvalidKey:
        raise click.BadParameter("not a valid Idempotency-Key", param_hint="KEY") from None
    assert parsed is not None
    if scope is not None and authorization is not None:
        raise click.UsageError("give --scope or --authorization, not both")
    if authorization is not None:
        scope = default_scope_from_header(authorization)
    return record_key(scope or "", parsed)


scope_option = click.option(
    "--scope", default=None, help="The scope exactly as the app's scope function returns it."
)
authorization_option = click.option(
    "--authorization",
    default=None,
    help="The client's Authorization header value (for the default scope function).",
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
            return
        deleted = 0
        for keys in state.store.purge(batch_size):
            state.cache.evict(keys)
            deleted += len(keys)
    except StoreUnavailableError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"{deleted} expired record(s) deleted")


@group.command()
@click.argument("key")
@scope_option
@authorization_option
@click.option("--body", "show_body", is_flag=True, help="Also print the stored body.")
def show(key: str, scope: str | None, authorization: str | None, show_body: bool) -> None:
    """Show one record: state, ages, status code."""
    state = _state()
    try:
        info = state.store.info(_record_key(key, scope, authorization))
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
    """Table-wide figures: records by state, expired rows awaiting purge, stuck leases."""
    state = _state()
    try:
        figures = state.store.stats()
    except StoreUnavailableError as exc:
        raise click.ClickException(str(exc)) from exc
    for name, value in figures.items():
        click.echo(f"{name}: {value:g}")


@group.command()
@click.argument("key")
@scope_option
@authorization_option
def unlock(key: str, scope: str | None, authorization: str | None) -> None:
    """Release a stuck processing record so the next request with the key runs."""
    state = _state()
    rkey = _record_key(key, scope, authorization)
    try:
        released = state.store.unlock(rkey)
    except StoreUnavailableError as exc:
        raise click.ClickException(str(exc)) from exc
    if not released:
        raise click.ClickException("no processing record for that key and scope")
    state.cache.evict([rkey])
    click.echo("released")
