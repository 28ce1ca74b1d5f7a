"""The PostgreSQL store: the source of truth for every claim.

Round trips per request are the hot path's cost, so each phase is one
statement: the claim (``INSERT ... ON CONFLICT`` that also reads back an
existing row), the completion (inside the view's own transaction, together
with its ``COMMIT``), and the release.
"""

from __future__ import annotations

import logging
import secrets
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import psycopg2
import psycopg2.extensions
import psycopg2.extras

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
from .pool import BorrowedPool, Connection, ConnectionPool

log = logging.getLogger("flask_idempotency")

#: SQLSTATE raised by ``idempotency_complete`` when the caller's lease was taken over.
LEASE_LOST_SQLSTATE = "IK409"

#: One statement claims the key or reads the existing row. It reads first, so a
#: replay or a 409 takes no row lock and writes nothing (an ``ON CONFLICT DO
#: UPDATE ... WHERE false`` alone would lock the row and write WAL for every
#: duplicate). The INSERT then takes the key when it is new, when the old record
#: expired (treated as absent), or when a processing record's lease ran out under
#: the *same* request (a crashed holder). A different request under a dead
#: holder's key stays a 422: the key is bound to its first request until the TTL
#: ends. ``ON CONFLICT`` settles races with a concurrent claimer; when a row
#: appears or vanishes between the read and the insert, neither branch returns a
#: row and the caller simply runs the statement again.
#: Parameters: $1 record key, $2 fingerprint, $3 lock token, $4 lease, $5 TTL (s).
CLAIM_BODY = """
WITH existing AS (
    SELECT state, fingerprint, status_code, headers, body, lease_expires_at, expires_at
      FROM idempotency_records WHERE record_key = $1
), claimed AS (
    INSERT INTO idempotency_records AS r
        (record_key, fingerprint, state, lock_token, lease_expires_at, created_at, expires_at)
    SELECT $1, $2, 'processing', $3, now() + make_interval(secs => $4), now(),
           now() + make_interval(secs => $5)
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
           takeovers = r.takeovers + 1
     WHERE r.expires_at <= now()
        OR (r.state = 'processing' AND r.lease_expires_at <= now()
            AND r.fingerprint = EXCLUDED.fingerprint)
    RETURNING 1
)
SELECT true, NULL::text, NULL::bytea, NULL::smallint, NULL::jsonb, NULL::bytea,
       NULL::float8, NULL::float8
  FROM claimed
UNION ALL
SELECT false, e.state, e.fingerprint, e.status_code, e.headers, e.body,
       extract(epoch FROM e.lease_expires_at - now())::float8,
       extract(epoch FROM e.expires_at - now())::float8
  FROM existing e
 WHERE NOT EXISTS (SELECT 1 FROM claimed)
"""

_CLAIM_PARAMS = ("key", "fp", "token", "lease", "ttl")

