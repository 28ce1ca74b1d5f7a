"""One SQL statement on a connection of its own, for tests that seed or inspect rows.

A test that stages rows (old timestamps, a lost holder), reads what the code
under test wrote, or changes a server setting does it beside the app, not
through it: on a new connection, in autocommit (its effect visible at once, and
``VACUUM`` or ``ALTER SYSTEM`` refuse a transaction block), closed before it
returns so that no test leaves a connection holding locks behind.
"""

from __future__ import annotations

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
