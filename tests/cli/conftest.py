"""Fixtures of the CLI tests: the app, and rows seeded in SQL with old timestamps.

Expiry and abandonment are staged by writing the timestamps a TTL or a dead
holder would have left (never by sleeping), in bulk with ``generate_series``.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator

import pytest
from click.testing import Result
from flask import Flask

from flask_idempotency.recovery import PAYLOAD_VERSION
from support.pg_query import query

from .app import create_app

#: ``n`` completed records whose TTL ended an hour ago.
SEED_EXPIRED = """
INSERT INTO idempotency_records (record_key, fingerprint, state, created_at, expires_at,
                                 completed_at, status_code)
SELECT sha256(convert_to('expired-' || i, 'UTF8')), '\\x00', 'completed',
       now() - interval '2 hours', now() - interval '1 hour', now() - interval '2 hours', 201
  FROM generate_series(1, %s) AS i
"""
#: ``n`` in-flight records of the /pay route whose holder died a minute ago.
SEED_ABANDONED = """
INSERT INTO idempotency_records (record_key, fingerprint, state, lock_token, lease_expires_at,
                                 expires_at, recovery)
SELECT sha256(convert_to('abandoned-' || i, 'UTF8')), '\\x00', 'processing', i,
       now() - interval '1 minute', now() + interval '1 day', %s
  FROM generate_series(1, %s) AS i
"""
#: ``n`` pending events, due now.
SEED_EVENTS = """
INSERT INTO idempotency_outbox (id, event_type, payload, expires_at)
SELECT 'evt_cli_' || i, 'cli.tested', jsonb_build_object('n', i), now() + interval '1 day'
  FROM generate_series(1, %s) AS i
"""


def count(database_url: str, table: str = "idempotency_records") -> int:
    return int(query(database_url, f"SELECT count(*) FROM {table}")[0][0])


def seed_expired(database_url: str, n: int) -> None:
    query(database_url, SEED_EXPIRED, (n,))


def seed_abandoned(database_url: str, n: int) -> None:
    payload = {
        "v": PAYLOAD_VERSION,
        "endpoint": "pay",
        "method": "POST",
        "root_url": "http://localhost/",
        "path": "/pay",
        "query": "",
        "content_type": "application/json",
        "body": base64.b64encode(b"{}").decode("ascii"),
        "data": None,
    }
    query(database_url, SEED_ABANDONED, (json.dumps(payload).encode(), n))


def seed_events(database_url: str, n: int) -> None:
    query(database_url, SEED_EVENTS, (n,))


def run(app: Flask, *args: str, input: str | None = None) -> Result:
    return app.test_cli_runner().invoke(args=["idempotency", *args], input=input)


@pytest.fixture
def cli_app(clean_db: str) -> Iterator[Flask]:
    """The CLI tests' app (``tests/cli/app.py``) on a clean database."""
    app = create_app(clean_db)
    yield app
    app.extensions["idempotency"].close()
