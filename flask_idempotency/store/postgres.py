"""The PostgreSQL store: the source of truth for every claim.

Round trips per request are the hot path's cost, so each phase is one
statement: the claim (``INSERT ... ON CONFLICT`` that also reads back an
existing row), the completion (inside the view's own transaction, together
with its ``COMMIT``), and the release.
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import threading
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import psycopg2
import psycopg2.extensions

from . import migrations
from .base import (
    Claimed,
    ClaimResult,
    Existing,
    LeaseHold,
    LeaseLostError,
    RecordInfo,
    StoredResponse,
    StoreUnavailableError,
)
from .errors import is_unreachable
from .pool import BorrowedPool, Connection, ConnectionPool
from .watchdog import WATCHDOG

log = logging.getLogger("flask_idempotency.store")

#: SQLSTATE raised by ``idempotency_complete`` when the caller's lease was taken over.
LEASE_LOST_SQLSTATE = "IK409"
#: ``EXECUTE`` of a prepared statement the session no longer has (the application
#: ran ``DEALLOCATE ALL`` or ``DISCARD ALL`` on a borrowed connection): prepare again.
PREPARED_STATEMENT_MISSING = "26000"
#: ``PREPARE`` of a name the session already has (prepared by another store).
PREPARED_STATEMENT_EXISTS = "42P05"

#: Seconds past the statement timeout after which the client stops waiting for any
#: answer and shuts the connection down (see ``watchdog.py``).
CLIENT_DEADLINE_GRACE = 1.0

#: One statement claims the key or reads the existing row. It reads first, so a
#: replay or a 409 takes no row lock and writes nothing (an ``ON CONFLICT DO
#: UPDATE ... WHERE false`` alone would lock the row and write WAL for every
#: duplicate). The INSERT then takes the key when it is new, when the old record
#: expired (treated as absent), or when a processing record's lease ran out under
#: the *same* request (a crashed holder). A different request under a dead
#: holder's key stays a 422: the key is bound to its first request until the TTL
#: ends. ``ON CONFLICT`` settles races with a concurrent claimer; when a row
#: appears or vanishes between the read and the insert, neither branch returns a
#: row and the caller simply runs the statement again. The same holds when the
#: row read was one we could take (expired, or a dead holder's) but another
#: claimer took it first: the second branch never answers from that stale read
#: (it would replay an expired answer, or a 422, where the truth is a 409), so
#: the statement runs again and sees the new holder.
#: A route that declares ``recover=`` sends what recovery needs as $6 (NULL for
#: every other route), so it is written with the claim, in the same round trip.
#: Taking over a dead holder of the same request keeps the recovery points it
#: committed (the view resumes after them, and they come back in the claimed
#: row); a claim of an expired record (a new request) drops them.
#: Parameters: $1 record key, $2 fingerprint, $3 lock token, $4 lease, $5 TTL (s),
#: $6 recovery payload or NULL (``recovery.py``).
CLAIM_BODY = """
WITH existing AS (
    SELECT state, fingerprint, status_code, headers, body, lease_expires_at, expires_at
      FROM idempotency_records WHERE record_key = $1
), claimed AS (
    INSERT INTO idempotency_records AS r
        (record_key, fingerprint, state, lock_token, lease_expires_at, created_at, expires_at,
         recovery)
    SELECT $1, $2, 'processing', $3, now() + make_interval(secs => $4), now(),
           now() + make_interval(secs => $5), $6
     WHERE NOT EXISTS (
            SELECT 1 FROM existing e
             WHERE e.expires_at > now()
               AND NOT (e.state = 'processing' AND e.lease_expires_at <= now()
                        AND e.fingerprint = $2))
    ON CONFLICT (record_key) DO UPDATE
       SET fingerprint = EXCLUDED.fingerprint, state = 'processing',
           lock_token = EXCLUDED.lock_token, lease_expires_at = EXCLUDED.lease_expires_at,
           created_at = EXCLUDED.created_at, expires_at = EXCLUDED.expires_at,
           completed_at = NULL, status_code = NULL, headers = NULL, body = NULL,
           takeovers = r.takeovers + 1, recovery = EXCLUDED.recovery,
           phases = CASE WHEN r.expires_at <= now() THEN NULL ELSE r.phases END
     WHERE r.expires_at <= now()
        OR (r.state = 'processing' AND r.lease_expires_at <= now()
            AND r.fingerprint = EXCLUDED.fingerprint)
    RETURNING r.phases
)
SELECT true, NULL::text, NULL::bytea, NULL::smallint, NULL::jsonb, NULL::bytea,
       NULL::float8, NULL::float8, claimed.phases,
       EXISTS (SELECT 1 FROM existing e WHERE e.state = 'processing' AND e.expires_at > now())
  FROM claimed
