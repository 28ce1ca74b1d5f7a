"""A real Flask-Migrate run: ``flask db init / migrate / upgrade / downgrade`` and
``flask idempotency migrate`` as subprocesses, on a Flask-SQLAlchemy application
(transfers_app.py) that uses the extension, in the test's own database."""

from __future__ import annotations

import re
from pathlib import Path

from flask_idempotency.store import migrations

from .conftest import EXTENSION_OBJECTS, Sql, flask_runner

#: A revision as the docs show it, generated with `flask db revision` and filled in.
SCHEMA_REVISION = '''\
"""flask-idempotency schema"""
from alembic import op

from flask_idempotency.alembic import downgrade_schema, upgrade_schema

revision = "0a1d3e9c0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade():
    upgrade_schema(op)


def downgrade():
    downgrade_schema(op)
'''


def revisions(app_dir: Path) -> dict[str, str]:
    versions = app_dir / "migrations" / "versions"
    return {path.name: path.read_text() for path in versions.glob("*.py")}


def new_revision(app_dir: Path, before: dict[str, str]) -> str:
    (name,) = set(revisions(app_dir)) - set(before)
    return revisions(app_dir)[name]


def upgrade_body(revision: str) -> str:
    match = re.search(r"def upgrade\(\):\n(.*?)\n\ndef downgrade", revision, re.S)
    assert match, revision
    return match.group(1)


def test_autogenerate_proposes_nothing_on_the_extensions_tables(
    tmp_path: Path, fresh_database_url: str, sql: Sql
) -> None:
    flask = flask_runner(tmp_path, fresh_database_url, "psycopg")
    flask("idempotency", "migrate")
    assert {n for kind, n in sql(EXTENSION_OBJECTS) if kind == "table"} == migrations.TABLES
    # The application's tables that no model declares: one its include_object
    # hides (transfers_app.py), one autogenerate must still propose to drop.
    sql("CREATE TABLE legacy_ledger (id int); CREATE TABLE orphan (id int)")
    flask("db", "init")

    flask("db", "migrate", "-m", "transfers")
    (first,) = revisions(tmp_path).values()
    ops = upgrade_body(first)
    assert "op.create_table('transfer'" in ops
    assert "op.drop_table('orphan')" in ops
    assert "legacy_ledger" not in first
    assert "idempotency_" not in first  # no drop_table, no drop_index, in either direction

    flask("db", "upgrade")
    assert "No changes in schema detected." in flask("db", "migrate")

    before = revisions(tmp_path)
    flask("db", "migrate", "-m", "memo", TRANSFERS_MEMO="1")
    memo = new_revision(tmp_path, before)
    assert "add_column(sa.Column('memo'" in upgrade_body(memo)
    assert "idempotency_" not in memo


def test_the_schema_from_the_applications_alembic_history(
    tmp_path: Path, fresh_database_url: str, sql: Sql
) -> None:
    # psycopg2 here, psycopg (3) above: test_upgrade_schema.py runs both on each.
    flask = flask_runner(tmp_path, fresh_database_url, "psycopg2")
    flask("db", "init")
    (tmp_path / "migrations" / "versions" / "0a1d3e9c0001_idempotency.py").write_text(
        SCHEMA_REVISION
    )
    flask("db", "upgrade")
    assert {n for kind, n in sql(EXTENSION_OBJECTS) if kind == "table"} == migrations.TABLES
    assert "0 migration(s) applied" in flask("idempotency", "migrate")

    before = revisions(tmp_path)
    flask("db", "migrate", "-m", "transfers")
    transfers = new_revision(tmp_path, before)
    assert "op.create_table('transfer'" in upgrade_body(transfers)
    assert "idempotency_" not in transfers

    flask("db", "downgrade", "base")
    assert sql(EXTENSION_OBJECTS) == []
