"""``show`` and ``unlock``: the commands about one record, found by its client's key.

They change for one reason of their own: how an operator names a record (the
client's key, and the scope computed from the client's credentials or given
as is), kept apart from the table-wide maintenance in ``__init__.py``.

A client's credentials are never taken from the command line, where ``ps`` and
the shell's history show them to anyone on the machine: ``--authorization``
reads the value from :data:`AUTHORIZATION_ENV`, else from standard input (a
hidden prompt on a terminal), and so does a ``--header`` given by name alone.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import click
from flask import current_app, request
from flask.cli import with_appcontext

from .. import digests, keys
from ..errors import InvalidKey, ScopeUnavailable
from ..settings import ScopeFunc
from ..state import AppState
from ..store.base import RecordInfo
from .output import echo_document, json_option
from .prompts import confirm, yes_option
from .target import command_state

#: Where ``--authorization`` reads the client's ``Authorization`` value first.
AUTHORIZATION_ENV = "IDEMPOTENCY_CLIENT_AUTHORIZATION"


def _secret(header: str) -> str:
    """The value of ``header``, a client's secret: ``Authorization``'s from
    :data:`AUTHORIZATION_ENV` (when set), else standard input: a hidden prompt on a
    terminal, else its first line (``... | flask idempotency show``)."""
    what = f"{header} value"
    env = AUTHORIZATION_ENV if header.lower() == "authorization" else None
    if env is not None and os.environ.get(env):
        return os.environ[env]
    if sys.stdin.isatty():
        value: str = click.prompt(what, hide_input=True, err=True)
    else:
        value = sys.stdin.readline().rstrip("\r\n")
    if not value:
        where = f"${env} or standard input" if env else "standard input"
        raise click.UsageError(f"no {what} on {where}")
    return value


def _parse_header(raw: str) -> tuple[str, str | None]:
    """``Name: value``, or ``Name`` alone: its value (a secret) is read from stdin."""
    name, sep, value = raw.partition(":")
    name = name.strip()
    if not name or any(ch.isspace() for ch in name):
        raise click.BadParameter(
            f"expected 'Name: value' or a name alone, got {raw!r}", param_hint="--header"
        )
    return name, value.strip(" \t") if sep else None


def _scope_from_headers(
    scope_func: ScopeFunc, read_authorization: bool, headers: tuple[str, ...]
) -> str:
    """The scope ``scope_func`` (the app's ``IDEMPOTENCY_SCOPE_FUNC``) gives a request
    with these headers.

    The request context is built from the headers alone: no route, no body and
    no ``before_request`` hooks. A scope that cannot be computed from headers
    (a route's own ``scope_func``, a user known only to the view) is given
    with ``--scope``.
    """
    parsed = [_parse_header(raw) for raw in headers]
    if read_authorization:
        if any(name.lower() == "authorization" for name, _ in parsed):
            raise click.UsageError("give --authorization or --header Authorization, not both")
        parsed.append(("Authorization", None))
    if sum(value is None for _, value in parsed) > 1:
        raise click.UsageError("only one header value can be read from standard input")
    sent = [(name, value if value is not None else _secret(name)) for name, value in parsed]
    name = getattr(scope_func, "__qualname__", repr(scope_func))
    with current_app.test_request_context(headers=sent):
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


def _record_command(command: Callable[..., None]) -> Callable[..., None]:
    """KEY and the options naming its scope, for a command about one record: run in
    the app context, ``command`` gets the app's state and the record's key in their
    place (then its own options)."""

    @click.argument("key")
    @click.option(
        "--scope",
        help="The scope exactly as the scope function returns it (e.g. user:42), for scopes "
        "that cannot be computed from headers.",
    )
    @click.option(
        "--authorization",
        "read_authorization",
        is_flag=True,
        help=f"Compute the scope with the app's IDEMPOTENCY_SCOPE_FUNC from the client's "
        f"Authorization value, read from ${AUTHORIZATION_ENV}, else from standard input "
        "(never from the command line, where ps and shell history would show it).",
    )
    @click.option(
        "--header",
        "headers",
        multiple=True,
        metavar="'NAME: VALUE' | NAME",
        help="A request header the app's scope function reads (repeatable). A NAME alone "
        "reads its value from standard input: use that for any secret.",
    )
    @with_appcontext
    @functools.wraps(command)
    def named(
        key: str, scope: str | None, read_authorization: bool, headers: tuple[str, ...], **own: Any
    ) -> None:
        state = command_state()  # first: under memory:// that is all there is to say
        try:
            parsed = keys.parse_key(key)
        except InvalidKey:
            raise click.BadParameter("not a valid Idempotency-Key", param_hint="KEY") from None
        assert parsed is not None
        if scope is not None and (read_authorization or headers):
            raise click.UsageError("give --scope, or --authorization/--header, not both")
        if scope is None:
            scope = _scope_from_headers(state.settings.scope_func, read_authorization, headers)
        command(state, digests.record_key(scope, parsed), **own)

    return named


def _lease_live(info: RecordInfo) -> float | None:
    """Seconds left on an in-flight record's lease, or None if it has ended.

    The lease is compared with the server's clock, never this machine's:
    ``created_at + age_seconds`` is the server's ``now()`` when it was read.
    """
    if info.state != "processing" or info.lease_expires_at is None:
        return None
    server_now = info.created_at + timedelta(seconds=info.age_seconds)
    left = (info.lease_expires_at - server_now).total_seconds()
    return left if left > 0 else None


@click.command(
    epilog="""\b
Examples:
  export IDEMPOTENCY_CLIENT_AUTHORIZATION  # set without echo, e.g. read -rs
  flask --app example_app idempotency show order-1 --authorization
  flask --app example_app idempotency show order-1 --authorization < client-key.txt
  flask --app example_app idempotency show order-1 --scope user:42 --json | jq .state
"""
)
@_record_command
@click.option(
    "--body",
    "show_body",
    is_flag=True,
    help="Also print the stored headers and body. WARNING: that is the client's answer "
    "as stored (it may hold personal or payment data, tokens, card details): off unless "
    "asked for; mind where the output goes.",
)
@json_option
def show(state: AppState, rkey: bytes, show_body: bool, as_json: bool) -> None:
    """Show one record: state, lease, ages, status code.

    KEY is the client's Idempotency-Key; the record is found in the scope the
    app's scope function computes from --authorization / --header, or in
    --scope. Exit 1 when there is no record. --body prints the stored answer.
    """
    info = state.store.info(rkey)
    if info is None:
        raise click.ClickException("no record for that key and scope")
    fields: dict[str, Any] = {
        "record": digests.log_key(rkey),
        "state": info.state,
        "expired": info.expired,
        "lease_live": _lease_live(info) is not None,
        "age_seconds": round(info.age_seconds, 3),
        "created_at": info.created_at.isoformat(),
        "expires_at": info.expires_at.isoformat(),
        "completed_at": info.completed_at.isoformat() if info.completed_at else None,
        "lease_expires_at": info.lease_expires_at.isoformat() if info.lease_expires_at else None,
        "status": info.status,
    }
    if show_body:
        fields["headers"] = [list(h) for h in info.headers]
        fields["body"] = (info.body or b"").decode("utf-8", "replace")
    echo_document(fields, as_json=as_json)


@click.command(
    epilog="""\b
Examples:
  flask --app example_app idempotency unlock order-1 --authorization < client-key.txt
  flask --app example_app idempotency unlock order-1 --scope user:42 --yes
"""
)
@_record_command
@yes_option
def unlock(state: AppState, rkey: bytes, yes: bool) -> None:
    """Release a stuck processing record so the next request with the key runs.

    A record whose lease has ended (its holder died) is released at once. One
    whose lease is still being renewed is in flight: the command says so and
    asks on a terminal; off a terminal it needs --yes (else exit 2).
    """
    info = state.store.info(rkey)
    if info is None or info.state != "processing":
        raise click.ClickException("no processing record for that key and scope")
    lease_left = _lease_live(info)
    if lease_left is not None:
        confirm(
            f"record {digests.log_key(rkey)} is in flight: its holder still renews its "
            f"lease (started {info.age_seconds:.0f} s ago, lease ends in "
            f"{lease_left:.0f} s). Unlocking deletes it: the next request with this key "
            "runs again, and if the holder is still calling the processor the payment "
            "can be made twice.",
            "Unlock it?",
            yes=yes,
            required_off_terminal=True,
        )
    if not state.store.unlock(rkey):
        raise click.ClickException("no processing record for that key and scope")
    state.cache.evict([rkey])
    click.echo("released")