UNION ALL
SELECT false, e.state, e.fingerprint, e.status_code, e.headers, e.body,
       extract(epoch FROM e.lease_expires_at - now())::float8,
       extract(epoch FROM e.expires_at - now())::float8, NULL::jsonb, false
  FROM existing e
 WHERE NOT EXISTS (SELECT 1 FROM claimed)
   AND e.expires_at > now()
   AND NOT coalesce(e.state = 'processing' AND e.lease_expires_at <= now()
                    AND e.fingerprint = $2, false)
"""

_CLAIM_PARAMS = ("key", "fp", "token", "lease", "ttl", "recovery")

#: Planning the claim costs about twice its execution, so each connection prepares
#: it once; later claims send only ``EXECUTE``. Still one round trip either way.
PREPARE_CLAIM = (
    "PREPARE idempotency_claim (bytea, bytea, bigint, float8, float8, bytea) AS"
    + CLAIM_BODY
    + ";\n"
)
#: A prepared statement's plan is cached for the connection's life. Left to
#: itself PostgreSQL picks it from the table's size when it is first cached, and
#: on an empty or tiny table (a fresh deployment, a table just purged) that is a
#: sequential scan, which the connection would keep while the table grows. So
#: the claim always gets one plan, built with sequential scans ruled out: the
#: primary-key lookup at every size. ``SET LOCAL`` ends with the claim's own
#: implicit transaction; the view's queries keep the session's settings.
CLAIM_PLAN_SETTINGS = (
    "SET LOCAL plan_cache_mode TO force_generic_plan;\nSET LOCAL enable_seqscan TO off;\n"
)
EXECUTE_CLAIM = (
    CLAIM_PLAN_SETTINGS
    + "EXECUTE idempotency_claim (%(key)s, %(fp)s, %(token)s, %(lease)s, %(ttl)s, %(recovery)s)"
)


def _inline_parameters(sql: str) -> str:
    """The claim with psycopg2 placeholders, for poolers that drop prepared statements."""
    for number, name in reversed(list(enumerate(_CLAIM_PARAMS, start=1))):
        sql = sql.replace(f"${number}", f"%({name})s")
    return sql


CLAIM = _inline_parameters(CLAIM_BODY)

#: Prefix for the claim when ``async_claim_commit`` is on. Several statements in
#: one simple query run as one implicit transaction, so SET LOCAL covers the claim
#: alone, still in a single round trip; the business transaction commits durably.
ASYNC_COMMIT_PREFIX = "SET LOCAL synchronous_commit TO off;\n"

COMPLETE = "SELECT idempotency_complete(%s, %s::bigint, %s::smallint, %s::jsonb, %s)"

#: ``claim_mode = "transaction"`` (migrations 0005 and 0007): the business
#: transaction opens with the claim, under two advisory locks, in one round trip;
#: the completed record is inserted by the view's own COMMIT. No processing row,
#: no lease. Advisory locks and reads work on a read-only server (a hot standby,
#: one with ``default_transaction_read_only``), so the claim function first
#: checks ``transaction_read_only`` and raises SQLSTATE 25006 there, before
#: anything is claimed or any view runs (a 503, and the connection is replaced),
#: as the row-mode claim's INSERT does.
CLAIM_IN_TRANSACTION = "BEGIN;\nSELECT * FROM idempotency_claim_in_transaction_rw(%s, %s, %s)"
INSERT_COMPLETED = (
    "SELECT idempotency_insert_completed(%s, %s, %s, %s::smallint, %s::jsonb, %s);\nCOMMIT"
)
RELEASE = "DELETE FROM idempotency_records WHERE record_key = %s AND lock_token = %s"
#: The release of a record that holds committed recovery points (migration 0006):
#: those phases' writes are committed, so the record is kept with them and only
#: our lease ends, at once. The next identical request, or ``flask idempotency
#: recover``, takes it over and resumes after the last phase instead of redoing it.
RELEASE_KEEPING_PHASES = """
UPDATE idempotency_records SET lock_token = NULL, lease_expires_at = now()
 WHERE record_key = %s AND lock_token = %s AND state = 'processing'
