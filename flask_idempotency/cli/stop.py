"""Stopping a long CLI command between batches on Ctrl-C or SIGTERM.

Each batch of ``purge``, ``recover`` and ``relay`` is its own transaction, so a
command killed mid-batch loses nothing; but it also cannot say what it did.
Inside :func:`stop_on_signals` the first SIGINT or SIGTERM only sets an event
that the command's loop checks between batches: the batch in hand finishes,
the command prints its totals and ends with ``128 + signal`` (130 for Ctrl-C,
143 for SIGTERM), the status a shell gives a command killed by that signal,
so a script can tell an interrupted run from a finished (0) or failed (1) one.

A second Ctrl-C raises :class:`KeyboardInterrupt` at once: an operator whose
statement hangs (a lock, a dead server) is never stuck with a command that
waits politely.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import click

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stop(threading.Event):
    """Set by the first SIGINT or SIGTERM; ``signum`` says which."""

    signum: int | None = None

    @property
    def exit_code(self) -> int:
        return 128 + (self.signum or signal.SIGINT)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum or signal.SIGINT).name


@contextmanager
def stop_on_signals() -> Iterator[Stop]:
    """Install the handlers for the duration of the block (main thread only:
    elsewhere the event is only set by whoever holds it), then restore them."""
    stop = Stop()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def handle(signum: int, frame: FrameType | None) -> None:
        if stop.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt
        stop.signum = signum
        stop.set()

    previous: dict[int, Any] = {s: signal.signal(s, handle) for s in SIGNALS}
    try:
        yield stop
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def exit_interrupted(stop: Stop, what: str) -> None:
    """Say what was done before the stop (``what``), then end with 128 + signal."""
    click.echo(
        f"interrupted by {stop.name}: stopped between batches after {what}; "
        "run the command again to go on",
        err=True,
    )
    click.get_current_context().exit(stop.exit_code)
