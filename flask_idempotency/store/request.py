"""One request's connection, from claim to completion or release.

Two claim modes, one class each, chosen by ``IDEMPOTENCY_CLAIM_MODE``:
:class:`RowClaimRequest` commits a processing row of its own and holds it with
a lease; :class:`TransactionClaimRequest` opens the business transaction with
the claim, under advisory locks, and its COMMIT inserts the completed record.
Everything else (the view's transaction, the completion's fencing, the
release, recovery points) is :class:`PostgresRequest`'s.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any, Protocol

import psycopg2
import psycopg2.pool

from . import driver
from .base import (
    Claimed,
    ClaimResult,
    Existing,
    LeaseLostError,
    StoredResponse,
    StoreUnavailableError,
)
from .breaker import StoreBreaker
from .driver import Driver, sqlstate
from .errors import is_unreachable
from .handle import RequestHandle
from .pool import Checkout, Connection, NoAnswerError, Pool
from .schema import mismatch
from .sql import (
    BUMP_RECOVERY_TOTAL,
    CHECKPOINT,
    END_LEASE,
    LEASE_LOST_SQLSTATE,
    PREPARED_STATEMENT_EXISTS,
    PREPARED_STATEMENT_MISSING,
    RELEASE,
    advisory_locks,
    headers_from_json,
    new_token,
    response_params,
)
from .watchdog import WATCHDOG


class RequestStore(Protocol):
    """What a request's handle uses of its store (``postgres.PostgresStore``)."""

    pool: Pool
    driver: Driver
    #: The claim and the completion are prepared once per connection.
    prepare_statements: bool
    #: Completions run prepared (until a session lost its prepared statements).
    prepared_completion: bool
    #: ``SET LOCAL`` of the statement and lock timeouts, first in each round trip.
    timeouts: str
    #: Seconds before the watchdog gives up on one of our statements.
    deadline: float
    complete_alone: str
    complete_in_transaction: str
    complete_prepared_alone: str
    complete_prepared_in_transaction: str
    insert_completed: str
    insert_completed_prepared: str
    #: Opened by failures that mean PostgreSQL is not answering; requests then 503 at once.
    breaker: StoreBreaker

    def claim_sql(self, conn: Connection, *, new_key: bool = False) -> str: ...

    def claim_in_transaction_sql(self, conn: Connection) -> str: ...

    def forget_prepared(self, conn: Connection) -> None: ...


log = logging.getLogger("flask_idempotency.store")


def answered(what: str, exc: BaseException) -> StoreUnavailableError:
    """A statement the server answered with an error: a missing table, column or
    function is a ``SchemaMismatchError`` (a skipped migrate, named as such), any
    other a ``StoreUnavailableError``; the request fails closed either way."""
    return mismatch(exc) or StoreUnavailableError(f"{what} failed: {type(exc).__name__}")


