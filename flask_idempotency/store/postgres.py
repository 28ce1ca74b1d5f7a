"""The PostgreSQL store: the source of truth for every claim.

Round trips per request are the hot path's cost, so each phase is one
statement: the claim (``INSERT ... ON CONFLICT`` that also reads back an
existing row), the completion (inside the view's own transaction, together
with its ``COMMIT``), and the release. Their text is ``sql.py``'s; one
request's handle is ``request.py``'s.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from sqlalchemy.engine import Engine

from . import driver, migrations, schema
from .base import LeaseHold, StoreUnavailableError
from .breaker import StoreBreaker
from .errors import is_unreachable
from .maintenance import Maintenance
from .pool import Connection, EnginePool, build_engine
from .request import PostgresRequest
from .runner import NoAnswer, run, watched
from .sql import CLIENT_DEADLINE_GRACE, Statements, timeouts_sql

log = logging.getLogger("flask_idempotency.store")


class PostgresStore(Maintenance):
    """The records' store: a pool, the statements' texts for this configuration,
    and everything that is not one request's (health, lease renewal, migrations;
    the maintenance operations come from :class:`~.maintenance.Maintenance`)."""

    def __init__(self, pool: EnginePool, settings: Any) -> None:
        """The store on ``pool``, configured by ``settings`` (``settings.Settings``:
        the claim mode, the timeouts, the breaker's threshold and cooldown)."""
        self.pool = pool
        #: How the pool's connections take our statements (psycopg2 or psycopg 3).
        self.driver = pool.driver
        #: ``"row"`` (a processing row, committed on its own) or ``"transaction"``.
        self.claim_mode = settings.claim_mode
        statement_timeout, lock_timeout = settings.statement_timeout, settings.lock_timeout
        #: One text per operation (``sql.Statements``), built once from the settings.
        self.statements = Statements.build(
            statement_timeout=statement_timeout,
            lock_timeout=lock_timeout,
            async_claim_commit=settings.async_claim_commit,
        )
        #: ``SET LOCAL`` of the timeouts, for the maintenance statements.
        self.timeouts = timeouts_sql(statement_timeout, lock_timeout)
        #: Seconds before the watchdog gives up on one of our statements.
        self.deadline = statement_timeout + CLIENT_DEADLINE_GRACE
        self._renew_lock = threading.Lock()
        self._migration_names = [name for name, _ in migrations.package_migrations()]
        #: Whether the extension's schema is in place (``schema.py``): checked at
        #: start-up, guarded before each claim.
        self.schema = schema.SchemaWatch(self.inspect_schema)
        #: Opens when PostgreSQL stops answering: requests then answer 503 at once
        #: instead of queueing behind a frozen server (``breaker.py``). Reports to
        #: the pool's observer, which ``observability.attach`` sets.
        self.breaker = StoreBreaker(
            settings.store_breaker_threshold,
            settings.store_breaker_cooldown,
            observer=lambda: self.pool.observer,
        )

    @classmethod
    def from_settings(
        cls, settings: Any, engine: Engine | None = None, *, max_overflow: int | None = None
    ) -> PostgresStore:
        """The store ``settings`` describe, on ``engine`` when one is given (the
        application's: ``db=`` or ``engine=``; ``max_overflow`` its pool's, when
        known), else on one built from ``IDEMPOTENCY_DATABASE_URL``."""
        if engine is not None:
            return cls(EnginePool(engine, max_overflow=max_overflow), settings)
        return cls(EnginePool(build_engine(settings), owned=True), settings)

    def begin(self) -> PostgresRequest:
        """A new request's handle, in this store's claim mode."""
        return PostgresRequest(self)

    def autocommit(self, *, discard: bool = False) -> AbstractContextManager[Connection]:
        """A pooled autocommit connection for the extension's own maintenance
        statements (``EnginePool.connection``: driver errors become the store's)."""
        return self.pool.connection(discard=discard)

    @contextmanager
    def transaction(self) -> Iterator[Connection]:
        """A connection in a transaction for the application's own work outside
        idempotent routes: committed on success, rolled back on an exception.

        Only "PostgreSQL cannot be reached" is a ``StoreUnavailableError`` (a 503):
        an error of the application's own statements (an ``IntegrityError``, say)
        propagates unchanged after the rollback, as does a ``COMMIT`` that fails
        for a reason of its own (a deferred constraint). The ``COMMIT`` runs under
        the client-side deadline: one waiting for a synchronous standby that is
        gone ignores ``statement_timeout``, and its outcome is then unknown (503).
        """
        request = PostgresRequest(self, guarded=False)
        try:
            conn = request.connection()
            try:
                yield conn
            except driver.ERRORS as exc:
                if is_unreachable(exc, conn):
                    raise StoreUnavailableError(f"statement failed: {type(exc).__name__}") from exc
                raise
            request.commit()
        finally:
            request.close()

    def ping(self) -> None:
        """One short statement under the extension's timeouts (health checks), sent as
        a request's are: at once ``StoreUnavailableError`` while the breaker is open,
        which it may probe; a pooled connection that died while idle is replaced once
        and not counted, so a health check just after a restart finds the server up."""
        request = PostgresRequest(self)
        try:
            request._send("ping", self.statements.ping, retry=True)
        finally:
            request.close()

    def prepare_renewals(self) -> None:
        """Open the lease keeper's connection ahead of its first renewal (best effort:
        a failure here is retried by the renewal)."""
        try:
            with self._renew_lock, self.pool.renewal():
                pass
        except StoreUnavailableError as exc:
            log.warning("idempotency: no connection for lease renewals yet: %s", exc)

    def renew(self, holds: Sequence[LeaseHold]) -> int:
        """Renew ``holds`` on the keeper's own connection, never a request slot: a pool
        whose every connection is held by a slow view still gets its leases renewed.
        A connection that died while the keeper waited (a restart, a healed
        partition) is replaced at once, as renewing is idempotent, rather than a
        whole interval later."""
        if not holds:
            return 0
        params = ([h.record_key for h in holds], [h.token for h in holds], [h.lease for h in holds])
        retry, text, deadline = True, self.statements.renew, self.deadline
        with self._renew_lock:
            while True:
                try:
                    with self.pool.renewal() as conn:
                        return int(
                            run(conn, self.driver, text, params, deadline=deadline, breaker=None)
                        )
                except driver.ERRORS as exc:
                    # Once more on a fresh connection if the keeper's died while idle;
                    # not if the server did not answer in time.
                    cut = isinstance(exc, NoAnswer)
                    if not retry or cut or not is_unreachable(exc):
                        reason = "no answer in time" if cut else type(exc).__name__
                        raise StoreUnavailableError(f"renewal failed: {reason}") from exc
                    retry = False

    def inspect_schema(self) -> schema.Problem | None:
        """What the database lacks of the extension's own schema, read from the
        migrations ledger under the extension's timeouts; ``None`` when it is in
        place. ``StoreUnavailableError`` when PostgreSQL does not answer.

        On a connection closed after it: read in ``init_app`` too, where an app
        built before a fork (gunicorn's ``--preload``) must not leave its workers
        a socket of the parent's in the pool."""
        with self.autocommit(discard=True) as conn:
            with watched(conn, self.deadline), self.driver.cursor(conn) as cur:
                return schema.inspect(cur, self._migration_names)

    def check_schema_at_start(self) -> schema.Problem | None:
        return self.schema.check()

    def pending_migrations(self, extra_dirs: Sequence[str] = ()) -> list[str]:
        """The migrations this database has not applied (``flask idempotency doctor``)."""
        names = [name for name, _ in migrations.all_migrations(extra_dirs)]
        with self.autocommit() as conn, self.driver.cursor(conn) as cur:
            return migrations.pending(cur, names)

    def migrate(self, extra_dirs: Sequence[str] = ()) -> list[str]:
        found = migrations.all_migrations(extra_dirs)
        with self.autocommit() as conn:
            applied = migrations.apply(conn, found)
        self.schema.migrated()
        return applied

    def close(self) -> None:
        with self._renew_lock:
            self.pool.close()
