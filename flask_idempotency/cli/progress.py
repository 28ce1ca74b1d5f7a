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

import itertools
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from types import TracebackType
from typing import Any, TextIO, TypeVar

import click

#: Seconds between summary lines when standard error is not a terminal: a line
#: every 10 s gives a log a heartbeat without flooding it (a purge of 10^7 rows
#: logs a few dozen lines).
DEFAULT_INTERVAL = 10.0

F = TypeVar("F", bound=Callable[..., Any])


def interval_option(func: F) -> F:
    """``--progress-interval``, shared by the long commands."""
    return click.option(
        "--progress-interval",
        default=DEFAULT_INTERVAL,
        show_default=True,
        type=click.FloatRange(min=0),
        metavar="SECONDS",
        help="When standard error is not a terminal (cron, a log), print a progress line "
        "this often; 0: after every batch.",
    )(func)


def _elapsed(seconds: float) -> str:
    return str(timedelta(seconds=int(seconds)))


class Progress:
    """Counts work done (``advance``) and shows it; a context manager.

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
        self.label = label
        self.total = total
        self.interval = interval
        self.stream: TextIO = stream or sys.stderr
        self.clock = clock
        self.done = 0
        self.started = clock()
        self._last_line = self.started
        self.tty = self.stream.isatty()
        self._bar: Any = None
        if self.tty:
            self._bar = click.progressbar(
                # An endless iterable without a length: click's bar for an unknown total.
                iterable=None if total is not None else itertools.count(),
                length=total,
                label=label,
                file=self.stream,
                show_pos=True,
                show_percent=total is not None,
                show_eta=total is not None,
                item_show_func=lambda _: self._rate_and_elapsed(),
            )

    @property
    def elapsed(self) -> float:
        return self.clock() - self.started

    @property
    def rate(self) -> float:
        elapsed = self.elapsed
        return self.done / elapsed if elapsed > 0 else 0.0

    def _rate_and_elapsed(self) -> str:
        return f"{self.rate:.0f}/s  {_elapsed(self.elapsed)} elapsed"

    def line(self) -> str:
        """``label: done/total (pct), rate/s, h:mm:ss elapsed``."""
        position = f"{self.done}"
        if self.total is not None:
            position += f"/{max(self.total, self.done)}"
            if self.total:
                position += f" ({min(100, 100 * self.done // self.total)}%)"
        return f"{self.label}: {position}, {self.rate:.0f}/s, {_elapsed(self.elapsed)} elapsed"

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

    def __enter__(self) -> Progress:
        if self._bar is not None:
            self._bar.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._bar is not None:
            self._bar.__exit__(exc_type, exc, tb)
