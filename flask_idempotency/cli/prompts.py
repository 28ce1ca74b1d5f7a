"""Asking before a destructive command acts: on a terminal only, ``--yes`` to skip.

The question is asked only when standard input is a terminal: a person is
there to answer. Elsewhere the command decides by what it is about to do:

* routine work that cron runs (``purge``: the rows are already past their TTL
  and no longer replayed) goes ahead, so ``flask idempotency purge`` in a
  crontab keeps working without ``--yes``;
* work that can double a payment (``unlock`` of a record whose holder is still
  renewing its lease) is refused as a usage error (exit 2) unless ``--yes`` is
  given: a script must say so explicitly.
"""

from __future__ import annotations

import sys

import click

yes_option = click.option(
    "--yes", "-y", "yes", is_flag=True, help="Do not ask for confirmation on a terminal."
)


def interactive() -> bool:
    """Is someone at a terminal to answer?"""
    return sys.stdin is not None and sys.stdin.isatty()


def confirm(plan: str, question: str, *, yes: bool, required_off_terminal: bool = False) -> None:
    """Return to go ahead; else raise.

    On a terminal without ``yes``: print ``plan`` (what the command is about to
    do) to standard error and ask ``question``; "no" raises :class:`click.Abort`
    (exit 1). Off a terminal without ``yes``: go ahead, unless
    ``required_off_terminal``, which raises :class:`click.UsageError` (exit 2)
    carrying ``plan``.
    """
    if yes:
        return
    if interactive():
        click.echo(plan, err=True)
        click.confirm(question, default=False, abort=True, err=True)
        return
    if required_off_terminal:
        raise click.UsageError(f"{plan}\nNot on a terminal to ask: give --yes to go ahead.")
