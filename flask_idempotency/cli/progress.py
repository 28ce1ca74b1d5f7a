"""Progress of a long CLI command: a bar on a terminal, a line now and then in a log.

An operator watching ``flask idempotency purge`` on ten million rows needs to
tell a slow run from a stuck one; cron and systemd capture a log, where a bar's
carriage returns are noise. So one reporter, two renderings, chosen by whether
its stream (standard error: standard output keeps the command's result) is a
terminal:

* a terminal gets :func:`click.progressbar`: done/total (when the total is
  known), percent, ETA, rate and elapsed time;
* anything else gets one line every ``interval`` seconds
  (``deleting expired records: 3000/10000 (30%), 4512/s, 0:00:02 elapsed``),
  and none at all for a run shorter than that, so a quick cron job logs only
  its totals.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TextIO, TypeVar

import click

#: Seconds between summary lines when standard error is not a terminal: a line
#: every 10 s gives a log a heartbeat without flooding it (a purge of 10^7 rows
#: logs a few dozen lines).
DEFAULT_INTERVAL = 10.0

#: What click.option decorates (a command function), as click types it.
FC = TypeVar("FC", bound=Callable[..., Any])

#: ``--progress-interval``, shared by the long commands.
interval_option = click.option(
    "--progress-interval",
    default=DEFAULT_INTERVAL,
    show_default=True,
    type=click.FloatRange(min=0),
    metavar="SECONDS",
    help="When standard error is not a terminal (cron, a log), print a progress line "
    "this often; 0: after every batch.",
)


def batch_size_option(default: int, what: str) -> Callable[[FC], FC]:
    """``--batch-size``, shared by the long commands; ``what``: what one batch is (its help)."""
    return click.option(
        "--batch-size", default=default, show_default=True, type=click.IntRange(min=1), help=what
    )


class Progress(contextlib.ExitStack):
    """Counts work done (``advance``) and shows it; a context manager (an
    :class:`~contextlib.ExitStack` that closes the bar it opened).

    ``total`` is a count taken before the work starts: rows that expire (or
    events that arrive) meanwhile can carry ``done`` past it, and the bar then
    grows to ``done`` rather than overflow.
    """

    def __init__(
        self,
        label: str,
        *,
        total: int | None = None,
        interval: float = DEFAULT_INTERVAL,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self.label = label
        self.total = total
        self.interval = interval
        self.stream: TextIO = stream or sys.stderr
        self.clock = clock
        self.done = 0
        self.started = clock()
        self._last_line = self.started
        self._bar: Any = None
        if self.stream.isatty():
            bar = click.progressbar(
                # An endless iterable without a length: click's bar for an unknown total.
                iterable=None if total is not None else itertools.count(),
                length=total,
                label=label,
                file=self.stream,
                show_pos=True,
                show_percent=total is not None,
                show_eta=total is not None,
                item_show_func=lambda _: "{:.0f}/s  {} elapsed".format(*self._rate()),
            )
            self._bar = self.enter_context(bar)

    def _rate(self) -> tuple[float, str]:
        """Done per second so far, and the time elapsed as ``h:mm:ss``."""
        elapsed = self.clock() - self.started
        rate = self.done / elapsed if elapsed > 0 else 0.0
        return rate, str(timedelta(seconds=int(elapsed)))

    def line(self) -> str:
        """``label: done/total (pct), rate/s, h:mm:ss elapsed``."""
        position = f"{self.done}"
        if self.total is not None:
            position += f"/{max(self.total, self.done)}"
            if self.total:
                position += f" ({min(100, 100 * self.done // self.total)}%)"
        rate, elapsed = self._rate()
        return f"{self.label}: {position}, {rate:.0f}/s, {elapsed} elapsed"

    def advance(self, count: int) -> None:
        self.done += count
        if self._bar is not None:
            if self._bar.length is not None and self.done > self._bar.length:
                self._bar.length = self.done
            self._bar.update(count)
            return
        now = self.clock()
        if now - self._last_line >= self.interval:
            self._last_line = now
            click.echo(self.line(), file=self.stream)
