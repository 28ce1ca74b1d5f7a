"""Per-worker servers' namespaces under pytest-xdist (``make test`` runs ``-n``).

Every worker of one run shares the run's PostgreSQL and Redis, and the
per-test reset (``clean_db`` truncates every table, ``clean_redis`` FLUSHDBs)
would empty them under a test running on another worker.  So each worker
points DATABASE_URL at a database of its own (the URL's name + ``_gw0``...,
created if missing) and REDIS_URL at a logical database of its own (the
URL's number + the worker's index, mod 16), in ``os.environ`` itself: the
apps and gunicorns the tests start read those variables too.  Without xdist
(``-n 0``, ``-p no:xdist``) nothing changes.
"""

from __future__ import annotations

import os
from urllib.parse import urlsplit, urlunsplit

import psycopg2
from psycopg2 import sql

#: Logical databases of one Redis server.
REDIS_DATABASES = 16


def worker_id() -> str | None:
    """``gw0``, ``gw1``... under xdist; None in a serial run."""
    return os.environ.get("PYTEST_XDIST_WORKER") or None


def worker_index() -> int:
    """0 in a serial run and on ``gw0``; n on ``gwn``."""
    worker = worker_id()
    return int(worker.removeprefix("gw")) if worker else 0


def worker_redis_db(base: int) -> int:
    """Logical database ``base`` moved by the worker's index (mod 16)."""
    return (base + worker_index()) % REDIS_DATABASES


def worker_redis_url(url: str) -> str:
    """``url`` with its logical database moved by the worker's index."""
    parts = urlsplit(url)
    base = int(parts.path.strip("/") or 0)
    return urlunsplit(parts._replace(path=f"/{worker_redis_db(base)}"))


def worker_database_url(url: str, worker: str) -> str:
    """``url`` naming the worker's own database (created when missing)."""
    parts = urlsplit(url)
    name = f"{parts.path.strip('/') or 'postgres'}_{worker}"
    conn = psycopg2.connect(url, connect_timeout=5)
    conn.autocommit = True  # CREATE DATABASE cannot run in a transaction
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,))
            if cur.fetchone() is None:
                cur.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    finally:
        conn.close()
    return urlunsplit(parts._replace(path=f"/{name}"))


def isolate_worker() -> None:
    """Point DATABASE_URL and REDIS_URL at this worker's own namespaces, if any.

    An unreachable DATABASE_URL is left as it is: the fixtures fail the tests
    that need it and say why (never at import).
    """
    worker = worker_id()
    if worker is None:
        return
    database_url = os.environ.get("DATABASE_URL", "").strip()
    if database_url:
        try:
            os.environ["DATABASE_URL"] = worker_database_url(database_url, worker)
        except psycopg2.Error:
            pass
    redis_url = os.environ.get("REDIS_URL", "").strip()
    if redis_url:
        os.environ["REDIS_URL"] = worker_redis_url(redis_url)
