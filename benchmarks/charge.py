"""What every subject's charge view shares: the business table and its insert,
the request body and path, the bare pool, and how a subject's sessions are named.

Kept apart from ``app.py`` (which builds the subjects) so that the subject
modules (``minimum``, ``peers``, ``sqla``) and ``app`` import it, and not each
other.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg2
import psycopg2.extensions
from flask import Response, jsonify, request

#: The baseline subject: Flask and psycopg2, no idempotency at all.
BASELINE = "bare"

#: A database of the benchmark's own: the test suite truncates every table of
#: the database it runs on, which would wipe pre-completed replay keys mid-run.
DEFAULT_DATABASE_URL = "postgresql://postgres@127.0.0.1:5432/idempotency_bench"
#: Likewise a Redis database number the tests do not flush.
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/13"
#: Cache keys of the benchmark, kept apart from any application's.
REDIS_PREFIX = "bench-idempotency"

#: Connections per worker process, the same for the bare pool and the
#: extension's (its default ``IDEMPOTENCY_DATABASE_OPTIONS["pool_size"]``): each in-flight
#: request holds one, so it only has to exceed the threads per worker.
POOL_SIZE = 10

BUSINESS_TABLE = """
CREATE TABLE IF NOT EXISTS bench_charges (
    id          bigserial   PRIMARY KEY,
    amount      integer     NOT NULL,
    currency    text        NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now()
)
"""
INSERT_CHARGE = "INSERT INTO bench_charges (amount, currency) VALUES (%s, %s) RETURNING id"

#: The one request body every load generator sends (a key is bound to its body).
REQUEST_BODY = b'{"amount": 1000, "currency": "usd"}'
CHARGES_PATH = "/charges"
HEALTH_PATH = "/healthz"


def database_url() -> str:
    return os.environ.get("BENCH_DATABASE_URL") or DEFAULT_DATABASE_URL


def redis_url() -> str:
    return os.environ.get("BENCH_REDIS_URL") or DEFAULT_REDIS_URL


def application_name(subject: str) -> str:
    """How a subject's PostgreSQL sessions are labelled in ``pg_stat_activity``,
    so the runner can count the database CPU each subject's requests cost."""
    return f"bench-{subject}"


class BarePool:
    """A minimal fork-aware pool of psycopg2 connections for the ``bare`` subject
    (and for the business work of the subjects that do not run the extension).

    Deliberately as cheap as the extension's own pool (a lock and a deque), so
    that the baseline is not slowed by a heavier pool than the subjects use:
    the ratios would then flatter the extension.
    """

    def __init__(self, dsn: str, max_idle: int = POOL_SIZE, label: str | None = None) -> None:
        self._dsn = dsn
        self._max_idle = max_idle
        #: The sessions' ``application_name``: bare's, or that of the subject using it.
        self._application_name = label or application_name(BASELINE)
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._idle: deque[psycopg2.extensions.connection] = deque()

    @contextmanager
    def connection(self) -> Iterator[psycopg2.extensions.connection]:
        """A connection in psycopg2's default (transactional) mode; given back
        idle, or closed if anything went wrong on it."""
        if self._pid != os.getpid():  # forked: the parent's sockets are not ours
            self._pid, self._idle = os.getpid(), deque()
        with self._lock:
            conn = self._idle.pop() if self._idle else None
        if conn is None or conn.closed:
            conn = psycopg2.connect(self._dsn, application_name=self._application_name)
        try:
            yield conn
        except BaseException:
            conn.close()
            raise
        with self._lock:
            if len(self._idle) < self._max_idle:
                self._idle.append(conn)
                return
        conn.close()


def read_charge() -> tuple[int, str]:
    """The business input; a malformed body is the client's 400 in every subject."""
    payload = request.get_json(force=True)
    return int(payload["amount"]), str(payload["currency"])


def insert_charge(pool: BarePool, amount: int, currency: str) -> int:
    """The business work without the extension: BEGIN / INSERT / COMMIT."""
    with pool.connection() as conn:
        with conn.cursor() as cur:  # psycopg2 sends BEGIN before the INSERT
            cur.execute(INSERT_CHARGE, (amount, currency))
            row = cur.fetchone()
        conn.commit()
    assert row is not None
    return int(row[0])


def created(row_id: int, amount: int, currency: str) -> Response:
    response = jsonify(id=row_id, amount=amount, currency=currency, status="succeeded")
    response.status_code = 201
    return response
