"""The app state a command works on, and the one case with nothing to work on.

Under ``IDEMPOTENCY_DATABASE_URL = "memory://"`` the records live in the memory
of the process that serves requests; a command runs in a process of its own,
which could only see an empty store of its own. Every command says so and
exits 0, so a scheduled ``purge`` does not fail on a development set-up.
"""

from __future__ import annotations

import click

from ..state import AppState, app_state
from ..store.memory import is_memory_url


def command_state() -> AppState:
    """The current app's extension state; a ``ClickException`` without one."""
    try:
        state = app_state()
    except RuntimeError as exc:
        raise click.ClickException(str(exc)) from None
    if is_memory_url(state.settings.database_url):
        command = click.get_current_context().info_name
        click.echo(
            "IDEMPOTENCY_DATABASE_URL is memory://: the records live in the serving "
            f"process's memory and go with it; `flask idempotency {command}` has nothing "
            "to maintain"
        )
        raise click.exceptions.Exit(0)
    return state
