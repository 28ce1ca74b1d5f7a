"""Checking and resetting the run-wide PostgreSQL and Redis between tests.

The fixtures in conftest.py are thin wrappers over these, so the support
tests can exercise the same code on a server of their own.
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

import psycopg2
import redis
from psycopg2 import sql
from redis.backoff import NoBackoff
from redis.retry import Retry

# Tables whose rows record which migrations ran.  Truncating them would make
# the next start re-run every migration against tables that already exist.
KEEP_SUFFIX = "schema_migrations"

# How long a truncate may wait for a lock.  A test that leaked an open
# transaction (a gunicorn still stopping, a forgotten connection) would
# otherwise make every following test hang instead of fail.
LOCK_TIMEOUT = "10s"


def redact(url: str) -> str:
    """``url`` without its password, for messages that end up in CI logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


def check_postgres(url: str, timeout: int = 5) -> None:
    """Raise ``RuntimeError`` unless PostgreSQL at ``url`` runs a query."""
    try:
        conn = psycopg2.connect(url, connect_timeout=timeout)
    except psycopg2.Error as exc:
        raise RuntimeError(f"PostgreSQL at {redact(url)} is unreachable: {exc}") from exc
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT 1")
    finally:
        conn.close()


def check_redis(url: str, timeout: float = 5.0) -> None:
    """Raise ``RuntimeError`` unless Redis at ``url`` answers PING."""
    client = redis.Redis.from_url(
        url,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        retry=Retry(NoBackoff(), 0),  # one attempt: the default backs off for seconds
    )
    try:
        client.ping()
    except redis.RedisError as exc:
        raise RuntimeError(f"Redis at {redact(url)} is unreachable: {exc}") from exc
    finally:
        client.close()


def truncate_public_tables(url: str) -> list[str]:
    """Empty every table of the ``public`` schema but the migration records.

    Tables come from the catalog, so new ones are covered without anyone
    updating a list.  Returns the names truncated.
    """
    conn = psycopg2.connect(url)
    try:
        with conn, conn.cursor() as cur:
            cur.execute(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'")
            cur.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
            names = sorted(n for (n,) in cur.fetchall() if not n.endswith(KEEP_SUFFIX))
            if names:
                tables = sql.SQL(", ").join(sql.Identifier("public", n) for n in names)
                cur.execute(sql.SQL("TRUNCATE {} RESTART IDENTITY CASCADE").format(tables))
    finally:
        conn.close()
    return names


def flush_redis(url: str) -> None:
    """FLUSHDB on the database ``url`` names (not the whole server)."""
    client = redis.Redis.from_url(url)
    try:
        client.flushdb()
    finally:
        client.close()


def count_rows(url: str, table: str) -> int:
    """``SELECT count(*)`` of ``table``, on a connection of its own."""
    import psycopg2

    conn = psycopg2.connect(url)
    try:
        with conn.cursor() as cur:
            cur.execute(f"SELECT count(*) FROM {table}")
            row = cur.fetchone()
            assert row is not None
            return int(row[0])
    finally:
        conn.close()
