"""``flask idempotency doctor``: is this deployment set up right?

The mistakes a team makes in its first week are answered late and misleadingly
by requests (a forgotten ``migrate`` looks like a database outage: every
idempotent request gets ``503``). ``doctor`` asks each part directly and says
what is wrong and the command or setting that fixes it: one line per check, in
prose or as one JSON document (``--json``): ``{"ok": bool, "checks": [{"name",
"status", "detail", "fix", "ms"}]}``, ``status`` being ``ok``, ``warn`` or
``fail``. It exits ``1`` when a check fails, ``0`` otherwise (warnings included).

Each check is a function of its own module (``database``, ``routes``,
``server``, ``services``, ``workers``). A check that raises becomes a ``fail``
line naming the error; the others still run. The checks that need PostgreSQL
are skipped when it does not answer (each would wait its connect timeout).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from flask import Flask

from ...state import AppState
from ...store import schema
from ...store.base import SchemaMismatchError, StoreUnavailableError
from . import database, routes, server, services, workers
from .base import FAIL, OK, WARN, Check, Context, Options

CheckFunc = Callable[[Context], Check]

#: Checks that ask PostgreSQL, in the order they are shown.
DATABASE_CHECKS: tuple[tuple[str, CheckFunc], ...] = (
    ("schema", database.schema),
    ("pgbouncer", database.pgbouncer),
    ("session timeouts", database.session_timeouts),
    ("autovacuum", database.autovacuum),
    ("purge", database.purge),
    ("clock", database.clock),
)
#: Checks of the configuration and the other services.
OTHER_CHECKS: tuple[tuple[str, CheckFunc], ...] = (
    ("pool", server.pool),
    ("lease", routes.lease),
    ("scope", routes.scope),
    ("cache", services.cache),
)
LATER_CHECKS: tuple[tuple[str, CheckFunc], ...] = (
    ("broker", services.broker),
    ("prometheus", server.prometheus),
)
WORKER_CHECKS: tuple[tuple[str, CheckFunc], ...] = (
    ("relay", workers.relay),
    ("completer", workers.completer),
)


def diagnose(state: AppState, app: Flask, options: Options | None = None) -> list[Check]:
    """Every check, in order; one that cannot run (its part is down, or it broke)
    fails on its own line."""
    ctx = Context(app, state, options or Options())
    try:
        checks = [run("database", database.database, ctx)]
        database_up = checks[0].status == OK
        if database_up:
            checks += [run(name, check, ctx) for name, check in DATABASE_CHECKS]
        checks += [run(name, check, ctx) for name, check in OTHER_CHECKS]
        if services.configured(ctx) and checks[-1].status == OK:
            checks.append(run("redis memory", services.redis_memory, ctx))
        checks += [run(name, check, ctx) for name, check in LATER_CHECKS]
        if database_up:
            checks += [run(name, check, ctx) for name, check in WORKER_CHECKS]
        if state.settings.testing_drills:
            checks.append(
                Check(
                    "testing drills",
                    WARN,
                    "IDEMPOTENCY_TESTING_DRILLS is on: a request can ask to be failed",
                    "turn it off outside test configurations",
                )
            )
        return checks
    finally:
        ctx.close()


def run(name: str, check: CheckFunc, ctx: Context) -> Check:
    """``check(ctx)``, timed; whatever it raises becomes its ``fail`` line."""
    started = time.monotonic()
    try:
        result = check(ctx)
    except Exception as exc:
        result = _failed(name, exc)
    return dataclasses.replace(result, ms=round((time.monotonic() - started) * 1000, 1))


def _failed(name: str, exc: Exception) -> Check:
    """The line of a check that raised ``exc``. A table of ours that is missing is
    the schema check's failure, not this check's: it is skipped, as the checks
    are when PostgreSQL does not answer."""
    if isinstance(exc, SchemaMismatchError) or schema.mismatch(exc) is not None:
        return Check(
            name,
            WARN,
            "skipped: the idempotency schema is not in place (see the schema check)",
            "flask idempotency migrate",
        )
    if isinstance(exc, StoreUnavailableError):
        return Check(name, FAIL, f"PostgreSQL did not answer: {exc}")
    return Check(
        name,
        FAIL,
        f"the check could not run: {type(exc).__name__}: {exc}".strip(),
        "fix what it names, or report it if it looks like the doctor's own bug",
    )


def document(checks: list[Check]) -> dict[str, Any]:
    return {
        "ok": all(check.status != FAIL for check in checks),
        "checks": [dataclasses.asdict(check) for check in checks],
    }


def lines(checks: list[Check]) -> list[str]:
    """The prose report: ``OK   name  detail`` and, under a problem, ``-> fix``."""
    width = max((len(check.name) for check in checks), default=0)
    out = []
    for check in checks:
        out.append(f"{check.status.upper():<4}  {check.name:<{width}}  {check.detail}")
        if check.fix and check.status != OK:
            out.append(f"{'':<{width + 8}}-> {check.fix}")
    counts = {status: sum(c.status == status for c in checks) for status in (OK, WARN, FAIL)}
    out.append(f"{len(checks)} checks: {counts[OK]} ok, {counts[WARN]} warn, {counts[FAIL]} fail")
    return out
