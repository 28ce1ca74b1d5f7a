"""One request's connection, from claim to completion or release.

Two claim modes, chosen by ``IDEMPOTENCY_CLAIM_MODE``: row mode commits a
processing row of its own and holds it with a lease; transaction mode opens the
business transaction with the claim, under advisory locks, and its COMMIT
inserts the completed record. Everything else (the view's transaction, the
completion's fencing, the release, recovery points) is shared. Every statement goes
through ``runner.watched`` (deadline, breaker, "unreachable"), and its text is
``sql.Statements``' one for the operation (a release: its timeouts and ``sql``'s
``RELEASE`` or ``END_LEASE``).
"""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import Any, Protocol

from . import driver, sql
from .base import (
    Claimed,
    ClaimResult,
    Existing,
    LeaseLostError,
    StoredResponse,
    StoreUnavailableError,
    phases_of,
)
from .breaker import StoreBreaker
from .driver import sqlstate
from .errors import is_unreachable
from .pool import Checkout, Connection, EnginePool
from .runner import NoAnswer, watched
from .schema import mismatch
from .sql import Statements


class RequestStore(Protocol):
    """What a request's handle uses of its store (``postgres.PostgresStore``)."""

    pool: EnginePool
    breaker: StoreBreaker
    statements: Statements
    #: Seconds before the watchdog gives up on one of our statements.
    deadline: float
    claim_mode: str


log = logging.getLogger("flask_idempotency.store")


def answered(what: str, exc: BaseException) -> StoreUnavailableError:
    """A statement the server answered with an error: a missing table, column or
    function is a ``SchemaMismatchError`` (a skipped migrate, named as such), any
    other a ``StoreUnavailableError``; the request fails closed either way."""
    return mismatch(exc) or StoreUnavailableError(f"{what} failed: {type(exc).__name__}")


