"""``upgrade_schema(op)`` / ``downgrade_schema(op)`` on Alembic's own connection, with
both dialects, against the ledger ``flask idempotency migrate`` keeps."""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg2
import pytest
import sqlalchemy
from alembic.migration import MigrationContext
from alembic.operations import Operations
from alembic.util import CommandError

from flask_idempotency.alembic import downgrade_schema, upgrade_schema
from flask_idempotency.store import migrations

from .conftest import EXTENSION_OBJECTS, Sql

PACKAGE_FILES = [name for name, _ in migrations.package_migrations()]


@contextmanager
def revision(engine: sqlalchemy.Engine) -> Iterator[Operations]:
    """``op`` as a revision's upgrade() sees it: in Alembic's transaction, which
    commits when the block ends."""
    with engine.begin() as conn:
        yield Operations(MigrationContext.configure(conn))


def cli_migrate(dsn: str) -> list[str]:
    """What ``flask idempotency migrate`` runs (PostgresStore.migrate)."""
    conn = psycopg2.connect(dsn)
    try:
        return migrations.apply(conn, migrations.all_migrations([]))
    finally:
        conn.close()


def test_upgrade_schema_creates_the_schema_and_the_cli_then_applies_nothing(
    engine: sqlalchemy.Engine, fresh_database_url: str, sql: Sql
) -> None:
    assert sql(EXTENSION_OBJECTS) == []
    with revision(engine) as op:
        assert upgrade_schema(op) == PACKAGE_FILES
    tables = {name for kind, name in sql(EXTENSION_OBJECTS) if kind == "table"}
    assert tables == migrations.TABLES  # TABLES names every table the files create
    assert cli_migrate(fresh_database_url) == []
    with revision(engine) as op:
        assert upgrade_schema(op) == []


def test_upgrade_schema_after_the_cli_applies_nothing(
    engine: sqlalchemy.Engine, fresh_database_url: str, sql: Sql
) -> None:
    assert cli_migrate(fresh_database_url) == PACKAGE_FILES
    before = sql(EXTENSION_OBJECTS)
    with revision(engine) as op:
        assert upgrade_schema(op) == []
    assert sql(EXTENSION_OBJECTS) == before


def test_upgrade_schema_rolls_back_with_alembics_transaction(
    engine: sqlalchemy.Engine, sql: Sql
) -> None:
    class RevisionFailed(Exception):
        pass

    with pytest.raises(RevisionFailed), revision(engine) as op:
        upgrade_schema(op)
        raise RevisionFailed  # a later step of the same revision fails
    assert sql(EXTENSION_OBJECTS) == []


def test_upgrade_schema_and_the_cli_share_the_lock(
    engine: sqlalchemy.Engine, fresh_database_url: str, sql: Sql
) -> None:
    """A ``flask idempotency migrate`` started while a revision applies the files
    waits for Alembic's commit, then finds nothing to do."""
    result: list[list[str]] = []
    with revision(engine) as op:
        upgrade_schema(op)
        cli = threading.Thread(target=lambda: result.append(cli_migrate(fresh_database_url)))
        cli.start()
        deadline = time.monotonic() + 10
        while not sql("SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"):
            assert time.monotonic() < deadline, "the CLI never waited for the lock"
            time.sleep(0.01)
    cli.join(timeout=10)
    assert result == [[]]


def test_downgrade_schema_removes_what_the_files_created(
    engine: sqlalchemy.Engine, sql: Sql
) -> None:
    with revision(engine) as op:
        upgrade_schema(op)
    assert sql(EXTENSION_OBJECTS) != []
    with revision(engine) as op:
        downgrade_schema(op)
    assert sql(EXTENSION_OBJECTS) == []
    with revision(engine) as op:  # and the schema can come back
        assert upgrade_schema(op) == PACKAGE_FILES


def test_downgrade_schema_keeps_the_applications_own_files(
    engine: sqlalchemy.Engine, sql: Sql, tmp_path: Path
) -> None:
    own = tmp_path / "billing"
    own.mkdir()
    (own / "0001_invoices.sql").write_text("CREATE TABLE invoices (id int PRIMARY KEY);")
    with revision(engine) as op:
        applied = upgrade_schema(op, extra_dirs=[str(own)])
    assert applied == [*PACKAGE_FILES, "billing/0001_invoices.sql"]
    with revision(engine) as op:
        downgrade_schema(op)
    assert sql(EXTENSION_OBJECTS) == [("table", "idempotency_schema_migrations")]
    assert sql("SELECT name FROM idempotency_schema_migrations") == [("billing/0001_invoices.sql",)]
    assert sql("SELECT count(*) FROM invoices") == [(0,)]


def test_offline_mode_is_refused() -> None:
    context = MigrationContext.configure(
        dialect_name="postgresql", opts={"as_sql": True, "output_buffer": io.StringIO()}
    )
    with pytest.raises(CommandError, match="offline"):
        upgrade_schema(Operations(context))
