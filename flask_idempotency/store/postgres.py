"""The PostgreSQL store: the source of truth for every claim.

Round trips per request are the hot path's cost, so each phase is one
statement: the claim (``INSERT ... ON CONFLICT`` that also reads back an
existing row), the completion (inside the view's own transaction, together
with its ``COMMIT``), and the release. Their text is ``sql.py``'s; one
request's handle is ``request.py``'s.

Everything else is the store's maintenance: purge, inspection and unlock for
the CLI; the completer's takeover of abandoned records and its settlements;
the consumer guard's attempt counting. Each runs on a pooled connection of its
own, under the same ``SET LOCAL`` statement and lock timeouts and client-side
deadline as the request path, so a PostgreSQL that stops answering fails these
with ``StoreUnavailableError`` instead of hanging an operator's command, a
completer or a consumer.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from contextlib import closing, contextmanager
from typing import Any

from sqlalchemy.engine import Engine

from . import diagnostics, driver, migrations, schema, sql
from .base import LeaseHold, RecordInfo, StoreUnavailableError, Taken, phases_of
from .breaker import StoreBreaker
from .errors import is_unreachable
from .pool import Connection, EnginePool, build_engine
from .request import PostgresRequest
from .runner import NoAnswer, watched
from .sql import CLIENT_DEADLINE_GRACE, Statements

log = logging.getLogger("flask_idempotency.store")


class PostgresStore:
    """The records' store: a pool, the statements' texts for this configuration,
    and everything that is not one request's (health, lease renewal, migrations,
    maintenance)."""

    def __init__(self, pool: EnginePool, settings: Any) -> None:
        """The store on ``pool``, configured by ``settings`` (``settings.Settings``:
        the claim mode, the timeouts, the breaker's threshold and cooldown)."""
        self.pool = pool
        #: How the pool's connections take our statements (psycopg2 or psycopg 3).
        self.driver = pool.driver
        #: ``"row"`` (a processing row, committed on its own) or ``"transaction"``.
        self.claim_mode = settings.claim_mode
        #: The request path's texts and the ``SET LOCAL`` timeouts every other
        #: statement starts with (``sql.Statements``), built once from the settings.
        self.statements = Statements.build(settings)
        #: Seconds before the watchdog gives up on one of our statements.
        self.deadline = settings.statement_timeout + CLIENT_DEADLINE_GRACE
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
        with closing(PostgresRequest(self, guarded=False)) as request:
            conn = request.connection()
            try:
                yield conn
            except driver.ERRORS as exc:
                if is_unreachable(exc, conn):
                    raise StoreUnavailableError(f"statement failed: {type(exc).__name__}") from exc
                raise
            request.commit()

    def ping(self) -> None:
        """One short statement under the extension's timeouts (health checks), sent as
        a request's are: at once ``StoreUnavailableError`` while the breaker is open,
        which it may probe; a pooled connection that died while idle is replaced once
        and not counted, so a health check just after a restart finds the server up."""
        with closing(PostgresRequest(self)) as request:
            request._send("ping", self.statements.timeouts + "SELECT 1", retry=True)

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
        params = ([h.record_key for h in holds], [h.token for h in holds], [h.lease for h in holds])
        retry = True
        with self._renew_lock:
            while True:
                try:
                    with self.pool.renewal() as conn, watched(conn, self.deadline):
                        with self.driver.cursor(conn) as cur:
                            self.driver.execute(cur, self.statements.timeouts + sql.RENEW, params)
                            return int(cur.rowcount)
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
        with self.pool.connection(discard=True) as conn:
            with watched(conn, self.deadline), self.driver.cursor(conn) as cur:
                return schema.inspect(cur, self._migration_names)

    def pending_migrations(self, extra_dirs: Sequence[str] = ()) -> list[str]:
        """The migrations this database has not applied (``flask idempotency doctor``)."""
        names = [name for name, _ in migrations.all_migrations(extra_dirs)]
        with self.pool.connection() as conn, self.driver.cursor(conn) as cur:
            return migrations.pending(cur, names)

    def migrate(self, extra_dirs: Sequence[str] = ()) -> list[str]:
        found = migrations.all_migrations(extra_dirs)
        with self.pool.connection() as conn:
            applied = migrations.apply(conn, found)
        self.schema.migrated()
        return applied

    def close(self) -> None:
        with self._renew_lock:
            self.pool.close()

    # -- maintenance: the CLI's commands -----------------------------------------

    def _run(self, statement: str, params: Any = None) -> tuple[int, list[tuple[Any, ...]]]:
        """``sql`` as one implicit transaction, under the store's timeouts (sent in
        the same round trip) and the watchdog's deadline: the number of rows it
        touched, and those it returned."""
        with self.pool.connection() as conn:
            with watched(conn, self.deadline), self.driver.cursor(conn) as cur:
                self.driver.execute(cur, self.statements.timeouts + statement, params)
                return cur.rowcount, cur.fetchall() if cur.description is not None else []

    def _figures(self, statement: str, names: str) -> dict[str, float]:
        """The one row of ``sql``, as floats under ``names`` (space-separated)."""
        return dict(zip(names.split(), map(float, self.read(statement)[0]), strict=True))

    def count_expired(self) -> int:
        return int(self.read(diagnostics.EXPIRED_RECORDS)[0][0])

    def purge(self, batch_size: int) -> Iterator[list[bytes]]:
        """Delete expired rows a batch at a time (each its own transaction), yielding
        the deleted keys so a cache can evict them too."""
        while True:
            keys = [bytes(r[0]) for r in self.read(sql.PURGE_BATCH, (batch_size,))]
            if keys:
                yield keys
            if len(keys) < batch_size:
                return

    def info(self, record_key: bytes) -> RecordInfo | None:
        rows = self.read(sql.INFO, (record_key,))
        if not rows:
            return None
        state, created, expires, completed, lease, status, body, headers, age, expired = rows[0]
        body = None if body is None else bytes(body)
        headers = sql.headers_from_json(headers)
        return RecordInfo(
            state, created, expires, completed, lease, status, body, headers, float(age), expired
        )

    def stats(self) -> dict[str, float]:
        names = "processing completed expired lease_expired oldest_processing_seconds takeovers"
        return self._figures(sql.STATS, names)

    def unlock(self, record_key: bytes) -> bool:
        return self._run(sql.UNLOCK, (record_key,))[0] > 0

    # -- the completer (``completer.py``) ----------------------------------------

    def recovery_cutoff(self, older_than: float) -> Any:
        """The server's ``now() - older_than``: a pass recovers what was abandoned
        before it (measured on one clock, the database's)."""
        return self.read(sql.PASS_CUTOFF, (older_than,))[0][0]

    def take_over(self, cutoff: Any, limit: int, lease: float) -> list[Taken]:
        """Take up to ``limit`` records abandoned before ``cutoff`` over, each under
        a new lock token and a fresh ``lease``, committed at once."""
        params = {
            "cutoff": cutoff,
            "limit": limit,
            "tokens": [sql.new_token() for _ in range(limit)],
            "lease": lease,
        }
        return [
            Taken(
                bytes(key),
                bytes(fp),
                int(token),
                bytes(recovery),
                phases_of(phases),
                max(0.0, float(s)),
            )
            for key, fp, token, recovery, phases, s in self.read(sql.TAKE_OVER, params)
        ]

    def hand_back(self, record_key: bytes, token: int) -> bool:
        """End our lease on a record at once, keeping it ("cannot tell yet"); False
        if it is no longer ours."""
        return self._run(sql.END_LEASE, (record_key, token))[0] == 1

    def release_abandoned(self, record_key: bytes, token: int, *, keep_phases: bool) -> bool:
        """ "Nothing happened": delete the record (or, with committed recovery points,
        give it back to its client) and count the release; False if no longer ours."""
        statement = sql.RELEASE_TO_CLIENT if keep_phases else sql.RELEASE
        with self.pool.connection() as conn, watched(conn, self.deadline):
            # (A failure leaves the transaction open: the pool rolls it back.)
            with self.driver.cursor(conn) as cur:
                text = "BEGIN;\n" + self.statements.timeouts + statement
                self.driver.execute(cur, text, (record_key, token))
                released: bool = cur.rowcount == 1
                if released:
                    cur.execute(sql.BUMP_RECOVERY_TOTAL, ("released",))
                cur.execute("COMMIT")
        return released

    def recovery_stats(self) -> dict[str, float]:
        """Abandoned records now (``abandoned``: processing, lease ended, not taken
        over; ``recoverable``: those of ``recover=`` routes; how long the oldest has
        waited) and the completer's totals (``recovered``, ``recovery_released``)."""
        names = "abandoned recoverable oldest_abandoned_seconds recovered recovery_released"
        return self._figures(sql.RECOVERY_STATS, names)

    # -- the consumer guard (``events/consumer.py``) ------------------------------

    def attempts_so_far(self, record_key: bytes, token: int) -> int | None:
        """Earlier attempts at a message we hold (its takeovers); ``None`` if the
        record is no longer ours."""
        rows = self.read(sql.ATTEMPTS_SO_FAR, (record_key, token))
        return int(rows[0][0]) if rows else None

    #: End a failed attempt's lease now and keep the record, so the next delivery
    #: takes it over (and ``takeovers`` counts one more attempt).
    fail_attempt = hand_back

    def release_claim(self, record_key: bytes, token: int) -> None:
        """Delete a record we hold, so the next delivery starts afresh."""
        self._run(sql.RELEASE, (record_key, token))

    # -- the background workers' heartbeats (``heartbeat.py``) and the doctor --------

    def heartbeat(self, worker: str, seen_on: str) -> None:
        """Record that a ``worker`` (``"relay"``, ``"completer"``) ran just now."""
        self._run(sql.HEARTBEAT, (worker, seen_on))

    def last_runs(self) -> dict[str, tuple[float, str | None]]:
        """Seconds since each kind of worker last reported (the server's clock), and
        the ``host:pid`` that did."""
        return {worker: (float(ago), seen_on) for worker, ago, seen_on in self.read(sql.LAST_RUNS)}

    def read(self, statement: str, params: Any = None) -> list[tuple[Any, ...]]:
        """The rows ``statement`` returns, under the store's timeouts and deadline
        (also ``flask idempotency doctor``'s look at the server's settings and
        statistics)."""
        return self._run(statement, params)[1]
