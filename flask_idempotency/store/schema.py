"""Is the extension's schema in place? A missing one is named, not taken for an outage.

A forgotten ``flask idempotency migrate`` used to answer every idempotent
request ``503 store_unavailable`` with ``Retry-After``: a deployment mistake
dressed as a transient outage, which clients retry for ever while on-call looks
at the database. The store now reads the migrations ledger at start-up (where
the database answers) and the SQLSTATE of a statement that fails on the request
path (where it did not): a missing table, column or function is a
:class:`~.base.SchemaMismatchError`, logged once as an ERROR that names the
command to run, and answered as a non-retryable ``500`` (``errors.py``).

While the schema is known to be wrong, requests are refused without a round
trip; one of them looks again every :data:`RECHECK_SECONDS`, so a migrate run
while the application serves is picked up without a restart.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from . import migrations
from .base import SchemaMismatchError
from .driver import sqlstate
from .errors import reason_of

log = logging.getLogger("flask_idempotency.store")

#: undefined_table, undefined_column, undefined_function: a statement named an
#: object the database does not have. Only a schema behind the code does that.
SCHEMA_SQLSTATES = frozenset({"42P01", "42703", "42883"})

#: How long a known problem is answered from memory before a request looks again:
#: short enough that a fixed schema serves within seconds, long enough that a
#: busy API refused for it costs the database two small queries every few seconds.
RECHECK_SECONDS = 5.0

#: What fixes it, in every log line and error message about it.
FIX = (
    "run `flask idempotency migrate` (or, when Alembic manages the schema, a revision "
    "whose upgrade() calls flask_idempotency.alembic.upgrade_schema(op))"
)


@dataclasses.dataclass(frozen=True)
class Problem:
    """What is wrong with the schema; each refusal raises a new error from it
    (one exception object raised in many threads would share its traceback)."""

    missing: bool
    detail: str
    #: Read from the ledger, rather than from one failed statement (whose missing
    #: column or function a ledger that says "all applied" cannot confirm).
    from_ledger: bool = True

    def error(self) -> SchemaMismatchError:
        return SchemaMismatchError(self.detail, missing=self.missing)


def mismatch(exc: BaseException) -> SchemaMismatchError | None:
    """The driver error ``exc`` as a schema problem, if its SQLSTATE says an object
    is missing; ``None`` for anything else."""
    if sqlstate(exc) not in SCHEMA_SQLSTATES:
        return None
    reason = reason_of(exc)
    missing = sqlstate(exc) == "42P01" and "idempotency_records" in reason
    what = "has no idempotency tables" if missing else "lacks part of the idempotency schema"
    detail = f"the database {what} ({reason}); {FIX}"
    return SchemaMismatchError(detail, missing=missing)


def inspect(cur: Any, names: list[str]) -> Problem | None:
    """Compare the database's ledger with the package's migration ``names``.

    A database with the records table but no ledger was set up some other way:
    nothing here can tell what it lacks, so it is not judged (a statement that
    then fails still names the missing object, :func:`mismatch`).
    """
    cur.execute(migrations.PRESENCE)  # (the ledger's read follows only if it exists)
    ledger, records = cur.fetchall()[0]
    if records and not ledger:
        return None
    done = migrations.applied(cur) if ledger else set()
    todo = [name for name in names if name not in done]
    if not todo:
        return None
    if len(todo) == len(names):
        return Problem(True, f"the database has no idempotency tables; {FIX}")
    shown = ", ".join(todo[:3]) + (" ..." if len(todo) > 3 else "")
    return Problem(
        False,
        f"the idempotency schema is older than this flask-idempotency: {len(todo)} "
        f"migration(s) not applied ({shown}); {FIX}",
    )


class SchemaWatch:
    """The store's knowledge of its schema: unknown, in place, or a problem.

    ``inspect`` reads the database (and raises ``StoreUnavailableError`` when it
    does not answer). Thread-safe; the request path costs one attribute read
    while the schema is in place.
    """

    def __init__(
        self,
        inspect: Callable[[], Problem | None],
        *,
        recheck: float = RECHECK_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._inspect = inspect
        #: Seconds a known problem is answered from memory (tests may shorten it).
        self.recheck = recheck
        self._clock = clock
        self._lock = threading.Lock()
        #: The known problem, or ``None`` (in place, or not yet known).
        self.problem: Problem | None = None
        #: Whether the ledger was read (or a statement failed) yet: until then the
        #: first request reads it, so a schema that lets the claim through but not
        #: the completion is refused before the view runs, not after.
        self._known = False
        self._checked_at = 0.0
        #: The problem last logged, so each is logged once, not per request.
        self._logged: Problem | None = None

    def check(self) -> Problem | None:
        """Read the ledger now; log a new problem, or its end."""
        with self._lock:
            return self._look()

    def migrated(self) -> None:
        """This process has just applied every migration (``IDEMPOTENCY_AUTO_MIGRATE``,
        or ``flask idempotency migrate`` run on this store)."""
        with self._lock:
            self._set(None)

    def ensure(self) -> None:
        """:meth:`guard`, after reading the ledger once if nothing did yet (the
        database did not answer at start-up)."""
        if not self._known:
            with self._lock:
                if not self._known:
                    self._look()
        self.guard()

    def guard(self) -> None:
        """Before a claim: raise ``SchemaMismatchError`` while the schema is known to
        be wrong. Every ``recheck`` seconds one caller reads the ledger again, and
        goes on to its claim if the problem is gone; the others meanwhile are
        refused from memory."""
        problem = self.problem
        if problem is None:
            return
        due = self._clock() - self._checked_at >= self.recheck
        if due and self._lock.acquire(blocking=False):
            try:
                problem = self._look()
            finally:
                self._lock.release()
        if problem is not None:
            raise problem.error()

    def failed(self, error: SchemaMismatchError) -> None:
        """A statement on the request path named an object the database lacks:
        refuse from memory until the next re-check."""
        with self._lock:
            self._set(Problem(error.missing, error.detail, from_ledger=False))

    def _look(self) -> Problem | None:
        self._checked_at = self._clock()  # also on failure: one caller at a time waits
        problem = self._inspect()
        self._set(problem)
        return problem

    def _set(self, problem: Problem | None) -> None:
        """Remember ``problem``; log it once per kind (missing or outdated), and its
        end once the ledger says so. A problem only a failed statement showed is
        not declared over by a ledger that never saw it, so a schema that keeps
        failing is not logged every few seconds."""
        self.problem, self._checked_at, self._known = problem, self._clock(), True
        logged = self._logged
        if problem is not None:
            self._logged = problem
            if logged is None or logged.missing != problem.missing:
                log.error(
                    "idempotency: %s. Idempotent requests are refused (500 %s) until then.",
                    problem.detail,
                    "schema_missing" if problem.missing else "schema_outdated",
                )
        elif logged is not None and logged.from_ledger:
            self._logged = None
            log.warning("idempotency: the idempotency schema is in place; requests are served")
