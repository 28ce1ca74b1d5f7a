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
from .base import FAIL, OK, WARN, Check, Context, Options, fail, warn

CheckFunc = Callable[[Context], "Check | None"]


def testing_drills(ctx: Context) -> Check | None:
    if not ctx.state.settings.testing_drills:
        return None
    return warn(
        "IDEMPOTENCY_TESTING_DRILLS is on: a request can ask to be failed",
        "turn it off outside test configurations",
    )


#: Every check in the order shown: its name, its function, and the check that
#: must have passed first (the checks that ask PostgreSQL are skipped when it
#: does not answer; Redis' memory is read only from a Redis that answered).
CHECKS: tuple[tuple[str, CheckFunc, str | None], ...] = (
    ("database", database.database, None),
    ("schema", database.schema, "database"),
    ("pgbouncer", database.pgbouncer, "database"),
    ("session timeouts", database.session_timeouts, "database"),
    ("autovacuum", database.autovacuum, "database"),
    ("purge", database.purge, "database"),
    ("clock", database.clock, "database"),
    ("pool", server.pool, None),
    ("lease", routes.lease, None),
    ("scope", routes.scope, None),
    ("cache", services.cache, None),
    ("redis memory", services.redis_memory, "cache"),
    ("broker", services.broker, None),
    ("prometheus", server.prometheus, None),
    ("relay", workers.relay, "database"),
    ("completer", workers.completer, "database"),
    ("testing drills", testing_drills, None),
)


def diagnose(state: AppState, app: Flask, options: Options | None = None) -> list[Check]:
    """Every check, in order; one that cannot run (its part is down, or it broke)
    fails on its own line."""
    ctx = Context(app, state, options or Options())
    done: dict[str, Check] = {}
    try:
        for name, check, needs in CHECKS:
            if needs is None or (needs in done and done[needs].status == OK):
                if (result := run(name, check, ctx)) is not None:
                    done[name] = result
        return list(done.values())
    finally:
        ctx.close()


def run(name: str, check: CheckFunc, ctx: Context) -> Check | None:
    """``check(ctx)``, named and timed; whatever it raises becomes its ``fail`` line."""
    started = time.monotonic()
    try:
        result = check(ctx)
    except Exception as exc:
        result = _failed(exc)
    ms = round((time.monotonic() - started) * 1000, 1)
    return None if result is None else dataclasses.replace(result, name=name, ms=ms)


def _failed(exc: Exception) -> Check:
    """The finding of a check that raised ``exc``. A table of ours that is missing
    is the schema check's failure, not this check's: it is skipped, as the checks
    are when PostgreSQL does not answer."""
    if isinstance(exc, SchemaMismatchError) or schema.mismatch(exc) is not None:
        return warn(
            "skipped: the idempotency schema is not in place (see the schema check)",
            "flask idempotency migrate",
        )
    if isinstance(exc, StoreUnavailableError):
        return fail(f"PostgreSQL did not answer: {exc}")
    return fail(
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
