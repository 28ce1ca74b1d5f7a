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
from typing import Any

#: An arbitrary constant naming this project's migration lock.
ADVISORY_LOCK_ID = 0x1DE3_7E9C

_MIGRATION_NAME = re.compile(r"^\d{4}_[\w-]+\.sql$")

CREATE_LEDGER = """
CREATE TABLE IF NOT EXISTS idempotency_schema_migrations (
    name        text        PRIMARY KEY,
    applied_at  timestamptz NOT NULL DEFAULT now()
)
"""


#: The tables the extension's schema creates, the ledger included. They belong to
#: these files, not to an application's models: Alembic's autogenerate leaves
#: them alone (flask_idempotency.alembic). tests/alembic checks the set against
#: what the files create on an empty database, so a new table cannot be missed.
TABLES = frozenset(
    {
        "idempotency_records",
        "idempotency_outbox",
        "idempotency_recovery_totals",
        "idempotency_heartbeats",
        "idempotency_deployment",
        "idempotency_schema_migrations",
    }
)

# What the extension's own files created (indexes go with their tables), for an
# Alembic revision's downgrade. The functions are named with their arguments:
# each overload is its own object. The ledger keeps the rows of an application's
# IDEMPOTENCY_MIGRATION_DIRS files; drop_in_transaction() drops it once empty.
DROP_SCHEMA = """
DROP TABLE IF EXISTS idempotency_outbox, idempotency_recovery_totals, idempotency_heartbeats,
    idempotency_deployment, idempotency_records;
DROP FUNCTION IF EXISTS
    idempotency_claim(bytea, bytea, bigint, double precision, double precision, bytea),
    idempotency_complete(bytea, bigint, smallint, jsonb, bytea),
    idempotency_checkpoint(bytea, bigint, text, jsonb),
    idempotency_claim_in_transaction(bytea, bigint, bigint),
    idempotency_claim_in_transaction_rw(bytea, bigint, bigint),
    idempotency_insert_completed(bytea, bytea, double precision, smallint, jsonb, bytea),
    idempotency_claim_v2(bytea, bytea, bigint, double precision, double precision, bytea, text,
                         boolean),
    idempotency_complete_v2(bytea, bigint, smallint, jsonb, bytea, text),
    idempotency_insert_completed_v2(bytea, bytea, double precision, smallint, jsonb, bytea, text);
DELETE FROM idempotency_schema_migrations WHERE starts_with(name, 'flask_idempotency/');
"""


def _files(folder: Any, prefix: str) -> list[tuple[str, str]]:
    """The migration files in ``folder`` (a directory or package data), in order."""
    names = sorted(f.name for f in folder.iterdir() if _MIGRATION_NAME.match(f.name))
    return [(f"{prefix}/{n}", folder.joinpath(n).read_text("utf-8")) for n in names]


def package_migrations() -> list[tuple[str, str]]:
    """The extension's own schema, shipped as package data."""
    return _files(resources.files("flask_idempotency").joinpath("schema"), "flask_idempotency")


def all_migrations(extra_dirs: Sequence[str]) -> list[tuple[str, str]]:
    """The extension's files, then each of ``extra_dirs``' (``IDEMPOTENCY_MIGRATION_DIRS``)."""
    found = package_migrations()
    for directory in map(Path, extra_dirs):
        if not directory.is_dir():
            raise FileNotFoundError(f"migration directory {str(directory)!r} does not exist")
        found.extend(_files(directory, directory.name))
    return found


def apply(conn: Any, migrations: Iterable[tuple[str, str]]) -> list[str]:
    """Apply what is missing in one transaction, opened and committed here on a
    connection (of either driver) left in autocommit mode; return the names applied
    now. A failure leaves the transaction open: closing the connection rolls it
    back (the store's pool discards a connection given back in a transaction)."""
    conn.autocommit = True  # (the store's pool lends it so; a fresh one is not)
    with conn.cursor() as cur:
        cur.execute("BEGIN")
        applied_now = apply_in_transaction(cur, migrations)
        cur.execute("COMMIT")
    return applied_now


#: Which of the ledger (whether any migrate ran yet) and the records table exist
#: (``NULL`` from ``to_regclass`` when not).
PRESENCE = (
    "SELECT to_regclass('idempotency_schema_migrations') IS NOT NULL,"
    " to_regclass('idempotency_records') IS NOT NULL"
)


def pending(cur: Any, names: list[str]) -> list[str]:
    """The migration ``names`` the database has not applied (all of them before the
    first migrate), read without taking the migration lock."""
    cur.execute(PRESENCE)
    done = applied(cur) if cur.fetchall()[0][0] else set()
    return [name for name in names if name not in done]


def applied(cur: Any) -> set[str]:
    """The names the ledger holds (which exists)."""
    cur.execute("SELECT name FROM idempotency_schema_migrations")
    return {row[0] for row in cur.fetchall()}


def apply_in_transaction(cur: Any, migrations: Iterable[tuple[str, str]]) -> list[str]:
    """Apply what is missing on ``cur``, inside the transaction its connection is
    already in (the caller commits or rolls back); return the names applied now.

    ``flask idempotency migrate`` and an application's Alembic revision
    (``flask_idempotency.alembic.upgrade_schema``) both come here: one ledger,
    one lock, so neither applies a file the other did. The schema files hold
    several statements and no parameters, which psycopg 3 runs in one
    ``execute`` as psycopg2 does (without parameters it uses the simple query
    protocol).
    """
    applied_now: list[str] = []
    cur.execute("SELECT pg_advisory_xact_lock(%s)", (ADVISORY_LOCK_ID,))
    cur.execute(CREATE_LEDGER)
    done = applied(cur)
    for name, sql in migrations:
        if name in done:
            continue
        cur.execute(sql)
        cur.execute("INSERT INTO idempotency_schema_migrations (name) VALUES (%s)", (name,))
        applied_now.append(name)
    return applied_now


def drop_in_transaction(cur: Any) -> None:
    """Drop what the extension's files created, and their ledger rows, inside the
    transaction ``cur``'s connection is in. The ledger itself goes when no
    application file is left in it."""
    cur.execute("SELECT pg_advisory_xact_lock(%s)", (ADVISORY_LOCK_ID,))
    cur.execute(CREATE_LEDGER)
    cur.execute(DROP_SCHEMA)
    cur.execute("SELECT count(*) FROM idempotency_schema_migrations")
    if cur.fetchall()[0][0] == 0:
        cur.execute("DROP TABLE idempotency_schema_migrations")