class PostgresRequest(RequestHandle):
    """One request's connection, from claim to completion or release.

    The connection is in autocommit mode; when the view asks for it, an explicit
    ``BEGIN`` opens the business transaction, which the completion commits. The
    view cannot commit early by accident: psycopg2's ``commit()`` is a no-op in
    autocommit mode.
    """

    def __init__(self, store: RequestStore) -> None:
        self._store = store
        self._conn: Connection | None = None
        #: One of our statements got no answer before its deadline: PostgreSQL is
        #: not answering, so the release does not wait on a new connection too.
        self._unresponsive = False
        #: A transaction-mode claim's request, kept for the completed record.
        self._claimed: tuple[bytes, float] | None = None
        #: Statements that open the next stretch of the transaction (its ``BEGIN``,
        #: a joined session's savepoint), sent ahead of whatever goes next, in its
        #: round trip (``defer``).
        self._deferred: str | None = None
        #: The connection this request's claim ran prepared statements on: it has the
        #: completion prepared too (``sql.PREPARE_CLAIM``).
        self._prepared_conn: Connection | None = None

    def _acquire(self, until: float | None = None) -> Connection:
        """This request's connection, taken from the pool if it has none: at once
        ``StoreUnavailableError`` while the store's breaker is open, and by ``until``
        (monotonic clock) if given."""
        if self._conn is None:
            breaker = self._store.breaker
            openings = breaker.admit()
            checkout = Checkout(until, functools.partial(breaker.opened_since, openings))
            try:
                self._conn = self._store.pool.getconn(checkout)
            except StoreUnavailableError as exc:
                if isinstance(exc, NoAnswerError):
                    breaker.failed("no answer to the connect before the deadline")
                elif _connect_failed(exc):
                    breaker.failed(type(exc.__cause__).__name__)
                raise
        return self._conn

    def _claim_deadline(self) -> float:
        """When a claim starting now must have its answer (monotonic clock): a claim
        has one deadline for everything it waits on, the pool, a connect and its
        statement, so a frozen server cannot make it wait several."""
        return time.monotonic() + self._store.deadline

    def _seconds_left(self, until: float) -> float:
        """What is left of the claim's deadline for its statement."""
        left = until - time.monotonic()
        if left <= 0:
            raise StoreUnavailableError("the claim's deadline passed before it was sent")
        return min(self._store.deadline, left)

    def execute_in_transaction(self, sql: str, *, begin: bool = False) -> None:
        """Run ``sql`` (a joined session's savepoint statement) in this request's
        transaction; with ``begin``, open the transaction first if the view has not,
        in the same round trip. A failure to reach PostgreSQL is a
        ``StoreUnavailableError``; any other error is the driver's."""
        conn = self._acquire()
        opening = begin and not self._in_transaction
        try:
            if opening and sql != "BEGIN":
                sql = "BEGIN;\n" + sql
            self._execute(conn, sql)
        except driver.ERRORS as exc:
            if self._unresponsive or is_unreachable(exc, conn):
                self._drop()
                raise StoreUnavailableError(f"savepoint failed: {type(exc).__name__}") from exc
            raise
        if opening:
            self._in_transaction = True

    def defer(self, sql: str) -> None:
        """Send ``sql`` ahead of this request's next statement, in the same round
        trip: a joined session's ``BEGIN`` or savepoint costs no round trip of its
        own. ``BEGIN`` opens the transaction from now on, as far as this request's
        bookkeeping goes (what is sent next runs in it)."""
        if sql == "BEGIN":
            if self._in_transaction:
                return
            self._in_transaction = True
        self._deferred = sql if self._deferred is None else f"{self._deferred};\n{sql}"

    @property
    def has_deferred(self) -> bool:
        """Whether a deferred statement waits: nothing was sent since it was deferred."""
        return self._deferred is not None

    def take_deferred(self) -> str | None:
        """The deferred statements, for a caller that sends them (prefixed to its own
        statement on the same connection); they are no longer this request's to send."""
        deferred, self._deferred = self._deferred, None
        return deferred

    def held_connection(self) -> Connection:
        """The connection this request works on (taken from the pool if it has none
        yet), whatever its transaction state: for joining a session to it."""
        return self._acquire()

    def _drop(self, *, peers: bool = True) -> None:
        """Give back a connection that failed: it is not reused, nor (when the
        database looks unreachable) are its idle peers."""
        conn, self._conn = self._conn, None
        self._in_transaction = False
        self._deferred = None
        self._prepared_conn = None
        if conn is not None:
            self._store.pool.putconn(conn, discard=True)
        if peers:
            self._store.pool.discard_idle()

    def _execute(
        self,
        conn: Connection,
        sql: str,
        params: Any = None,
        *,
        fetch: bool = False,
        seconds: float | None = None,
        retried_if_lost: bool = False,
    ) -> Any:
        """Run one of the extension's own statements under the client-side deadline
        (``seconds``, if less); the first row if ``fetch``. Raises the driver's
        errors; a statement the watchdog had to cut off raises ``OperationalError``
        and marks the request unresponsive. The outcome is the store breaker's,
        except a lost connection the caller retries on a fresh one
        (``retried_if_lost``): a pooled connection that died while idle (a restart,
        a healed partition) says nothing about the server now, and a burst of
        requests on a pool full of them would open the breaker on a server that is
        up. The retry's connect or statement counts instead."""
        if self._deferred is not None:
            sql = f"{self._deferred};\n{sql}"
            self._deferred = None
        deadline = self._store.deadline if seconds is None else seconds
        breaker = self._store.breaker
        # A statement cut after less than half the deadline (the claim's time went
        # on waiting for a connection) says too little about the server to count.
        full = deadline >= self._store.deadline / 2
        ticket = WATCHDOG.watch(conn, deadline, breaker.no_answer if full else None)
        error: BaseException | None = None
        try:
            driver = self._store.driver
            with driver.cursor(conn) as cur:
                driver.execute(cur, sql, params)
                row = cur.fetchone() if fetch else None
        except BaseException as exc:
            error = exc
            raise
        finally:
            fired = WATCHDOG.unwatch(ticket)
            if fired:
                self._unresponsive = True
            breaker.outcome(conn, error, fired=fired, retried_if_lost=retried_if_lost)
        if fired:  # answered as the socket was shut down: the connection is gone anyway
            raise psycopg2.OperationalError("no answer from PostgreSQL before the deadline")
        return row

    def connection(self) -> Connection:
        """The connection, in this request's transaction (opened now if it is not,
        and anything deferred sent first: the caller's own cursor comes next)."""
        if self._in_transaction:
            conn = self._acquire()
            opening = self.take_deferred()
            if opening is not None:
                self._open(conn, opening, retried_if_lost=False)
            return conn
        # Nothing of this request's transaction exists yet, so a pooled connection
        # that died while idle (a keyless request's first statement after a restart)
        # is retried once on a fresh one, as the claim is.
        conn = self._acquire()
        if not self._open(conn, "BEGIN", retried_if_lost=True):
            conn = self._acquire()
            self._open(conn, "BEGIN", retried_if_lost=False)
        return conn

    def _open(self, conn: Connection, opening: str, *, retried_if_lost: bool) -> bool:
        """Send what opens the view's transaction (or its next stretch) on ``conn``:
        True once sent; False if ``retried_if_lost`` and the connection turned out
        lost (dropped: the caller retries on a fresh one); ``StoreUnavailableError``
        otherwise."""
        try:
            self._execute(conn, opening, retried_if_lost=retried_if_lost)
        except driver.ERRORS as exc:
            unreachable = self._unresponsive or is_unreachable(exc, conn)
            self._drop(peers=unreachable)
            if unreachable and retried_if_lost and not self._unresponsive:
                return False
            raise StoreUnavailableError(f"BEGIN failed: {type(exc).__name__}") from exc
        self._in_transaction = True
        return True

    def complete(self, record_key: bytes, token: int, response: StoredResponse) -> None:
        conn = self._acquire()
        # The timeouts come after the view's last statement, in the same round trip.
        answer = response_params(response)
        sql_params: tuple[Any, ...]
        if self._claimed is not None:
            fingerprint, ttl = self._claimed
            sql_params = (record_key, fingerprint, ttl, *answer)
        else:
            sql_params = (record_key, token, *answer)
        sql = self._completion_sql(conn)
        try:
            self._execute(conn, sql, sql_params)
        except driver.ERRORS as exc:
            if self._unresponsive or is_unreachable(exc, conn):
                self._drop()
                raise StoreUnavailableError(f"completion failed: {type(exc).__name__}") from exc
            if self._in_transaction:
                self._rollback()
            if sqlstate(exc) == LEASE_LOST_SQLSTATE:
                raise LeaseLostError() from exc
            if sqlstate(exc) == PREPARED_STATEMENT_MISSING:
                # Deallocated while the view ran (DISCARD ALL in the view, or a pooler
                # that moved the session): the view's transaction is gone with it, so
                # this request fails closed; the connection's next claim prepares again.
                self._store.forget_prepared(conn)
            raise answered("completion", exc) from exc
        self._in_transaction = False
        self._claimed = None

    def _ran_prepared_on(self, conn: Connection) -> None:
        """The claim ran prepared on ``conn``, which so has the completion prepared
        too: the completion may run prepared there, unless the driver may deallocate
        it while the view runs (psycopg 3 preparing queries of its own)."""
        store = self._store
        if store.prepare_statements and store.driver.keeps_prepared(conn):
            self._prepared_conn = conn

    def _completion_sql(self, conn: Connection) -> str:
        """The completion for this request's claim mode and transaction: prepared on
        the connection its claim ran prepared on (the claim prepared it there), as a
        function call elsewhere (a connection replaced since, or none prepared)."""
        store = self._store
        prepared = conn is self._prepared_conn and store.prepared_completion
        if self._claimed is not None:
            return store.insert_completed_prepared if prepared else store.insert_completed
        if self._in_transaction:
            if prepared:
                return store.complete_prepared_in_transaction
            return store.complete_in_transaction
        return store.complete_prepared_alone if prepared else store.complete_alone

    def checkpoint(self, record_key: bytes, token: int, phase: str, data_json: str) -> None:
        """Commit the view's transaction so far together with the recovery point
        ``phase`` (row mode), in one round trip; ``LeaseLostError`` if the record was
        taken over (the transaction is rolled back). A view that had a transaction
        open gets a new one in the same round trip, so a connection it fetched
        before the phase never drops into autocommit."""
        conn = self._acquire()
        reopen = self._in_transaction
        sql = self._store.timeouts + CHECKPOINT
        if reopen:
            sql += ";\nCOMMIT;\nBEGIN"
        try:
            self._execute(conn, sql, (record_key, token, phase, data_json))
        except driver.ERRORS as exc:
            if self._unresponsive or is_unreachable(exc, conn):
                self._drop()
                raise StoreUnavailableError(f"checkpoint failed: {type(exc).__name__}") from exc
            if self._in_transaction:
                self._rollback()
            if sqlstate(exc) == LEASE_LOST_SQLSTATE:
                raise LeaseLostError() from exc
            raise answered("checkpoint", exc) from exc
        self.has_progress = True

    def count_recovered(self) -> None:
        """Count one more recovered record in this request's transaction (the
        completer's total commits with the recovered answer, or not at all)."""
        conn = self.connection()
        with conn.cursor() as cur:
            cur.execute(BUMP_RECOVERY_TOTAL, ("recovered",))

    def _rollback(self) -> None:
        if self._conn is None:
            return
        if self._deferred is not None and self._deferred.startswith("BEGIN"):
            # The transaction never reached the server: nothing to roll back.
            self._deferred = None
            self._in_transaction = False
            return
        try:
            self._execute(self._conn, "ROLLBACK")
            self._in_transaction = False
        except driver.ERRORS as exc:
            self._drop(peers=self._unresponsive or is_unreachable(exc, self._conn))

    def release(self, record_key: bytes, token: int) -> None:
        """Roll back the view's writes and delete our claim, so a retry runs again.
        A record with committed recovery points is kept instead, its lease ended,
        so the retry resumes after them (``END_LEASE``).

        Best effort: if the database is gone the claim expires with its lease. After
        a statement of this request got no answer at all, no new connection is
        tried (it would only wait out the connect timeout).
        """
        if self._unresponsive:
            log.warning("idempotency: PostgreSQL not answering; the claim is left to expire")
            self._drop()
            return
        if self._claimed is not None:
            # Nothing was written but in this transaction: its rollback is the release.
            self._claimed = None
            self._rollback()
            return
        release = self._store.timeouts + (END_LEASE if self.has_progress else RELEASE)
        sql = ("ROLLBACK;\n" + release) if self._in_transaction else release
        try:
            conn = self._acquire()
            self._execute(conn, sql, (record_key, token))
            self._in_transaction = False
        except (*driver.ERRORS, StoreUnavailableError) as exc:  # type: ignore[misc]
            log.warning(
                "idempotency: release failed (%s); the lease will expire", type(exc).__name__
            )
            unreachable = not isinstance(exc, driver.ERRORS) or is_unreachable(exc, self._conn)
            self._drop(peers=self._unresponsive or unreachable)

    def rollback(self) -> None:
        """Roll back the view's transaction, if it opened one (keyless requests)."""
        if self._in_transaction:
            self._rollback()

    def commit(self) -> None:
        """Commit the view's transaction on a keyless request; ``StoreUnavailableError``
        if the database went away, the driver's own error for anything else (a
        deferred constraint is the application's error, not an outage)."""
        if not self._in_transaction or self._conn is None:
            return
        deferred = self.take_deferred()
        try:
            with self._conn.cursor() as cur:
                cur.execute("COMMIT" if deferred is None else f"{deferred};\nCOMMIT")
        except driver.ERRORS as exc:
            if is_unreachable(exc, self._conn):
                self._drop()
                raise StoreUnavailableError(f"COMMIT failed: {type(exc).__name__}") from exc
            self._rollback()
            raise
        self._in_transaction = False

    def close(self) -> None:
        if self._conn is not None:
            if self._in_transaction:
                self._rollback()
            conn, self._conn = self._conn, None
            if conn is not None:
                self._store.pool.putconn(conn, discard=bool(conn.closed))