#: Planning the claim costs about twice its execution, so each connection prepares
#: it once; later claims send only ``EXECUTE``. Still one round trip either way.
PREPARE_CLAIM = (
    "PREPARE idempotency_claim (bytea, bytea, bigint, float8, float8) AS" + CLAIM_BODY + ";\n"
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
    + "EXECUTE idempotency_claim (%(key)s, %(fp)s, %(token)s, %(lease)s, %(ttl)s)"
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
RELEASE = "DELETE FROM idempotency_records WHERE record_key = %s AND lock_token = %s"

#: Renew every in-flight lease of this process in one statement.
RENEW = """
UPDATE idempotency_records AS r
   SET lease_expires_at = now() + make_interval(secs => h.lease)
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

_CONNECTION_ERRORS = (psycopg2.OperationalError, psycopg2.InterfaceError)


def new_token() -> int:
    """A random positive 63-bit fencing token."""
    return secrets.randbits(63) or 1


def headers_from_json(raw: Any) -> tuple[tuple[str, str], ...]:
    return tuple((str(k), str(v)) for k, v in (raw or ()))


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

    def _acquire(self) -> Connection:
        if self._conn is None:
            self._conn = self._store.pool.getconn()
        return self._conn

    def _drop(self) -> None:
        """Give back a connection that failed: it is not reused, nor are its idle peers."""
        conn, self._conn = self._conn, None
        self._in_transaction = False
        if conn is not None:
            self._store.pool.putconn(conn, discard=True)
        self._store.pool.discard_idle()

    def claim(
        self, record_key: bytes, fingerprint: bytes, *, lease: float, ttl: float
    ) -> ClaimResult:
        token = new_token()
        params = {"key": record_key, "fp": fingerprint, "token": token, "lease": lease, "ttl": ttl}
        retried_connection = False
        for _ in range(5):
            conn = self._acquire()
            try:
                with conn.cursor() as cur:
                    cur.execute(self._store.claim_sql(conn), params)
                    row = cur.fetchone()
            except _CONNECTION_ERRORS as exc:
                self._drop()
                # A pooled connection may be stale after a server restart: one retry
                # on a fresh connection. The statement never reached the server then.
                if not retried_connection:
                    retried_connection = True
                    continue
                raise StoreUnavailableError(f"claim failed: {type(exc).__name__}") from exc
            except psycopg2.Error as exc:
                self._drop()
                raise StoreUnavailableError(f"claim failed: {type(exc).__name__}") from exc
            if row is None:
                continue  # the row appeared or vanished concurrently; look again
            if row[0]:
                return Claimed(token)
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

    def connection(self) -> Connection:
        conn = self._acquire()
        if not self._in_transaction:
            try:
                with conn.cursor() as cur:
                    cur.execute("BEGIN")
            except psycopg2.Error as exc:
                self._drop()
                raise StoreUnavailableError(f"BEGIN failed: {type(exc).__name__}") from exc
            self._in_transaction = True
        return conn

    def complete(self, record_key: bytes, token: int, response: StoredResponse) -> None:
        conn = self._acquire()
        params = (
            record_key,
            token,
            response.status,
            psycopg2.extras.Json([list(h) for h in response.headers]),
            psycopg2.Binary(response.body),
        )
        sql = COMPLETE + ";\nCOMMIT" if self._in_transaction else COMPLETE
        try:
            with conn.cursor() as cur:
                cur.execute(sql, params)
        except psycopg2.Error as exc:
            lost = exc.pgcode == LEASE_LOST_SQLSTATE
            if self._in_transaction and not conn.closed:
                self._rollback()
            if lost:
                raise LeaseLostError() from exc
            self._drop()
            raise StoreUnavailableError(f"completion failed: {type(exc).__name__}") from exc
        self._in_transaction = False

    def _rollback(self) -> None:
        if self._conn is None:
            return
        try:
            with self._conn.cursor() as cur:
                cur.execute("ROLLBACK")
            self._in_transaction = False
        except psycopg2.Error:
            self._drop()

    def release(self, record_key: bytes, token: int) -> None:
        """Roll back the view's writes and delete our claim, so a retry runs again.

        Best effort: if the database is gone the claim expires with its lease.
        """
        sql = ("ROLLBACK;\n" + RELEASE) if self._in_transaction else RELEASE
        try:
            conn = self._acquire()
            with conn.cursor() as cur:
                cur.execute(sql, (record_key, token))
            self._in_transaction = False
        except (psycopg2.Error, StoreUnavailableError) as exc:
            log.warning(
                "idempotency: release failed (%s); the lease will expire", type(exc).__name__
            )
            self._drop()

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
    ) -> None:
        self.pool = pool
        self.async_claim_commit = async_claim_commit
        self.prepare_statements = prepare_statements
        self._prefix = ASYNC_COMMIT_PREFIX if async_claim_commit else ""
        # Connections that have the claim prepared. A connection that fails is
        # discarded, so a half-done PREPARE is never assumed.
        self._prepared: weakref.WeakSet[Connection] = weakref.WeakSet()

    def claim_sql(self, conn: Connection) -> str:
        """The claim's text for this connection: prepared on first use if enabled."""
        if not self.prepare_statements:
            return self._prefix + CLAIM
        if conn in self._prepared:
            return self._prefix + EXECUTE_CLAIM
        self._prepared.add(conn)
        return PREPARE_CLAIM + self._prefix + EXECUTE_CLAIM

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
        )

    def begin(self) -> PostgresRequest:
        return PostgresRequest(self)

    @contextmanager
    def _autocommit(self) -> Iterator[Connection]:
        """A pooled autocommit connection for one maintenance statement or two."""
        try:
            with self.pool.connection() as conn:
                yield conn
        except _CONNECTION_ERRORS as exc:
            self.pool.discard_idle()
            raise StoreUnavailableError(f"{type(exc).__name__}: {exc}".strip()) from exc
        except psycopg2.Error as exc:
            raise StoreUnavailableError(f"{type(exc).__name__}: {exc}".strip()) from exc

    @contextmanager
    def transaction(self) -> Iterator[Connection]:
        """A connection in a transaction for the application's own work outside
        idempotent routes: committed on success, rolled back on an exception."""
        with self._autocommit() as conn:
            with conn.cursor() as cur:
                cur.execute("BEGIN")
            try:
                yield conn
            except BaseException:
                if not conn.closed:
                    with conn.cursor() as cur:
                        cur.execute("ROLLBACK")
                raise
            with conn.cursor() as cur:
                cur.execute("COMMIT")

    def ping(self) -> None:
        with self._autocommit() as conn, conn.cursor() as cur:
            cur.execute("SELECT 1")

    def renew(self, holds: Sequence[LeaseHold]) -> int:
        if not holds:
            return 0
        with self._autocommit() as conn, conn.cursor() as cur:
            cur.execute(
                RENEW,
                (
                    [psycopg2.Binary(h.record_key) for h in holds],
                    [h.token for h in holds],
                    [h.lease for h in holds],
                ),
            )
            return int(cur.rowcount)

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
        self.pool.close()
