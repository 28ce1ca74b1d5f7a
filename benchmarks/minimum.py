"""The ``minimum-pg+redis`` subject: a hand-written PostgreSQL-first idempotency layer.

The floor of a durable design, written plainly so that anyone can check it
does nothing clever. The key is claimed in PostgreSQL and committed before
the business work starts; the stored response is written in the same
transaction as the business row; Redis only caches completed responses.
Per first request:

1. Redis ``GET`` of the key (a miss);
2. the claim: ``INSERT ... ON CONFLICT DO NOTHING``, committed on its own
   (autocommit, so the server commits it durably; no ``synchronous_commit``
   setting);
3. the business transaction: ``BEGIN``, the charge's ``INSERT``, the
   completion ``UPDATE`` of the key's row, ``COMMIT``;
4. Redis ``SET`` of the response.

A replay is one Redis ``GET``. When Redis lacks the entry, the claim finds the
row: a completed one is replayed (and put back in Redis), one still in flight
is a 409, a different body under the key a 422. A failed business
transaction deletes the claim, so a retry runs again.

Left out, and all of it would only add cost: a lease (a worker killed between
the claim and the business commit leaves its key answering 409 until someone
deletes the row), expiry of old keys, scopes (keys are global, as with the
extension's ``global_scope`` in the benchmark), and any handling of a Redis or
PostgreSQL outage beyond the error itself.
"""

from __future__ import annotations

import hashlib
import json

import psycopg2.extensions
import redis
from flask import Flask, Response, request

from .charge import (
    CHARGES_PATH,
    INSERT_CHARGE,
    REDIS_PREFIX,
    BarePool,
    application_name,
    read_charge,
)

SUBJECT = "minimum-pg+redis"

KEYS_TABLE = """
CREATE TABLE IF NOT EXISTS bench_minimum_keys (
    key          text        PRIMARY KEY,
    fingerprint  text        NOT NULL,
    status       integer,    -- NULL while the first request is in flight
    body         text,
    created_at   timestamptz NOT NULL DEFAULT now()
)
"""
CLAIM = (
    "INSERT INTO bench_minimum_keys (key, fingerprint) VALUES (%s, %s) "
    "ON CONFLICT (key) DO NOTHING RETURNING true"
)
LOOKUP = "SELECT fingerprint, status, body FROM bench_minimum_keys WHERE key = %s"
COMPLETE = "UPDATE bench_minimum_keys SET status = %s, body = %s WHERE key = %s"
RELEASE = "DELETE FROM bench_minimum_keys WHERE key = %s AND status IS NULL"

#: Seconds a response is kept in Redis (a day, as the extension's default TTL).
CACHE_TTL = 86_400
KEY_HEADER = "Idempotency-Key"
REPLAYED_HEADER = "Idempotent-Replayed"


def create_table(conn: psycopg2.extensions.connection) -> None:
    with conn, conn.cursor() as cur:
        cur.execute(KEYS_TABLE)


def _answer(status: int, body: str, replayed: bool) -> Response:
    response = Response(body, status=status, mimetype="application/json")
    response.headers[REPLAYED_HEADER] = "true" if replayed else "false"
    return response


def _problem(status: int, detail: str) -> Response:
    return Response(json.dumps({"detail": detail}), status=status, mimetype="application/json")


def register(app: Flask, dsn: str, redis_url: str) -> None:
    """Add the subject's ``POST /charges`` to ``app``."""
    pool = BarePool(dsn, label=application_name(SUBJECT))
    cache: redis.Redis[bytes] = redis.Redis.from_url(redis_url)

    @app.post(CHARGES_PATH)
    def minimum_charge() -> Response:
        key = request.headers.get(KEY_HEADER)
        if not key:
            return _problem(400, f"{KEY_HEADER} is required")
        fingerprint = hashlib.sha256(request.get_data()).hexdigest()
        cache_key = f"{REDIS_PREFIX}:minimum:{key}"

        # 1. Redis: a completed response is answered from here.
        cached = cache.get(cache_key)
        if cached is not None:
            entry = json.loads(cached)
            if entry["fingerprint"] != fingerprint:
                return _problem(422, "this key was used with a different request body")
            return _answer(entry["status"], entry["body"], replayed=True)

        amount, currency = read_charge()
        with pool.connection() as conn:
            # 2. The claim, committed on its own.
            conn.autocommit = True
            with conn.cursor() as cur:
                cur.execute(CLAIM, (key, fingerprint))
                claimed = cur.fetchone() is not None
                if not claimed:
                    cur.execute(LOOKUP, (key,))
                    row = cur.fetchone()
            if not claimed:
                if row is None:  # deleted since: its first request failed
                    return _problem(409, "a request with this key just failed; retry")
                stored_fingerprint, status, body = row
                if stored_fingerprint != fingerprint:
                    return _problem(422, "this key was used with a different request body")
                if status is None:
                    return _problem(409, "a request with this key is in progress")
                entry = {"fingerprint": fingerprint, "status": status, "body": body}
                cache.set(cache_key, json.dumps(entry), ex=CACHE_TTL)
                return _answer(status, body, replayed=True)

            # 3. The business transaction, with the completion.
            try:
                conn.autocommit = False
                with conn.cursor() as cur:  # psycopg2 sends BEGIN before the INSERT
                    cur.execute(INSERT_CHARGE, (amount, currency))
                    charge = cur.fetchone()
                    assert charge is not None
                    body = json.dumps(
                        {"id": charge[0], "amount": amount, "currency": currency,
                         "status": "succeeded"}
                    )  # fmt: skip
                    cur.execute(COMPLETE, (201, body, key))
                conn.commit()
            except BaseException:
                conn.rollback()
                conn.autocommit = True
                with conn.cursor() as cur:
                    cur.execute(RELEASE, (key,))
                raise

        # 4. Redis, after the commit.
        entry = {"fingerprint": fingerprint, "status": 201, "body": body}
        cache.set(cache_key, json.dumps(entry), ex=CACHE_TTL)
        return _answer(201, body, replayed=False)