class RowClaimRequest(PostgresRequest):
    """Row mode: the claim is a ``processing`` row committed on its own (one
    statement), kept alive by the lease keeper (``holds_lease``, as every handle's
    default); the completion fills it in."""

    def claim(
        self,
        record_key: bytes,
        fingerprint: bytes,
        *,
        lease: float,
        ttl: float,
        recovery: bytes | None = None,
    ) -> ClaimResult:
        """Claim ``record_key`` for this request, or read who has it. ``recovery`` is
        kept with a row-mode claim for ``flask idempotency recover`` (``recovery.py``);
        a transaction-mode claim leaves nothing behind a dead holder to recover."""
        token = new_token()
        params = {
            "key": record_key,
            "fp": fingerprint,
            "token": token,
            "lease": lease,
            "ttl": ttl,
            "recovery": recovery,
        }
        retried_connection = retried_prepare = False
        until = self._claim_deadline()
        # The first try is the cheaper claim that takes a new key or reads a held one
        # (``sql.CLAIM_NEW_BODY``); only a record to take over needs the full claim.
        new_key = True
        for _ in range(6):
            conn = self._acquire(until)
            seconds = self._seconds_left(until)
            try:
                row = self._execute(
                    conn,
                    self._store.claim_sql(conn, new_key=new_key),
                    params,
                    fetch=True,
                    seconds=seconds,
                    retried_if_lost=not retried_connection,
                )
            except driver.ERRORS as exc:
                if self._unresponsive:
                    self._drop()
                    raise StoreUnavailableError("claim failed: PostgreSQL did not answer") from exc
                if is_unreachable(exc, conn):
                    self._drop()
                    # A pooled connection may be stale after a server restart: one retry
                    # on a fresh connection. The statement never reached the server then.
                    if not retried_connection:
                        retried_connection = True
                        continue
                    raise StoreUnavailableError(f"claim failed: {type(exc).__name__}") from exc
                if sqlstate(exc) == PREPARED_STATEMENT_MISSING and not retried_prepare:
                    retried_prepare = True
                    self._store.forget_prepared(conn)
                    continue  # deallocated under us (DISCARD ALL): prepare it again
                if sqlstate(exc) == PREPARED_STATEMENT_EXISTS and not retried_prepare:
                    retried_prepare = True
                    continue  # already prepared on this session: now known, execute it
                # The server answered (a statement or lock timeout, a missing table):
                # the connection is sound and goes back to the pool with the request.
                raise answered("claim", exc) from exc
            self._ran_prepared_on(conn)
            if new_key:
                new_key = False
                if row is not None and (row[0] or not _could_take_over(row, fingerprint)):
                    return Claimed(token) if row[0] else _existing(row)
                continue  # a row to take over, or none read: the full claim decides
            if row is None:
                continue  # the row appeared or vanished concurrently; look again
            if row[0]:
                phases = tuple((str(name), data) for name, data in row[8] or ())
                self.has_progress = bool(phases)
                return Claimed(token, phases, takeover=bool(row[9]))
            return _existing(row)
        raise StoreUnavailableError("claim did not settle after repeated concurrent changes")


