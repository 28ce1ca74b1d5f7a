"""Versioned plain-SQL migrations, safe when several processes start at once.

Files are named ``NNNN_description.sql`` and applied in order, each recorded
in ``idempotency_schema_migrations`` under ``<namespace>/<file name>``. The
whole run holds a transaction-level advisory lock, so gunicorn workers that
all migrate at start-up apply each file exactly once.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from importlib import resources
from pathlib import Path

import psycopg2.extensions

#: An arbitrary constant naming this project's migration lock.
ADVISORY_LOCK_ID = 0x1DE3_7E9C

_MIGRATION_NAME = re.compile(r"^\d{4}_[\w-]+\.sql$")

CREATE_LEDGER = """
CREATE TABLE IF NOT EXISTS idempotency_schema_migrations (
    name        text        PRIMARY KEY,
    applied_at  timestamptz NOT NULL DEFAULT now()
)
"""


def package_migrations() -> list[tuple[str, str]]:
    """The extension's own schema, shipped as package data."""
    files = resources.files("flask_idempotency").joinpath("schema")
    names = sorted(f.name for f in files.iterdir() if _MIGRATION_NAME.match(f.name))
    return [(f"flask_idempotency/{n}", files.joinpath(n).read_text("utf-8")) for n in names]


def directory_migrations(directory: str) -> list[tuple[str, str]]:
    path = Path(directory)
    if not path.is_dir():
        raise FileNotFoundError(f"migration directory {directory!r} does not exist")
    names = sorted(p.name for p in path.iterdir() if _MIGRATION_NAME.match(p.name))
    return [(f"{path.name}/{n}", (path / n).read_text("utf-8")) for n in names]


def all_migrations(extra_dirs: Sequence[str]) -> list[tuple[str, str]]:
    found = package_migrations()
    for directory in extra_dirs:
        found.extend(directory_migrations(directory))
    return found


def apply(conn: psycopg2.extensions.connection, migrations: Iterable[tuple[str, str]]) -> list[str]:
    """Apply what is missing in one transaction; return the names applied now."""
    applied_now: list[str] = []
    conn.autocommit = False
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT pg_advisory_xact_lock(%s)", (ADVISORY_LOCK_ID,))
            cur.execute(CREATE_LEDGER)
            cur.execute("SELECT name FROM idempotency_schema_migrations")
            done = {row[0] for row in cur.fetchall()}
            for name, sql in migrations:
                if name in done:
                    continue
                cur.execute(sql)
                cur.execute("INSERT INTO idempotency_schema_migrations (name) VALUES (%s)", (name,))
                applied_now.append(name)
        conn.commit()
    except BaseException:
        conn.rollback()
        raise
    finally:
        conn.autocommit = True
    return applied_now
