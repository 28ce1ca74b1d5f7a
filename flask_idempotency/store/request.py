"""One request's connection, from claim to completion or release.

Two claim modes, one class each, chosen by ``IDEMPOTENCY_CLAIM_MODE``:
:class:`RowClaimRequest` commits a processing row of its own and holds it with
a lease; :class:`TransactionClaimRequest` opens the business transaction with
the claim, under advisory locks, and its COMMIT inserts the completed record.
Everything else (the view's transaction, the completion's fencing, the
release, recovery points) is :class:`PostgresRequest`'s. Every statement goes
through ``runner.run`` (deadline, breaker, "unreachable"), and its text is
``sql.Statements``' one for the operation.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any, Protocol

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
from .pool import Checkout, Connection, EnginePool
from .runner import Outcome, run
from .schema import mismatch
from .sql import (
    BUMP_RECOVERY_TOTAL,
    LEASE_LOST_SQLSTATE,
    UNIQUE_VIOLATION,
    Statements,
    advisory_locks,
    headers_from_json,
    new_token,
    response_params,
)


class RequestStore(Protocol):
    """What a request's handle uses of its store (``postgres.PostgresStore``)."""

    pool: EnginePool
    driver: Driver
    #: Seconds before the watchdog gives up on one of our statements.
    deadline: float
    #: Opened by failures that mean PostgreSQL is not answering; requests then 503 at once.
    breaker: StoreBreaker
    #: The store's statements, one text per operation (``sql.Statements``).
    statements: Statements


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

    def __init__(self, store: RequestStore, *, guarded: bool = True) -> None:
        self._store = store
        #: The store's breaker, which this handle's statements report to and which
        #: refuses it at once while open; ``None`` for the application's own
        #: transactions outside idempotent routes (``PostgresStore.transaction``).
        self._breaker = store.breaker if guarded else None
        self._conn: Connection | None = None
        #: One of our statements got no answer before its deadline: PostgreSQL is
        #: not answering, so the release does not wait on a new connection too.
        self._unresponsive = False
        #: A transaction-mode claim's request, kept for the completed record.
        self._claimed: tuple[bytes, float] | None = None

    def _acquire(self, until: float | None = None) -> Connection:
        """This request's connection, taken from the pool if it has none: at once
        ``StoreUnavailableError`` while the store's breaker is open, and a connect it
        needs ends by ``until`` (monotonic clock; the store's deadline from now)."""
        if self._conn is None:
            breaker = self._breaker
            if breaker is None:
                self._conn = self._store.pool.getconn()
                return self._conn
            openings = breaker.admit()
            terms = Checkout(
                until if until is not None else time.monotonic() + self._store.deadline,
                functools.partial(breaker.opened_since, openings),
            )
            try:
                self._conn = self._store.pool.getconn(terms)
            except StoreUnavailableError as exc:
                if isinstance(exc.__cause__, driver.ERRORS):  # a connect that failed
                    breaker.failed(type(exc.__cause__).__name__)
                raise
        return self._conn

    def _seconds_left(self, until: float) -> float:
        """What is left of the claim's deadline for its statement."""
        left = until - time.monotonic()
        if left <= 0:
            raise StoreUnavailableError("the claim's deadline passed before it was sent")
        return min(self._store.deadline, left)

    def _run_claim(self, sql: str, params: Any) -> Any:
        """The claim's statement under one deadline for everything it waits on (the
        pool, a connect, the statement), once more on a fresh connection when a pooled
        one turns out dead (a restart): the statement never reached the server then."""
        until = time.monotonic() + self._store.deadline
        retried = False
        while True:
            conn = self._acquire(until)
            try:
                return self._execute(
                    conn,
                    sql,
                    params,
                    fetch=True,
                    seconds=self._seconds_left(until),
                    retried_if_lost=not retried,
                )
            except driver.ERRORS as exc:
                unreachable = self._lost(exc)
                if unreachable:
                    self._drop()
                if unreachable and not retried and not self._unresponsive:
                    retried = True
                    continue
                if unreachable:
                    raise StoreUnavailableError(f"claim failed: {type(exc).__name__}") from exc
                # The server answered (a statement or lock timeout, a missing table):
                # the connection is sound and goes back to the pool with the request.
                raise answered("claim", exc) from exc

    def held(self) -> Connection:
        """This request's connection (taken from the pool if it has none yet),
        whatever its transaction state; nothing is sent."""
        return self._acquire()

    def _drop(self, *, peers: bool = True) -> None:
        """Give back a connection that failed: it is not reused, nor (when the
        database looks unreachable) are its idle peers."""
        conn, self._conn = self._conn, None
        self._in_transaction = False
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
        """Run one of the extension's own statements (``runner.run``) within
        ``seconds`` (the store's deadline if not given); a statement the watchdog
        cut marks the request unresponsive."""
        deadline = self._store.deadline if seconds is None else seconds
        outcome = Outcome()
        try:
            return run(
                conn,
                self._store.driver,
                sql,
                params,
                deadline=deadline,
                breaker=self._breaker,
                fetch=fetch,
                # Cut after less than half the deadline (the claim's time went on
                # waiting for a connection): too little said about the server.
                counts=deadline >= self._store.deadline / 2,
                retried_if_lost=retried_if_lost,
                outcome=outcome,
            )
        finally:
            if outcome.fired:
                self._unresponsive = True

    def _lost(self, exc: BaseException) -> bool:
        """Whether ``exc`` on this request's connection means it is gone."""
        return self._unresponsive or is_unreachable(exc, self._conn)

    def connection(self) -> Connection:
        """The connection, in this request's transaction (opened now if it is not)."""
        if self._in_transaction:
            return self._acquire()
        # Nothing of this request's transaction exists yet, so a pooled connection
        # that died while idle (a keyless request's first statement after a restart)
        # is retried once on a fresh one, as the claim is.
        conn = self._acquire()
        if not self._begin(conn, retried_if_lost=True):
            self._begin(self._acquire(), retried_if_lost=False)
        return self._acquire()

    def _begin(self, conn: Connection, *, retried_if_lost: bool) -> bool:
        """Send ``BEGIN`` on ``conn``: True once sent; False if ``retried_if_lost`` and
        the connection turned out lost (dropped: the caller retries on a fresh one);
        ``StoreUnavailableError`` otherwise."""
        try:
            self._execute(conn, "BEGIN", retried_if_lost=retried_if_lost)
        except driver.ERRORS as exc:
            unreachable = self._lost(exc)
            self._drop(peers=unreachable)
            if unreachable and retried_if_lost and not self._unresponsive:
                return False
            raise StoreUnavailableError(f"BEGIN failed: {type(exc).__name__}") from exc
        self._in_transaction = True
        return True

    def complete(self, record_key: bytes, token: int, response: StoredResponse) -> None:
        """Store ``response`` and commit, with the view's transaction if it opened one,
        in one round trip; ``LeaseLostError`` if the record was taken over."""
        conn = self._acquire()
        answer = response_params(response)
        statements = self._store.statements
        params: tuple[Any, ...]
        if self._claimed is not None:
            fingerprint, ttl = self._claimed
            sql, params = statements.insert_completed, (record_key, fingerprint, ttl, *answer)
        else:
            sql, params = statements.complete, (record_key, token, *answer)
        if not self._in_transaction:
            sql = "BEGIN;\n" + sql  # (its COMMIT must end a transaction)
        try:
            self._execute(conn, sql, params)
        except driver.ERRORS as exc:
            if self._lost(exc):
                self._drop()
                raise StoreUnavailableError(f"completion failed: {type(exc).__name__}") from exc
            self._rollback()
            if sqlstate(exc) == LEASE_LOST_SQLSTATE:
                raise LeaseLostError() from exc
            raise answered("completion", exc) from exc
        self._in_transaction = False
        self._claimed = None

    def checkpoint(self, record_key: bytes, token: int, phase: str, data_json: str) -> None:
        """Commit the view's transaction so far together with the recovery point
        ``phase`` (row mode), in one round trip; ``LeaseLostError`` if the record was
        taken over (the transaction is rolled back). A view that had a transaction
        open gets a new one in the same round trip, so a connection it fetched
        before the phase never drops into autocommit."""
        conn = self._acquire()
        sql = self._store.statements.checkpoint
        if not self._in_transaction:
            sql = "BEGIN;\n" + sql
        self._in_transaction = True
        try:
            self._execute(conn, sql, (record_key, token, phase, data_json))
        except driver.ERRORS as exc:
            if self._lost(exc):
                self._drop()
                raise StoreUnavailableError(f"checkpoint failed: {type(exc).__name__}") from exc
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
        if self._conn is None or not self._in_transaction:
            return
        try:
            self._execute(self._conn, "ROLLBACK")
            self._in_transaction = False
        except driver.ERRORS as exc:
            self._drop(peers=self._lost(exc))

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
        if self._conn is not None and self._conn.closed:
            # Lost under the view (its session is gone, and with it the transaction):
            # the release goes on a fresh connection.
            self._drop(peers=False)
        statements = self._store.statements
        sql = statements.end_lease if self.has_progress else statements.release
        if self._in_transaction:
            sql = "ROLLBACK;\n" + sql
        try:
            conn = self._acquire()
            self._execute(conn, sql, (record_key, token))
            self._in_transaction = False
        except (*driver.ERRORS, StoreUnavailableError) as exc:  # type: ignore[misc]
            log.warning(
                "idempotency: release failed (%s); the lease will expire", type(exc).__name__
            )
            unreachable = not isinstance(exc, driver.ERRORS) or self._lost(exc)
            self._drop(peers=unreachable)

    def rollback(self) -> None:
        """Roll back the view's transaction, if it opened one (keyless requests)."""
        self._rollback()

    def commit(self) -> None:
        """Commit the view's transaction on a keyless request; ``StoreUnavailableError``
        if the database went away, the driver's own error for anything else (a
        deferred constraint is the application's error, not an outage)."""
        if not self._in_transaction or self._conn is None:
            return
        try:
            self._execute(self._conn, "COMMIT")
        except driver.ERRORS as exc:
            if self._lost(exc):
                self._drop()
                raise StoreUnavailableError(f"COMMIT failed: {type(exc).__name__}") from exc
            self._rollback()
            raise
        self._in_transaction = False

    def close(self) -> None:
        if self._conn is not None:
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
        kept with a row-mode claim for ``flask idempotency recover`` (``recovery.py``)."""
        token = new_token()
        params = {
            "key": record_key,
            "fp": fingerprint,
            "token": token,
            "lease": lease,
            "ttl": ttl,
            "recovery": recovery,
        }
        for _ in range(6):
            try:
                row = self._run_claim(self._store.statements.claim, params)
            except StoreUnavailableError as exc:
                if sqlstate(exc.__cause__ or exc) != UNIQUE_VIOLATION:
                    raise
                continue  # claimed by another between the claim's read and its INSERT
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
        self._rollback()  # a waiting duplicate's earlier try
        request_lock, key_lock = advisory_locks(record_key, fingerprint)
        try:
            row = self._run_claim(
                self._store.statements.claim_in_transaction, (record_key, request_lock, key_lock)
            )
        except StoreUnavailableError:
            if self._conn is not None:
                self._in_transaction = True  # (its BEGIN ran: roll it back on close)
            raise
        self._in_transaction = True
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