class TransactionClaimRequest(PostgresRequest):
    """Transaction mode: the business transaction opens with the claim (one round
    trip, two advisory locks); no processing row and no lease."""

    holds_lease = False

    def claim(
        self,
        record_key: bytes,
        fingerprint: bytes,
        *,
        lease: float,
        ttl: float,
        recovery: bytes | None = None,
    ) -> ClaimResult:
        """Open the business transaction with the claim: ``Claimed`` leaves it open
        for the view; any other answer is for the caller to ``close()``."""
        if self._in_transaction:
            self._rollback()  # a waiting duplicate's earlier try
        request_lock, key_lock = advisory_locks(record_key, fingerprint)
        params = (record_key, request_lock, key_lock)
        until = self._claim_deadline()
        retried_connection = retried_prepare = False
        while True:
            conn = self._acquire(until)
            seconds = self._seconds_left(until)
            try:
                row = self._execute(
                    conn,
                    self._store.claim_in_transaction_sql(conn),
                    params,
                    fetch=True,
                    seconds=seconds,
                    retried_if_lost=not retried_connection,
                )
                break
            except driver.ERRORS as exc:
                unreachable = self._unresponsive or is_unreachable(exc, conn)
                if not unreachable and not retried_prepare and sqlstate(exc) in _PREPARE_STATES:
                    # Deallocated under us, or already there: the claim opened nothing
                    # yet, so it ends its failed transaction and goes again.
                    retried_prepare = True
                    self._rollback()
                    if sqlstate(exc) == PREPARED_STATEMENT_MISSING:
                        self._store.forget_prepared(conn)
                    continue
                self._drop(peers=unreachable)
                if unreachable and not retried_connection and not self._unresponsive:
                    retried_connection = True
                    continue  # a stale pooled connection: once more on a fresh one
                if unreachable:
                    raise StoreUnavailableError(f"claim failed: {type(exc).__name__}") from exc
                raise answered("claim", exc) from exc
        self._in_transaction = True
        self._ran_prepared_on(conn)
        if row is None:
            self._claimed = (fingerprint, ttl)
            return Claimed(new_token())  # names the attempt; the locks fence
        locked, same_request, state, stored_fingerprint = row[:4]
        if not locked:
            # Held by a live transaction: the same request (409), or another (422).
            return Existing("processing", fingerprint if same_request else b"", None)
        stored_fingerprint = bytes(stored_fingerprint)
        if state == "processing" and row[7] is not None and row[7] <= 0:
            if stored_fingerprint == fingerprint:
                # A dead row-mode holder of this request: the completion takes it over.
                self._claimed = (fingerprint, ttl)
                return Claimed(new_token())  # names the attempt; the locks fence
        response = None
        if state == "completed":
            response = StoredResponse(int(row[4]), headers_from_json(row[5]), bytes(row[6]))
        return Existing(state, stored_fingerprint, response, row[7], row[8])


