"""Alembic and Flask-Migrate: the extension's schema next to an application's own.

Two things, both through Alembic's documented extension points:

- **Autogenerate leaves the extension's tables alone.** Importing this module
  adds a comparator to Alembic's global registry
  (``alembic.autogenerate.comparators``) that runs after Alembic's own and
  takes out every operation on the extension's tables. Without it,
  ``flask db migrate`` sees tables that no model declares and proposes to drop
  them. Nothing else is hidden: an application's own tables, and its own
  ``include_object`` / ``include_name`` hooks, work as before.
- **The extension's schema from the application's own history.** In a revision::

      from flask_idempotency.alembic import downgrade_schema, upgrade_schema

      def upgrade():
          upgrade_schema(op)

      def downgrade():
          downgrade_schema(op)

  applies the extension's SQL files inside Alembic's transaction, with the
  ledger and the lock ``flask idempotency migrate`` uses: either way may run
  first, and no file is ever applied twice.

Works with the ``postgresql+psycopg2://`` and ``postgresql+psycopg://`` dialects.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

import alembic.util
from alembic.autogenerate import comparators
from alembic.util import CommandError

from flask_idempotency.store import migrations

if TYPE_CHECKING:
    from alembic.autogenerate.api import AutogenContext
    from alembic.operations import Operations
    from alembic.operations.ops import UpgradeOps
    from sqlalchemy.engine.interfaces import DBAPICursor

log = logging.getLogger(__name__)


@functools.cache  # once per process: calling it again does nothing
def register_autogenerate_filter() -> None:
    """Make Alembic's autogenerate leave the extension's tables alone, in every
    migration environment of this process. Done when this module is imported;
    calling it again does nothing."""
    # Alembic >= 1.18 runs comparators by priority: LAST comes after its own. Before,
    # they run in the order registered, and Alembic registered its own when
    # alembic.autogenerate was imported.
    priority = getattr(alembic.util, "DispatchPriority", None)
    options = {} if priority is None else {"priority": priority.LAST}
    comparators.dispatch_for("schema", **options)(_leave_extension_tables_alone)


def _leave_extension_tables_alone(
    autogen_context: AutogenContext,
    upgrade_ops: UpgradeOps,
    schemas: Collection[str | None],
) -> None:
    """Take out what Alembic proposed for the extension's tables.

    Its tables live in the schema the extension connects to, which autogenerate
    calls ``None`` (its default schema; by name too when ``include_schemas`` is
    on). A table of the same name in another schema is someone else's.
    """
    dialect = autogen_context.dialect
    own_schemas = {None, dialect.default_schema_name if dialect is not None else None}
    # Every table-level operation (create, drop, ModifyTableOps and the index,
    # column and constraint operations it holds) carries table_name and schema.
    upgrade_ops.ops = [
        op
        for op in upgrade_ops.ops
        if getattr(op, "table_name", None) not in migrations.TABLES
        or getattr(op, "schema", None) not in own_schemas
    ]


def upgrade_schema(op: Operations, *, extra_dirs: Sequence[str] = ()) -> list[str]:
    """Apply the extension's migrations that are missing, then ``extra_dirs``',
    in the running Alembic revision's transaction; return the names applied.

    The same files, ledger (``idempotency_schema_migrations``) and advisory lock
    as ``flask idempotency migrate``, so the two agree. Call it from a new
    revision again after upgrading flask-idempotency to apply its new files.
    """
    with contextlib.closing(_cursor(op, "upgrade_schema")) as cursor:
        applied = migrations.apply_in_transaction(cursor, migrations.all_migrations(extra_dirs))
    for name in applied:
        log.info("applied %s", name)
    return applied


def downgrade_schema(op: Operations) -> None:
    """Drop the extension's tables, with every stored answer and pending event,
    and its functions, in the running Alembic revision's transaction: the
    downgrade of the revision that called :func:`upgrade_schema` first."""
    with contextlib.closing(_cursor(op, "downgrade_schema")) as cursor:
        migrations.drop_in_transaction(cursor)


def _cursor(op: Operations, caller: str) -> DBAPICursor:
    """A DB-API cursor on the revision's connection: psycopg2's or psycopg 3's,
    in the transaction Alembic began (it commits or rolls back)."""
    if op.get_context().as_sql:
        # The files are applied by what the ledger says is missing, which only
        # a database can tell.
        raise CommandError(
            f"{caller}() needs a database: it cannot run in offline (--sql) mode; "
            "run `flask idempotency migrate` against the database instead"
        )
    return op.get_bind().connection.cursor()


register_autogenerate_filter()