class PostgresRequest:
    """One request's connection, from claim to completion or release.

    The connection is in autocommit mode; when the view asks for it, an explicit
    ``BEGIN`` opens the business transaction, which the completion commits. The
    view cannot commit early by accident: psycopg2's ``commit()`` is a no-op in
    autocommit mode.
    """

    def __init__(self, store: RequestStore, *, guarded: bool = True) -> None:
        self._store = store
        #: Row mode: the claim is a ``processing`` row committed on its own (one
        #: statement), kept alive by the lease keeper, which the completion fills in.
        #: Transaction mode (``holds_lease`` false): the claim opens the business
        #: transaction, under advisory locks, and its COMMIT inserts the record.
        self.holds_lease = store.claim_mode != "transaction"
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
        #: This request's transaction is open.
        self._in_transaction = False
        #: The record holds committed recovery points (claimed with them, or one
        #: committed since): a release keeps it for the next attempt to resume.
        self.has_progress = False

    def held(self, until: float | None = None) -> Connection:
        """This request's connection, taken from the pool if it has none, whatever its
        transaction state; nothing is sent. At once ``StoreUnavailableError`` while the
        store's breaker is open, and a connect it needs ends by ``until`` (monotonic
        clock; the store's deadline from now)."""
        breaker = self._breaker
        if self._conn is None:
            terms = None
            if breaker is not None:
                until = until or time.monotonic() + self._store.deadline
                terms = Checkout(until, partial(breaker.opened_since, breaker.admit()))
            try:
                self._conn = self._store.pool.getconn(terms)
            except StoreUnavailableError as exc:
                if breaker is not None and isinstance(exc.__cause__, driver.ERRORS):
                    breaker.failed(type(exc.__cause__).__name__)  # a connect that failed
                raise
        return self._conn

    def _send(
        self,
        what: str,
        statement: str,
        params: Any = None,
        *,
        retry: bool = False,
        bounded: bool = False,
        own: bool = False,
    ) -> Any:
        """Run one of the extension's statements on this request's connection
        (``runner.watched``: the deadline, the breaker); the first row of its result,
        if it has one (a claim's).

        ``retry``: nothing of this request's is on the connection yet, so a pooled
        one that turns out dead (a restart) is replaced once (the statement never
        reached the server). ``bounded`` (the claim): one deadline for everything it
        waits on, the pool, a connect and the statement. A lost connection is
        dropped (``StoreUnavailableError``); an error the server answered rolls the
        transaction back and is the driver's own error when it is the application's
        (``own``: a deferred constraint at ``COMMIT``), a ``LeaseLostError`` when a
        fenced statement (a completion, a recovery point) found the record taken
        over, else :func:`answered`.
        """
        until = time.monotonic() + self._store.deadline if bounded else None
        while True:
            conn = self.held(until)
            seconds = self._store.deadline
            if until is not None:
                seconds = min(seconds, until - time.monotonic())
                if seconds <= 0:
                    raise StoreUnavailableError("the claim's deadline passed before it was sent")
            # Cut after less than half the deadline (the claim's time went on waiting
            # for a connection), a statement says too little about the server to count.
            counts = seconds >= self._store.deadline / 2
            drv = self._store.pool.driver
            try:
                with (
                    watched(conn, seconds, self._breaker, counts=counts, retried_if_lost=retry),
                    drv.cursor(conn) as cur,
                ):
                    drv.execute(cur, statement, params)
                    return cur.fetchone() if cur.description else None
            except driver.ERRORS as exc:
                # Gone, or one cut at its deadline (which marks the request unresponsive).
                self._unresponsive = self._unresponsive or isinstance(exc, NoAnswer)
                if not (self._unresponsive or is_unreachable(exc, self._conn)):
                    # The server answered (a statement or lock timeout, a missing
                    # table): the connection is sound and stays with the request.
                    self.rollback()
                    if own:
                        raise
                    if sqlstate(exc) == sql.LEASE_LOST_SQLSTATE:  # (raised by fenced ones only)
                        raise LeaseLostError() from exc
                    raise answered(what, exc) from exc
                self._drop()
                if not retry or self._unresponsive:
                    raise StoreUnavailableError(f"{what} failed: {type(exc).__name__}") from exc
                retry = False

    def _drop(self, *, peers: bool = True) -> None:
        """Give back a connection that failed: it is not reused, nor (when the
        database looks unreachable) are its idle peers."""
        conn, self._conn = self._conn, None
        self._in_transaction = False
        if conn is not None:
            self._store.pool.putconn(conn, discard=True)
        if peers:
            self._store.pool.discard_idle()

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
        if not self.holds_lease:
            return self._claim_in_transaction(record_key, fingerprint, ttl)
        token = sql.new_token()
        params = dict(
            key=record_key, fp=fingerprint, token=token, lease=lease, ttl=ttl, recovery=recovery
        )
        for _ in range(6):
            try:
                row = self._send("claim", self._store.statements.claim, params, **CLAIMING)
            except StoreUnavailableError as exc:
                if sqlstate(exc.__cause__ or exc) != sql.UNIQUE_VIOLATION:
                    raise
                continue  # claimed by another between the claim's read and its INSERT
            if row is None:
                continue  # the row appeared or vanished concurrently; look again
            if not row[0]:
                return _existing(*row[1:8])
            phases = phases_of(row[8])
            self.has_progress = bool(phases)
            return Claimed(token, phases, takeover=bool(row[9]))
        raise StoreUnavailableError("claim did not settle after repeated concurrent changes")

    def _claim_in_transaction(
        self, record_key: bytes, fingerprint: bytes, ttl: float
    ) -> ClaimResult:
        """Transaction mode: open the business transaction with the claim (one round
        trip, two advisory locks; no processing row, no lease). ``Claimed`` leaves it
        open for the view; any other answer is for the caller to ``close()``."""
        self.rollback()  # a waiting duplicate's earlier try
        params = (record_key, *sql.advisory_locks(record_key, fingerprint))
        try:
            row = self._send("claim", sql.CLAIM_IN_TRANSACTION, params, **CLAIMING)
        except StoreUnavailableError:
            if self._conn is not None:
                self._in_transaction = True  # (its BEGIN ran: roll it back on close)
            raise
        self._in_transaction = True
        if row is not None and not row[0]:
            # Held by a live transaction: the same request (409), or another (422).
            return Existing("processing", fingerprint if row[1] else b"", None)
        dead_holder = (
            row is not None and row[2] == "processing" and row[7] is not None and row[7] <= 0
        )
        if row is None or (dead_holder and bytes(row[3]) == fingerprint):
            # New, or a dead row-mode holder of this request the completion takes over.
            self._claimed = (fingerprint, ttl)
            return Claimed(sql.new_token())  # names the attempt; the locks fence
        return _existing(*row[2:9])

    def connection(self) -> Connection:
        """The connection, in this request's transaction (opened now if it is not).
        Nothing of the transaction exists before, so a pooled connection that died
        while idle (a keyless request's first statement after a restart) is
        replaced once, as the claim's is."""
        if not self._in_transaction:
            self._send("BEGIN", "BEGIN", retry=True)
            self._in_transaction = True
        return self.held()

    def complete(self, record_key: bytes, token: int, response: StoredResponse) -> None:
        """Store ``response`` and commit, with the view's transaction if it opened one,
        in one round trip; ``LeaseLostError`` if the record was taken over."""
        text = self._store.statements.complete
        head: tuple[Any, ...] = (record_key, token)
        if self._claimed is not None:  # (the record is inserted: fingerprint and TTL)
            text, head = self._store.statements.insert_completed, (record_key, *self._claimed)
        if not self._in_transaction:
            text = "BEGIN;\n" + text  # (its COMMIT must end a transaction)
        self._send("completion", text, (*head, *sql.response_params(response)))
        self._in_transaction = False
        self._claimed = None

    def checkpoint(self, record_key: bytes, token: int, phase: str, data_json: str) -> None:
        """Commit the view's transaction so far together with the recovery point
        ``phase`` (row mode), in one round trip; ``LeaseLostError`` if the record was
        taken over (the transaction is rolled back). A view that had a transaction
        open gets a new one in the same round trip, so a connection it fetched
        before the phase never drops into autocommit."""
        text = self._store.statements.checkpoint
        if not self._in_transaction:
            text = "BEGIN;\n" + text
        self._in_transaction = True
        self._send("checkpoint", text, (record_key, token, phase, data_json))
        self.has_progress = True

    def count_recovered(self) -> None:
        """Count one more recovered record in this request's transaction (the
        completer's total commits with the recovered answer, or not at all)."""
        self.connection()  # (in the transaction: BEGIN now if it is not)
        self._send("recovery count", sql.BUMP_RECOVERY_TOTAL, ("recovered",))

    def rollback(self) -> None:
        """Roll back the view's transaction, if it opened one (best effort: a
        connection whose ``ROLLBACK`` failed is not reused)."""
        if self._conn is not None and self._in_transaction:
            self._in_transaction = False
            try:
                self._send("ROLLBACK", "ROLLBACK")
            except StoreUnavailableError:
                self._drop(peers=False)  # (dropped already if lost, with its peers)

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
            self.rollback()
            return
        if self._conn is not None and self._conn.closed:
            # Lost under the view (its session is gone, and with it the transaction):
            # the release goes on a fresh connection.
            self._drop(peers=False)
        text = self._store.statements.timeouts
        if self._in_transaction:
            text = "ROLLBACK;\n" + text
        text += sql.END_LEASE if self.has_progress else sql.RELEASE
        try:
            self._send("release", text, (record_key, token))
            self._in_transaction = False
        except StoreUnavailableError as exc:
            log.warning(
                "idempotency: release failed (%s); the lease will expire",
                type(exc.__cause__ or exc).__name__,
            )

    def commit(self) -> None:
        """Commit the view's transaction on a keyless request; ``StoreUnavailableError``
        if the database went away, the driver's own error for anything else (a
        deferred constraint is the application's error, not an outage)."""
        if self._in_transaction and self._conn is not None:
            self._send("COMMIT", "COMMIT", own=True)
            self._in_transaction = False

    def close(self) -> None:
        self.rollback()
        conn, self._conn = self._conn, None
        if conn is not None:
            self._store.pool.putconn(conn)


#: How a claim is sent: one deadline for the pool, a connect and the statement, and
#: once more on a fresh connection if a pooled one turns out dead.
CLAIMING: dict[str, bool] = {"retry": True, "bounded": True}


def _existing(
    state: Any, fingerprint: Any, status: Any, headers: Any, body: Any, lease: Any, ttl: Any
) -> Existing:
    """The record a claim found and may not take, from the claim's columns."""
    response = None
    if state == "completed":
        response = StoredResponse(int(status), sql.headers_from_json(headers), bytes(body))
    return Existing(state, bytes(fingerprint), response, lease, ttl)