"""
#: A recovery point (``phases.py``): the phase's writes and the record's progress
#: commit together, fenced like the completion (``IK409`` once taken over).
CHECKPOINT = "SELECT idempotency_checkpoint(%s, %s::bigint, %s, %s::jsonb)"

#: Renew every in-flight lease of this process in one statement. A live record
#: never expires under its holder: a view slower than its TTL would otherwise be
#: taken over by any request (an expired record is absent) and deleted by purge.
RENEW = """
UPDATE idempotency_records AS r
   SET lease_expires_at = now() + make_interval(secs => h.lease),
       expires_at = greatest(r.expires_at, now() + make_interval(secs => h.lease))
  FROM unnest(%s::bytea[], %s::bigint[], %s::float8[]) AS h(record_key, token, lease)
 WHERE r.record_key = h.record_key AND r.lock_token = h.token AND r.state = 'processing'
"""

#: Purge in batches so no long lock is held; SKIP LOCKED lets a concurrent
#: purge (or a takeover) proceed without waiting.
PURGE_BATCH = """
WITH doomed AS (
    SELECT record_key FROM idempotency_records
     WHERE expires_at <= now()
     ORDER BY expires_at
     LIMIT %s
     FOR UPDATE SKIP LOCKED
)
DELETE FROM idempotency_records r USING doomed
 WHERE r.record_key = doomed.record_key
RETURNING r.record_key
"""
COUNT_EXPIRED = "SELECT count(*) FROM idempotency_records WHERE expires_at <= now()"

INFO = """
SELECT state, created_at, expires_at, completed_at, lease_expires_at, status_code, body,
       headers, extract(epoch FROM now() - created_at)::float8, expires_at <= now()
  FROM idempotency_records WHERE record_key = %s
"""
#: Table-wide figures for ``flask idempotency stats``.
STATS = """
SELECT count(*) FILTER (WHERE state = 'processing' AND expires_at > now()),
       count(*) FILTER (WHERE state = 'completed' AND expires_at > now()),
       count(*) FILTER (WHERE expires_at <= now()),
       count(*) FILTER (WHERE state = 'processing' AND lease_expires_at <= now()
                        AND expires_at > now()),
       coalesce(max(extract(epoch FROM now() - created_at))
                FILTER (WHERE state = 'processing'), 0)::float8,
       coalesce(sum(takeovers), 0)
  FROM idempotency_records
