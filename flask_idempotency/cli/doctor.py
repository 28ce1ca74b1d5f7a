"""``flask idempotency doctor``: is this deployment set up right?

The mistakes a team makes in its first week are answered late and misleadingly
by requests (a forgotten ``migrate`` looks like a database outage: every
idempotent request gets ``503``). ``doctor`` asks each part directly and says
what is wrong and the command or setting that fixes it, in prose or as one
JSON document (``--json``): ``{"ok": bool, "checks": [{"name", "status",
"detail", "fix"}]}``, ``status`` being ``ok``, ``warn`` or ``fail``. It exits
``1`` when a check fails, ``0`` otherwise (warnings included).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from ..state import AppState
from ..store.base import StoreUnavailableError

OK, WARN, FAIL = "ok", "warn", "fail"


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    status: str
    detail: str
    #: What to do about it (a command or a setting), when there is something to do.
    fix: str | None = None


def diagnose(state: AppState) -> list[Check]:
    """Every check, in order; a check that cannot run (its part is down) fails."""
    checks = [_database(state)]
    if checks[0].status == OK:
        checks.append(_schema(state))
    checks.append(_cache(state))
    checks.append(_broker(state))
    checks.append(_pool(state))
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


def _timed(call: Callable[[], Any]) -> float:
    started = time.monotonic()
    call()
    return (time.monotonic() - started) * 1000


def _database(state: AppState) -> Check:
    try:
        ms = _timed(state.store.ping)
    except StoreUnavailableError as exc:
        return Check(
            "database",
            FAIL,
            f"PostgreSQL does not answer: {exc}",
            "check IDEMPOTENCY_DATABASE_URL (or db's engine URL) and the server",
        )
    return Check("database", OK, f"PostgreSQL answers ({ms:.0f} ms)")


def _schema(state: AppState) -> Check:
    try:
        missing = state.store.pending_migrations(state.settings.migration_dirs)
    except StoreUnavailableError as exc:
        return Check("schema", FAIL, f"cannot read the migrations ledger: {exc}")
    except FileNotFoundError as exc:
        return Check("schema", FAIL, str(exc), "fix IDEMPOTENCY_MIGRATION_DIRS")
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        return Check(
            "schema",
            FAIL,
            f"{len(missing)} migration(s) not applied: {shown}",
            "flask idempotency migrate (or upgrade_schema(op) in your Alembic history)",
        )
    return Check("schema", OK, "every migration is applied")


def _cache(state: AppState) -> Check:
    settings = state.settings
    if settings.redis_url is None and settings.redis is None:
        return Check("cache", OK, "no Redis configured: PostgreSQL answers every replay")
    try:
        ms = _timed(state.cache.ping)
    except Exception as exc:  # whatever redis-py raises: the cache fails open anyway
        return Check(
            "cache",
            WARN,
            f"Redis does not answer ({type(exc).__name__}); replays fall back to PostgreSQL",
            "check IDEMPOTENCY_REDIS_URL and the server",
        )
    return Check("cache", OK, f"Redis answers ({ms:.0f} ms)")


def _broker(state: AppState) -> Check:
    url = state.settings.broker_url
    if not url:
        return Check("broker", OK, "no broker configured (the relay needs one to publish)")
    from ..events.amqp import connect, redact  # the broker client, only when asked

    try:
        with connect(url, timeout=3.0) as connection:
            ms = _timed(lambda: connection.ensure_connection(max_retries=1))
    except Exception as exc:
        return Check(
            "broker",
            FAIL,
            f"{redact(url)} does not answer ({type(exc).__name__})",
            "check IDEMPOTENCY_BROKER_URL and the broker",
        )
    return Check("broker", OK, f"{redact(url)} answers ({ms:.0f} ms)")


def _pool(state: AppState) -> Check:
    if state.store.pool is None:
        return Check("pool", OK, "memory:// holds no connections")
    capacity = state.store.pool.capacity()
    if capacity is None:
        return Check("pool", OK, "the pool's size is the application's own")
    size, source = capacity
    return Check(
        "pool",
        OK,
        f"{size} request(s) can hold a connection at once ({source}); each worker "
        "thread serving an idempotent request needs one",
    )


def document(checks: list[Check]) -> dict[str, Any]:
    return {
        "ok": all(check.status != FAIL for check in checks),
        "checks": [dataclasses.asdict(check) for check in checks],
    }