#: A prepared statement missing, or one prepared twice: prepare (or execute) again.
_PREPARE_STATES = frozenset({PREPARED_STATEMENT_MISSING, PREPARED_STATEMENT_EXISTS})


def _could_take_over(row: tuple[Any, ...], fingerprint: bytes) -> bool:
    """Whether the record a row-mode claim read is one it may take: expired (as
    good as absent), or a processing record of the same request whose holder's
    lease ran out. ``sql.CLAIM_BODY``'s conditions, on the columns it returns."""
    state, stored_fingerprint, lease_remaining, ttl_remaining = row[1], row[2], row[6], row[7]
    if ttl_remaining is None or ttl_remaining <= 0:
        return True
    return (
        state == "processing"
        and lease_remaining is not None
        and lease_remaining <= 0
        and bytes(stored_fingerprint) == fingerprint
    )


def _existing(row: tuple[Any, ...]) -> Existing:
    """The record a row-mode claim found and may not take, from the claim's columns."""
    response = None
    if row[1] == "completed":
        response = StoredResponse(int(row[3]), headers_from_json(row[4]), bytes(row[5]))
    return Existing(
        state=row[1],
        fingerprint=bytes(row[2]),
        response=response,
        lease_remaining=row[6],
        ttl_remaining=row[7],
    )


def _connect_failed(exc: StoreUnavailableError) -> bool:
    """Whether a pool's ``StoreUnavailableError`` is a connect that failed (the
    driver's error), not a pool with no free connection or a breaker."""
    cause = exc.__cause__
    return isinstance(cause, driver.ERRORS) and not isinstance(cause, psycopg2.pool.PoolError)