"""
UNLOCK = "DELETE FROM idempotency_records WHERE record_key = %s AND state = 'processing'"


def timeouts_sql(statement_timeout: float, lock_timeout: float) -> str:
    """``SET LOCAL`` of both timeouts, sent first in the same round trip as each of the
    extension's own statements: they end with that statement's transaction (for
    the completion, with the view's, after the view's last statement)."""
    statement_ms = max(1, round(statement_timeout * 1000))
    lock_ms = max(1, round(lock_timeout * 1000)) if lock_timeout > 0 else 0
    return f"SET LOCAL statement_timeout TO {statement_ms};\nSET LOCAL lock_timeout TO {lock_ms};\n"


def new_token() -> int:
    """A random positive 63-bit fencing token."""
    return secrets.randbits(63) or 1


def headers_from_json(raw: Any) -> tuple[tuple[str, str], ...]:
    return tuple((str(k), str(v)) for k, v in (raw or ()))


def response_params(response: StoredResponse) -> tuple[int, str, Any]:
    """A stored answer as the completion statements take it: the status, the header
    pairs as a JSON array of arrays (each statement casts it to jsonb), the body."""
    return response.status, json.dumps(response.headers), psycopg2.Binary(response.body)


def advisory_locks(record_key: bytes, fingerprint: bytes) -> tuple[int, int]:
    """The request's and the key's advisory lock ids: signed 64-bit digests, so
    distinct keys collide with odds of 2**-64 (and then only answer a spurious 409)."""
    request = hashlib.sha256(record_key + b"\x00" + fingerprint).digest()
    return (
        int.from_bytes(request[:8], "big", signed=True),
        int.from_bytes(record_key[:8], "big", signed=True),
    )


class PostgresRequest:
    """One request's connection, from claim to completion or release.

    The connection is in autocommit mode; when the view asks for it, an explicit
    ``BEGIN`` opens the business transaction, which the completion commits. The
    view cannot commit early by accident: psycopg2's ``commit()`` is a no-op in
    autocommit mode.
    """

    def __init__(self, store: PostgresStore) -> None:
        self._store = store
        self._conn: Connection | None = None
        self._in_transaction = False
        #: One of our statements got no answer before its deadline: PostgreSQL is
        #: not answering, so the release does not wait on a new connection too.
        self._unresponsive = False
        #: A transaction-mode claim's request, kept for the completed record.
        self._claimed: tuple[bytes, float] | None = None
        #: The record holds committed recovery points (claimed with them, or one
        #: committed since): a release keeps it for the next attempt to resume.
        self.has_progress = False

    @property
    def holds_lease(self) -> bool:
        """Whether the claim is a processing row whose lease the keeper must renew
        (row mode); a transaction-mode claim lives and dies with its session."""
        return self._store.claim_mode == "row"

    def _acquire(self) -> Connection:
        if self._conn is None:
            self._conn = self._store.pool.getconn()
        return self._conn

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
        self, conn: Connection, sql: str, params: Any = None, *, fetch: bool = False
    ) -> Any:
        """Run one of the extension's own statements under the client-side deadline;
        the first row if ``fetch``. Raises the driver's errors; a statement the
        watchdog had to cut off raises ``OperationalError`` and marks the request
        unresponsive."""
        ticket = WATCHDOG.watch(conn, self._store.deadline)
        try:
            with conn.cursor() as cur:
                cur.execute(sql, params)
                row = cur.fetchone() if fetch else None
        finally:
            fired = WATCHDOG.unwatch(ticket)
            if fired:
                self._unresponsive = True
        if fired:  # answered as the socket was shut down: the connection is gone anyway
            raise psycopg2.OperationalError("no answer from PostgreSQL before the deadline")
        return row

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
        if self._store.claim_mode == "transaction":
            return self._claim_in_transaction(record_key, fingerprint, ttl)
        token = new_token()
        params = {
            "key": record_key,
            "fp": fingerprint,
            "token": token,
            "lease": lease,
            "ttl": ttl,
            "recovery": psycopg2.Binary(recovery) if recovery is not None else None,
        }
        retried_connection = retried_prepare = False
        for _ in range(5):
            conn = self._acquire()
            try:
                row = self._execute(conn, self._store.claim_sql(conn), params, fetch=True)
            except psycopg2.Error as exc:
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
                if exc.pgcode == PREPARED_STATEMENT_MISSING and not retried_prepare:
                    retried_prepare = True
                    self._store.forget_prepared(conn)
                    continue  # deallocated under us (DISCARD ALL): prepare it again
                if exc.pgcode == PREPARED_STATEMENT_EXISTS and not retried_prepare:
                    retried_prepare = True
                    continue  # already prepared on this session: now known, execute it
                # The server answered (a statement or lock timeout, say): the
                # connection is sound and goes back to the pool with the request.
                raise StoreUnavailableError(f"claim failed: {type(exc).__name__}") from exc
            if row is None:
                continue  # the row appeared or vanished concurrently; look again
            if row[0]:
                phases = tuple((str(name), data) for name, data in row[8] or ())
                self.has_progress = bool(phases)
                return Claimed(token, phases, takeover=bool(row[9]))
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
        raise StoreUnavailableError("claim did not settle after repeated concurrent changes")

    def _claim_in_transaction(
        self, record_key: bytes, fingerprint: bytes, ttl: float
    ) -> ClaimResult:
        """Open the business transaction with the claim: ``Claimed`` leaves it open
        for the view; any other answer is for the caller to ``close()``."""
        if self._in_transaction:
            self._rollback()  # a waiting duplicate's earlier try
        request_lock, key_lock = advisory_locks(record_key, fingerprint)
        params = (record_key, request_lock, key_lock)
        for attempt in range(2):
            conn = self._acquire()
            try:
                row = self._execute(conn, CLAIM_IN_TRANSACTION, params, fetch=True)
                break
            except psycopg2.Error as exc:
                unreachable = self._unresponsive or is_unreachable(exc, conn)
                self._drop(peers=unreachable)
                if unreachable and attempt == 0 and not self._unresponsive:
                    continue  # a stale pooled connection: once more on a fresh one
                raise StoreUnavailableError(f"claim failed: {type(exc).__name__}") from exc
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

    def connection(self) -> Connection:
        conn = self._acquire()
        if not self._in_transaction:
            try:
                self._execute(conn, "BEGIN")
            except psycopg2.Error as exc:
                self._drop(peers=self._unresponsive or is_unreachable(exc, conn))
                raise StoreUnavailableError(f"BEGIN failed: {type(exc).__name__}") from exc
            self._in_transaction = True
        return conn

    def complete(self, record_key: bytes, token: int, response: StoredResponse) -> None:
        conn = self._acquire()
        # The timeouts come after the view's last statement, in the same round trip.
        store = self._store
        answer = response_params(response)
        sql_params: tuple[Any, ...]
        if self._claimed is not None:
            fingerprint, ttl = self._claimed
            sql_params = (record_key, fingerprint, ttl, *answer)
            sql = store.insert_completed
        else:
            sql_params = (record_key, token, *answer)
            sql = store.complete_in_transaction if self._in_transaction else store.complete_alone
        try:
            self._execute(conn, sql, sql_params)
        except psycopg2.Error as exc:
            if self._unresponsive or is_unreachable(exc, conn):
                self._drop()
                raise StoreUnavailableError(f"completion failed: {type(exc).__name__}") from exc
            if self._in_transaction:
                self._rollback()
            if exc.pgcode == LEASE_LOST_SQLSTATE:
                raise LeaseLostError() from exc
            raise StoreUnavailableError(f"completion failed: {type(exc).__name__}") from exc
        self._in_transaction = False
        self._claimed = None

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
        except psycopg2.Error as exc:
            if self._unresponsive or is_unreachable(exc, conn):
                self._drop()
                raise StoreUnavailableError(f"checkpoint failed: {type(exc).__name__}") from exc
            if self._in_transaction:
                self._rollback()
            if exc.pgcode == LEASE_LOST_SQLSTATE:
                raise LeaseLostError() from exc
            raise StoreUnavailableError(f"checkpoint failed: {type(exc).__name__}") from exc
        self.has_progress = True

    def _rollback(self) -> None:
        if self._conn is None:
            return
        try:
            self._execute(self._conn, "ROLLBACK")
            self._in_transaction = False
        except psycopg2.Error as exc:
            self._drop(peers=self._unresponsive or is_unreachable(exc, self._conn))

    def release(self, record_key: bytes, token: int) -> None:
        """Roll back the view's writes and delete our claim, so a retry runs again.
        A record with committed recovery points is kept instead, its lease ended,
        so the retry resumes after them (``RELEASE_KEEPING_PHASES``).

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
        release = self._store.timeouts + (RELEASE_KEEPING_PHASES if self.has_progress else RELEASE)
        sql = ("ROLLBACK;\n" + release) if self._in_transaction else release
        try:
            conn = self._acquire()
            self._execute(conn, sql, (record_key, token))
            self._in_transaction = False
        except (psycopg2.Error, StoreUnavailableError) as exc:
            log.warning(
                "idempotency: release failed (%s); the lease will expire", type(exc).__name__
            )
            unreachable = not isinstance(exc, psycopg2.Error) or is_unreachable(exc, self._conn)
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
        try:
            with self._conn.cursor() as cur:
                cur.execute("COMMIT")
        except psycopg2.Error as exc:
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


