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
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from . import driver, migrations, schema
from .base import LeaseHold, StoreUnavailableError
from .breaker import StoreBreaker
from .errors import is_unreachable
from .maintenance import Maintenance
from .pool import BorrowedPool, Connection, ConnectionPool, Pool
from .request import PostgresRequest, RowClaimRequest, TransactionClaimRequest
from .sql import (
    ASYNC_COMMIT_PREFIX,
    CLAIM,
    CLAIM_IN_TRANSACTION,
    CLAIM_NEW,
    CLIENT_DEADLINE_GRACE,
    COMPLETE,
    EXECUTE_CLAIM,
    EXECUTE_CLAIM_IN_TRANSACTION,
    EXECUTE_CLAIM_NEW,
    EXECUTE_COMPLETE,
    EXECUTE_INSERT_COMPLETED,
    INSERT_COMPLETED,
    PREPARE_CLAIM,
    PREPARE_CLAIM_IN_TRANSACTION,
    RENEW,
    timeouts_sql,
)
from .watchdog import WATCHDOG

log = logging.getLogger("flask_idempotency.store")


class PostgresStore(Maintenance):
    """The records' store: a pool, the statements' texts for this configuration,
    and everything that is not one request's (health, lease renewal, migrations;
    the maintenance operations come from :class:`~.maintenance.Maintenance`)."""

    def __init__(
        self,
        pool: Pool,
        *,
        async_claim_commit: bool = True,
        prepare_statements: bool = True,
        statement_timeout: float = 5.0,
        lock_timeout: float = 2.0,
        claim_mode: str = "row",
        breaker_threshold: int = 3,
        breaker_cooldown: float = 1.0,
    ) -> None:
        self.pool = pool
        #: How the pool's connections take our statements (psycopg2 or psycopg 3).
        self.driver = pool.driver
        #: ``"row"`` (a processing row, committed on its own) or ``"transaction"``.
        self.claim_mode = claim_mode
        self.async_claim_commit = async_claim_commit
        self.prepare_statements = prepare_statements
        #: ``SET LOCAL`` of the statement and lock timeouts, first in each of our
        #: round trips; ``deadline``: seconds before the watchdog gives up on one.
        self.timeouts = timeouts_sql(statement_timeout, lock_timeout)
        self.deadline = statement_timeout + CLIENT_DEADLINE_GRACE
        self._prefix = self.timeouts + (ASYNC_COMMIT_PREFIX if async_claim_commit else "")
        self._claim_inline = self._prefix + CLAIM
        self._claim_execute = self._prefix + EXECUTE_CLAIM
        self._claim_new_inline = self._prefix + CLAIM_NEW
        self._claim_new_execute = self._prefix + EXECUTE_CLAIM_NEW
        # The timeouts go first, so they bound the PREPARE too.
        self._claim_prepare = self.timeouts + PREPARE_CLAIM + self._claim_execute
        self._claim_new_prepare = self.timeouts + PREPARE_CLAIM + self._claim_new_execute
        self.complete_alone = self.timeouts + COMPLETE
        self.complete_in_transaction = self.timeouts + COMPLETE + ";\nCOMMIT"
        #: The completion on a connection that has it prepared (``prepared_complete_sql``).
        self.complete_prepared_alone = self.timeouts + EXECUTE_COMPLETE
        self.complete_prepared_in_transaction = self.timeouts + EXECUTE_COMPLETE + ";\nCOMMIT"
        self.insert_completed = self.timeouts + INSERT_COMPLETED
        self.insert_completed_prepared = self.timeouts + EXECUTE_INSERT_COMPLETED
        self._tx_claim_execute = "BEGIN;\n" + EXECUTE_CLAIM_IN_TRANSACTION
        self._tx_claim_prepare = (
            "BEGIN;\n" + PREPARE_CLAIM_IN_TRANSACTION + EXECUTE_CLAIM_IN_TRANSACTION
        )
        #: Completions run prepared (on the connection their claim prepared them on)
        #: until a session is found to have lost its statements (``forget_prepared``).
        self.prepared_completion = prepare_statements
        # Connections that have the claim prepared. A claim that finds its statement
        # gone (or already there) corrects this and runs again.
        self._prepared: weakref.WeakSet[Connection] = weakref.WeakSet()
        self._renew_lock = threading.Lock()
        self._migration_names = [name for name, _ in migrations.package_migrations()]
        #: Whether the extension's schema is in place (``schema.py``): checked at
        #: start-up, guarded before each claim.
        self.schema = schema.SchemaWatch(self.inspect_schema)
        #: Opens when PostgreSQL stops answering: requests then answer 503 at once
        #: instead of queueing behind a frozen server (``breaker.py``). Reports to
        #: the pool's observer, which ``observability.attach`` sets.
        self.breaker = StoreBreaker(
            breaker_threshold, breaker_cooldown, observer=lambda: self.pool.observer
        )

    def claim_sql(self, conn: Connection, *, new_key: bool = False) -> str:
        """The claim's text for this connection: prepared on first use if enabled.
        ``new_key``: the first request's claim (``sql.CLAIM_NEW_BODY``), tried first."""
        if not self.prepare_statements:
            return self._claim_new_inline if new_key else self._claim_inline
        if conn in self._prepared:
            return self._claim_new_execute if new_key else self._claim_execute
        self._prepared.add(conn)
        return self._claim_new_prepare if new_key else self._claim_prepare

    def claim_in_transaction_sql(self, conn: Connection) -> str:
        """The transaction claim's text for this connection (``claim_sql``'s rules)."""
        if not self.prepare_statements:
            return CLAIM_IN_TRANSACTION
        if conn in self._prepared:
            return self._tx_claim_execute
        self._prepared.add(conn)
        return self._tx_claim_prepare

    def forget_prepared(self, conn: Connection) -> None:
        """``conn`` lost its prepared statements: its next claim prepares them again.

        A claim can prepare again; a completion cannot, once the view's writes are
        in the transaction. Statements that vanish from a session mean a pooler in
        transaction mode that moves sessions between transactions (or an
        application that deallocates them), so from the first time on, completions
        are sent as function calls: slower, never lost."""
        self._prepared.discard(conn)
        if not self.driver.keeps_prepared(conn):
            return  # the driver's own doing (psycopg 3): its completions never rely on them
        if self.prepared_completion:
            self.prepared_completion = False
            log.warning(
                "idempotency: prepared statements vanished from a PostgreSQL session (a "
                "pooler in transaction mode? set IDEMPOTENCY_DATABASE_OPTIONS"
                '["prepare_statements"] = False); completions are no longer prepared'
            )

    @classmethod
    def from_settings(cls, settings: Any, pool: Pool | None = None) -> PostgresStore:
        """The store ``settings`` describe, on ``pool`` when one is given (an
        application's SQLAlchemy engine: ``engine_pool.EnginePool``), else on a
        borrowed ``IDEMPOTENCY_POOL`` or a pool of its own."""
        if pool is None:
            if settings.pool is not None:
                pool = BorrowedPool(settings.pool)
            else:
                pool = ConnectionPool(
                    settings.database_url,
                    max_size=settings.pool_size,
                    timeout=settings.pool_timeout,
                    connect_timeout=settings.connect_timeout,
                    connect_kwargs=dict(settings.connect_kwargs),
                )
        return cls(
            pool,
            async_claim_commit=settings.async_claim_commit,
            prepare_statements=settings.prepare_statements,
            statement_timeout=settings.statement_timeout,
            lock_timeout=settings.lock_timeout,
            claim_mode=settings.claim_mode,
            breaker_threshold=settings.store_breaker_threshold,
            breaker_cooldown=settings.store_breaker_cooldown,
        )

    def begin(self) -> PostgresRequest:
        """A new request's handle, in this store's claim mode."""
        if self.claim_mode == "transaction":
            return TransactionClaimRequest(self)
        return RowClaimRequest(self)

    @contextmanager
    def autocommit(self, *, discard: bool = False) -> Iterator[Connection]:
        """A pooled autocommit connection for the extension's own maintenance
        statements (closed after the block with ``discard``): any driver error is a
        ``StoreUnavailableError``, a missing table or function the
        ``SchemaMismatchError`` that names the command to run."""
        try:
            with self.pool.connection(discard=discard) as conn:
                yield conn
        except driver.ERRORS as exc:
            if is_unreachable(exc):
                self.pool.discard_idle()
            raise (
                schema.mismatch(exc)
                or StoreUnavailableError(f"{type(exc).__name__}: {exc}".strip())
            ) from exc

    @contextmanager
    def transaction(self) -> Iterator[Connection]:
        """A connection in a transaction for the application's own work outside
        idempotent routes: committed on success, rolled back on an exception.

        Only "PostgreSQL cannot be reached" is a ``StoreUnavailableError`` (a 503):
        an error of the application's own statements (an ``IntegrityError``, say)
        propagates unchanged after the rollback, as does a ``COMMIT`` that fails
        for a reason of its own (a deferred constraint).
        """
        conn = self._begun()
        broken = False
        try:
            try:
                yield conn
            except BaseException as exc:
                broken = _rollback_quietly(conn)
                if isinstance(exc, driver.ERRORS) and is_unreachable(exc, conn):
                    broken = True
                    raise StoreUnavailableError(f"statement failed: {type(exc).__name__}") from exc
                raise
            # Under the client-side deadline: a COMMIT waiting for a synchronous
            # standby that is gone ignores statement_timeout and would wait for ever.
            # Its outcome is then unknown (it lands if the standby returns): 503.
            ticket = WATCHDOG.watch(conn, self.deadline)
            try:
                with conn.cursor() as cur:
                    cur.execute("COMMIT")
            except driver.ERRORS as exc:
                if WATCHDOG.unwatch(ticket) or is_unreachable(exc, conn):
                    broken = True
                    raise StoreUnavailableError(f"COMMIT failed: {type(exc).__name__}") from exc
                broken = _rollback_quietly(conn)
                raise
            if WATCHDOG.unwatch(ticket):  # answered just as the socket was shut down
                broken = True
                raise StoreUnavailableError("COMMIT had no answer before the deadline")
        finally:
            self.pool.putconn(conn, discard=broken or bool(conn.closed))
            if broken:
                self.pool.discard_idle()

    def _begun(self, *, retry: bool = True) -> Connection:
        """A pooled connection with ``BEGIN`` sent. One that died while idle in the
        pool (after a restart or a healed partition) is dropped with its idle peers
        and, with ``retry``, replaced once: nothing was in its transaction yet."""
        conn = self.pool.getconn()
        try:
            with conn.cursor() as cur:
                cur.execute("BEGIN")
        except driver.ERRORS as exc:
            lost = is_unreachable(exc, conn)
            self.pool.putconn(conn, discard=lost or bool(conn.closed))
            if lost:
                self.pool.discard_idle()
                if retry:
                    return self._begun(retry=False)
            raise StoreUnavailableError(f"BEGIN failed: {type(exc).__name__}") from exc
        return conn

    def ping(self) -> None:
        """One short statement under the extension's timeouts (health checks); at once
        ``StoreUnavailableError`` while the breaker is open, which it may probe. A
        pooled connection that died while idle is replaced once and not counted, as
        a claim's is: a health check just after a restart finds the server up."""
        self.breaker.admit()
        if not self._ping(retried_if_lost=True):
            self._ping(retried_if_lost=False)

    def _ping(self, *, retried_if_lost: bool) -> bool:
        """``SELECT 1`` on a pooled connection: True once answered; False when
        ``retried_if_lost`` and the connection was lost (it and its idle peers are
        discarded: the caller tries a fresh one); ``StoreUnavailableError`` else."""
        lost = False
        try:
            with self.autocommit() as conn:
                ticket = WATCHDOG.watch(conn, self.deadline, self.breaker.no_answer)
                error: BaseException | None = None
                try:
                    with self.driver.cursor(conn) as cur:
                        self.driver.execute(cur, self.timeouts + "SELECT 1")
                except BaseException as exc:
                    error = exc
                    raise
                finally:
                    fired = WATCHDOG.unwatch(ticket)
                    lost = (
                        not fired
                        and isinstance(error, driver.ERRORS)
                        and is_unreachable(error, conn)
                    )
                    self.breaker.outcome(conn, error, fired=fired, retried_if_lost=retried_if_lost)
                    if fired:
                        conn.close()
        except StoreUnavailableError:
            if lost and retried_if_lost:
                return False
            raise
        return True

    def prepare_renewals(self) -> None:
        """Open the lease keeper's connection ahead of its first renewal (best effort:
        a failure here is retried by the renewal)."""
        try:
            with self._renew_lock:
                self.pool.renewal_connection()
        except StoreUnavailableError as exc:
            log.warning("idempotency: no connection for lease renewals yet: %s", exc)

    def renew(self, holds: Sequence[LeaseHold]) -> int:
        """Renew ``holds`` on the keeper's own connection, never a request slot: a pool
        whose every connection is held by a slow view still gets its leases renewed."""
        if not holds:
            return 0
        params = (
            [h.record_key for h in holds],
            [h.token for h in holds],
            [h.lease for h in holds],
        )
        retry = True
        with self._renew_lock:
            while True:
                conn = self.pool.renewal_connection()
                count, error = 0, None
                ticket = WATCHDOG.watch(conn, self.deadline)
                try:
                    with self.driver.cursor(conn) as cur:
                        self.driver.execute(cur, self.timeouts + RENEW, params)
                        count = int(cur.rowcount)
                except driver.ERRORS as exc:
                    error = exc
                finally:
                    fired = WATCHDOG.unwatch(ticket)
                lost = error is not None and is_unreachable(error, conn)
                if fired or lost:
                    self.pool.discard_renewal_connection()
                if lost and not fired and retry:
                    # The keeper's connection died while it waited (a restart, a
                    # healed partition): renewing is idempotent, so at once once more
                    # on a fresh one rather than a whole renewal interval later.
                    retry = False
                    continue
                if fired or error is not None:
                    reason = "no answer in time" if fired else type(error).__name__
                    raise StoreUnavailableError(f"renewal failed: {reason}") from error
                return count

    def inspect_schema(self, *, keep_connection: bool = True) -> schema.Problem | None:
        """What the database lacks of the extension's own schema, read from the
        migrations ledger under the extension's timeouts; ``None`` when it is in
        place. ``StoreUnavailableError`` when PostgreSQL does not answer."""
        with self.autocommit(discard=not keep_connection) as conn:
            ticket = WATCHDOG.watch(conn, self.deadline)
            try:
                with self.driver.cursor(conn) as cur:
                    return schema.inspect(cur, self._migration_names)
            finally:
                if WATCHDOG.unwatch(ticket):
                    conn.close()

    def check_schema_at_start(self) -> schema.Problem | None:
        """:meth:`inspect_schema` for ``init_app``, on a connection closed after it:
        an app built before a fork (gunicorn's ``--preload``) must not leave its
        workers a shared socket in a pool that cannot tell (SQLAlchemy's)."""
        return self.schema.check(lambda: self.inspect_schema(keep_connection=False))

    def pending_migrations(self, extra_dirs: Sequence[str] = ()) -> list[str]:
        """The migrations this database has not applied (``flask idempotency doctor``)."""
        found = migrations.all_migrations(extra_dirs)
        with self.autocommit() as conn, self.driver.cursor(conn) as cur:
            return migrations.pending(cur, found)

    def migrate(self, extra_dirs: Sequence[str] = ()) -> list[str]:
        found = migrations.all_migrations(extra_dirs)
        with self.autocommit() as conn:
            applied = migrations.apply(conn, found)
        self.schema.migrated()
        return applied

    def close(self) -> None:
        with self._renew_lock:
            self.pool.close()


def _rollback_quietly(conn: Connection) -> bool:
    """Roll back the application's transaction; True if the connection is broken."""
    if conn.closed:
        return True
    try:
        with conn.cursor() as cur:
            cur.execute("ROLLBACK")
    except driver.ERRORS:
        return True
    return False
