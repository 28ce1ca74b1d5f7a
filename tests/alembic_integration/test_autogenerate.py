"""Alembic's autogenerate, in process, with the filter ``flask_idempotency.alembic``
registers on import: nothing on the extension's tables, everything else as before."""

from __future__ import annotations

from typing import Any

import psycopg2
import sqlalchemy
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from flask_idempotency.alembic import register_autogenerate_filter
from flask_idempotency.store import migrations

from .conftest import Sql

METADATA = sqlalchemy.MetaData()
sqlalchemy.Table(
    "transfer", METADATA, sqlalchemy.Column("id", sqlalchemy.Integer, primary_key=True)
)


def diff(engine: sqlalchemy.Engine, **opts: Any) -> list[Any]:
    with engine.connect() as conn:
        changes: list[Any] = compare_metadata(MigrationContext.configure(conn, opts=opts), METADATA)
        return changes


def tables_in(changes: list[Any]) -> set[tuple[str, str | None, str]]:
    return {(change[0], change[1].schema, change[1].name) for change in changes}


def test_the_extensions_tables_are_left_alone_and_the_applications_are_not(
    engine: sqlalchemy.Engine, fresh_database_url: str, sql: Sql
) -> None:
    conn = psycopg2.connect(fresh_database_url)
    migrations.apply(conn, migrations.package_migrations())
    conn.close()
    sql("CREATE TABLE orphan (id int)")  # the application's, declared by no model
    assert tables_in(diff(engine)) == {
        ("add_table", None, "transfer"),
        ("remove_table", None, "orphan"),
    }


def test_a_table_of_the_same_name_in_another_schema_is_not_the_extensions(
    engine: sqlalchemy.Engine, sql: Sql
) -> None:
    sql("CREATE SCHEMA archive; CREATE TABLE archive.idempotency_records (id int)")
    assert tables_in(diff(engine, include_schemas=True)) == {
        ("add_table", None, "transfer"),
        ("remove_table", "archive", "idempotency_records"),
    }


def test_registering_again_changes_nothing(engine: sqlalchemy.Engine, sql: Sql) -> None:
    register_autogenerate_filter()
    register_autogenerate_filter()
    sql("CREATE TABLE idempotency_records (id int); CREATE TABLE orphan (id int)")
    assert tables_in(diff(engine)) == {
        ("add_table", None, "transfer"),
        ("remove_table", None, "orphan"),
    }