class PostgresStore:
    def __init__(
        self,
        pool: ConnectionPool | BorrowedPool,
        *,
        async_claim_commit: bool = True,
        prepare_statements: bool = True,
        statement_timeout: float = 5.0,
        lock_timeout: float = 2.0,
        claim_mode: str = "row",
    ) -> None:
        self.pool = pool
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
        # The timeouts go first, so they bound the PREPARE too.
        self._claim_prepare = self.timeouts + PREPARE_CLAIM + self._claim_execute
        self.complete_alone = self.timeouts + COMPLETE
        self.complete_in_transaction = self.timeouts + COMPLETE + ";\nCOMMIT"
        self.insert_completed = self.timeouts + INSERT_COMPLETED
        # Connections that have the claim prepared. A claim that finds its statement
        # gone (or already there) corrects this and runs again.
        self._prepared: weakref.WeakSet[Connection] = weakref.WeakSet()
        self._renew_lock = threading.Lock()

    def claim_sql(self, conn: Connection) -> str:
        """The claim's text for this connection: prepared on first use if enabled."""
        if not self.prepare_statements:
            return self._claim_inline
        if conn in self._prepared:
            return self._claim_execute
        self._prepared.add(conn)
        return self._claim_prepare

    def forget_prepared(self, conn: Connection) -> None:
        """``conn`` lost the prepared claim: its next claim prepares it again."""
        self._prepared.discard(conn)

    @classmethod
    def from_settings(cls, settings: Any) -> PostgresStore:
        pool: ConnectionPool | BorrowedPool
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
        )

    def begin(self) -> PostgresRequest:
        return PostgresRequest(self)

    @contextmanager
    def _autocommit(self) -> Iterator[Connection]:
        """A pooled autocommit connection for the extension's own maintenance
        statements: any driver error is a ``StoreUnavailableError``."""
        try:
            with self.pool.connection() as conn:
                yield conn
        except psycopg2.Error as exc:
            if is_unreachable(exc):
                self.pool.discard_idle()
            raise StoreUnavailableError(f"{type(exc).__name__}: {exc}".strip()) from exc

    @contextmanager
    def transaction(self) -> Iterator[Connection]:
        """A connection in a transaction for the application's own work outside
        idempotent routes: committed on success, rolled back on an exception.

        Only "PostgreSQL cannot be reached" is a ``StoreUnavailableError`` (a 503):
        an error of the application's own statements (an ``IntegrityError``, say)
        propagates unchanged after the rollback, as does a ``COMMIT`` that fails
        for a reason of its own (a deferred constraint).
        """
        conn = self.pool.getconn()
        broken = False
        try:
            try:
                with conn.cursor() as cur:
                    cur.execute("BEGIN")
            except psycopg2.Error as exc:
                broken = is_unreachable(exc, conn)
                raise StoreUnavailableError(f"BEGIN failed: {type(exc).__name__}") from exc
            try:
                yield conn
            except BaseException as exc:
                broken = _rollback_quietly(conn)
                if isinstance(exc, psycopg2.Error) and is_unreachable(exc, conn):
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
            except psycopg2.Error as exc:
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

    def ping(self) -> None:
        """One short statement under the extension's timeouts (health checks)."""
        with self._autocommit() as conn:
            ticket = WATCHDOG.watch(conn, self.deadline)
            try:
                with conn.cursor() as cur:
                    cur.execute(self.timeouts + "SELECT 1")
            finally:
                if WATCHDOG.unwatch(ticket):
                    conn.close()

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
            [psycopg2.Binary(h.record_key) for h in holds],
            [h.token for h in holds],
            [h.lease for h in holds],
        )
        with self._renew_lock:
            conn = self.pool.renewal_connection()
            count, error = 0, None
            ticket = WATCHDOG.watch(conn, self.deadline)
            try:
                with conn.cursor() as cur:
                    cur.execute(self.timeouts + RENEW, params)
                    count = int(cur.rowcount)
            except psycopg2.Error as exc:
                error = exc
            finally:
                fired = WATCHDOG.unwatch(ticket)
            if fired or (error is not None and is_unreachable(error, conn)):
                self.pool.discard_renewal_connection()
            if fired or error is not None:
                reason = "no answer in time" if fired else type(error).__name__
                raise StoreUnavailableError(f"renewal failed: {reason}") from error
            return count

    def migrate(self, extra_dirs: Sequence[str] = ()) -> list[str]:
        found = migrations.all_migrations(extra_dirs)
        with self._autocommit() as conn:
            return migrations.apply(conn, found)

    def count_expired(self) -> int:
        with self._autocommit() as conn, conn.cursor() as cur:
            cur.execute(COUNT_EXPIRED)
            row = cur.fetchone()
            return int(row[0]) if row else 0

    def purge(self, batch_size: int) -> Iterator[list[bytes]]:
        """Delete expired rows a batch at a time (each its own transaction), yielding
        the deleted keys so a cache can evict them too."""
        while True:
            with self._autocommit() as conn, conn.cursor() as cur:
                cur.execute(PURGE_BATCH, (batch_size,))
                keys = [bytes(r[0]) for r in cur.fetchall()]
            if keys:
                yield keys
            if len(keys) < batch_size:
                return

    def info(self, record_key: bytes) -> RecordInfo | None:
        with self._autocommit() as conn, conn.cursor() as cur:
            cur.execute(INFO, (record_key,))
            row = cur.fetchone()
        if row is None:
            return None
        return RecordInfo(
            state=row[0],
            created_at=row[1],
            expires_at=row[2],
            completed_at=row[3],
            lease_expires_at=row[4],
            status=row[5],
            body=bytes(row[6]) if row[6] is not None else None,
            headers=headers_from_json(row[7]),
            age_seconds=float(row[8]),
            expired=bool(row[9]),
        )

    def stats(self) -> dict[str, float]:
        with self._autocommit() as conn, conn.cursor() as cur:
            cur.execute(STATS)
            row = cur.fetchone()
        assert row is not None
        names = (
            "processing",
            "completed",
            "expired",
            "lease_expired",
            "oldest_processing_seconds",
            "takeovers",
        )
        return {name: float(value) for name, value in zip(names, row, strict=True)}

    def unlock(self, record_key: bytes) -> bool:
        with self._autocommit() as conn, conn.cursor() as cur:
            cur.execute(UNLOCK, (record_key,))
            return bool(cur.rowcount)

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
    except psycopg2.Error:
        return True
    return False
