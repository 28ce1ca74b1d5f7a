"""One SQL statement on a connection of its own, for tests that seed or inspect rows.

A test that stages rows (old timestamps, a lost holder), reads what the code
under test wrote, or changes a server setting does it beside the app, not
through it: on a new connection, in autocommit (its effect visible at once, and
``VACUUM`` or ``ALTER SYSTEM`` refuse a transaction block), closed before it
returns so that no test leaves a connection holding locks behind.
"""

from __future__ import annotations

import time
from typing import Any

import psycopg2


def query(database_url: str, statement: str, params: Any = None) -> list[tuple[Any, ...]]:
    """Run ``statement`` (with psycopg2 ``params``) at ``database_url``; its rows, or
    ``[]`` for a statement that returns none."""
    conn = psycopg2.connect(database_url)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            cur.execute(statement, params)
            return cur.fetchall() if cur.description else []
    finally:
        conn.close()


def terminate_sessions(database_url: str, application_name: str, timeout: float = 10.0) -> int:
    """End every PostgreSQL session labelled ``application_name``, as a restart of the
    server would, until none is left (``pg_terminate_backend`` only signals, and a
    session the app was opening meanwhile, its lease keeper's say, is ended too): its
    pools then hold connections that died while idle. How many sessions were ended."""
    ended: set[int] = set()
    deadline = time.monotonic() + timeout
    while True:
        alive = query(
            database_url,
            "SELECT pid, pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE application_name = %s",
            (application_name,),
        )
        if not alive:
            return len(ended)
        ended.update(int(pid) for pid, _ in alive)
        if time.monotonic() > deadline:
            raise AssertionError(f"sessions of {application_name} still alive")
        time.sleep(0.05)
