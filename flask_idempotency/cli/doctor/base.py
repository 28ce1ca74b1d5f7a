"""What every check of ``flask idempotency doctor`` shares: its result, its inputs.

A check is a function of a :class:`Context` that returns its finding, made with
:data:`ok`, :data:`warn` or :data:`fail` (or ``None``: nothing to say). The
runner (``__init__.py``) names it after its row of the table of checks, times
it, and turns whatever one raises into a ``fail`` line of its own, so a check
that breaks never hides the others.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any, TypeVar, cast

from flask import Flask

from ...state import AppState
from ...store.postgres import PostgresStore

OK, WARN, FAIL = "ok", "warn", "fail"
#: Worst last: a check made of several findings reports the worst of them.
SEVERITY = {OK: 0, WARN: 1, FAIL: 2}
#: How long a background worker may stay silent before the doctor warns (seconds):
#: the relay loops every half second and the completer every 10 s, each reporting
#: at most every 30 s; a cron line running them every few minutes stays inside it.
DEFAULT_STALE_AFTER = 600.0

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    status: str
    detail: str
    #: What to do about it (a command or a setting), when there is something to do.
    fix: str | None = None
    #: How long the check took, milliseconds.
    ms: float = 0.0


@dataclasses.dataclass(frozen=True)
class Options:
    """What the operator tells the doctor beyond the app's configuration."""

    #: gunicorn's configuration file (``-c``); else the one ``GUNICORN_CMD_ARGS``
    #: names, else ``./gunicorn.conf.py`` as gunicorn itself does.
    gunicorn_config: str | None = None
    #: The longest a view waits on its downstream (the processor's client timeout).
    processor_timeout: float | None = None
    stale_after: float = DEFAULT_STALE_AFTER
    #: This machine's clock, compared with PostgreSQL's (tests shift it).
    clock: Callable[[], float] = time.time


@dataclasses.dataclass
class Context:
    """One diagnosis: the app, its extension state, the options, and what the
    checks read once and share (gunicorn's settings)."""

    app: Flask
    state: AppState
    options: Options
    _cache: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: What the checks opened for themselves (a Redis client), closed at the end.
    closers: list[Callable[[], None]] = dataclasses.field(default_factory=list)

    @property
    def store(self) -> PostgresStore:
        """The PostgreSQL store (the doctor never runs under ``memory://``:
        ``cli.target.command_state`` answers for it)."""
        return self.state.postgres_store("flask idempotency doctor")

    def once(self, name: str, compute: Callable[[], T]) -> T:
        """``compute()``'s value (or exception), computed once for every check."""
        if name not in self._cache:
            try:
                self._cache[name] = (True, compute())
            except Exception as exc:
                self._cache[name] = (False, exc)
        computed, value = self._cache[name]
        if not computed:
            raise value
        return cast(T, value)

    def close(self) -> None:
        for close in self.closers:
            # Closing what a failed check left must not fail the report.
            with contextlib.suppress(Exception):
                close()


#: A finding at each status: ``ok(detail)``, ``warn(detail, fix)``, ``fail(detail, fix)``;
#: the runner gives it the check's name.
ok = functools.partial(Check, "", OK)
warn = functools.partial(Check, "", WARN)
fail = functools.partial(Check, "", FAIL)


def worst(findings: list[Check], otherwise: Check) -> Check:
    """Several findings as one: the worst status, the details of the findings at
    that status joined, the first one's fix; ``otherwise`` when there are none."""
    if not findings:
        return otherwise
    status = max((f.status for f in findings), key=SEVERITY.__getitem__)
    shown = [f for f in findings if f.status == status]
    return Check("", status, "; ".join(f.detail for f in shown), shown[0].fix)


def seconds(value: float) -> str:
    """``30 s``, ``1.5 s``, ``86400 s``: durations as the settings spell them."""
    return f"{value:g} s"


def ping(
    server: str,
    call: Callable[[], object],
    *,
    reason: Callable[[Exception], str],
    fix: str,
    status: str = FAIL,
    errors: type[Exception] | tuple[type[Exception], ...] = Exception,
) -> Check:
    """The check that a server answers: ``call()`` (the ping, and whatever it must
    connect or build first), timed. ``ok`` with the round trip in milliseconds; an
    exception of ``errors`` is a ``status`` line (``fail``, or ``warn`` for a server
    the app does without), ``"<server> does not answer"`` followed by what
    ``reason(exc)`` says of it. Any other exception is left to the runner's own
    ``fail`` line, as any check's is."""
    started = time.monotonic()
    try:
        call()
    except errors as exc:
        return Check("", status, f"{server} does not answer{reason(exc)}", fix)
    return ok(f"{server} answers ({(time.monotonic() - started) * 1000:.0f} ms)")
