"""Throwaway databases with the extension's tables, on a pytest-postgresql server.

The plugin's fixtures create them with pytest-postgresql's ``DatabaseJanitor``
on whichever server its process fixture (``postgresql_proc``) started, or the
one its noproc factory points at: first a template database migrated once
(``flask_idempotency.store.migrations``, plus your own migration directories),
then a copy of it per test (or per session), dropped afterwards.

pytest-postgresql is imported inside the functions that need it, never when
this module is imported.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

_counter = itertools.count(1)


def base_name() -> str:
    """A database name prefix unique to this process (and so to each xdist worker)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    return f"idempotency_{os.getpid()}{'_' + worker if worker else ''}"


def next_name(base: str) -> str:
    return f"{base}_{next(_counter)}"


def noproc_arguments(dsn: str) -> dict[str, Any]:
    """pytest-postgresql's noproc factory arguments for the server ``dsn`` names."""
    import psycopg2.extensions

    params = psycopg2.extensions.parse_dsn(dsn)
    arguments: dict[str, Any] = {
        "host": params.get("host") or "localhost",
        "port": int(params.get("port") or 5432),
        "user": params.get("user") or "postgres",
        "password": params.get("password"),
    }
    if params.get("options"):
        arguments["options"] = params["options"]
    return arguments


def dsn_for(server: Any, dbname: str, *, dsn: str | None = None) -> str:
    """A libpq URL of database ``dbname`` on ``server`` (a pytest-postgresql executor).

    With ``dsn`` (the server named by ``--idempotency-dsn``) that DSN with only its
    database replaced, so its other parameters (``sslmode``...) are kept.
    """
    if dsn is not None:
        if "://" in dsn:
            return urlunsplit(urlsplit(dsn)._replace(path="/" + quote(dbname, safe="")))
        import psycopg2.extensions

        return str(psycopg2.extensions.make_dsn(dsn, dbname=dbname))
    user = quote(str(server.user), safe="")
    password = f":{quote(str(server.password), safe='')}" if server.password else ""
    host = str(server.host)
    query = ""
    if host.startswith("/"):  # a Unix socket directory
        query, host = f"?host={quote(host, safe='/')}", ""
    elif ":" in host:
        host = f"[{host}]"
    if server.options:
        query += ("&" if query else "?") + f"options={quote(str(server.options), safe='')}"
    return f"postgresql://{user}{password}@{host}:{server.port}/{quote(dbname, safe='')}{query}"


def migrate(dsn: str, extra_dirs: Sequence[str] = ()) -> list[str]:
    """Apply the extension's migrations, then ``extra_dirs``', to the database ``dsn``."""
    import psycopg2

    from flask_idempotency.store import migrations

    with contextlib.closing(psycopg2.connect(dsn)) as conn:
        return migrations.apply(conn, migrations.all_migrations(list(extra_dirs)))


def janitor(server: Any, dbname: str, template: str | None = None) -> Any:
    """pytest-postgresql's ``DatabaseJanitor`` for ``dbname`` (a copy of ``template``)."""
    from pytest_postgresql.janitor import DatabaseJanitor

    kwargs: dict[str, Any] = {"dbname": dbname, "template_dbname": template}
    # The server's connection parameters: the janitor takes them under the same names.
    kwargs.update((name, getattr(server, name)) for name in ("user", "host", "port", "password"))
    # Older pytest-postgresql releases require the server version; newer ones deprecate it.
    version = inspect.signature(DatabaseJanitor).parameters.get("version")
    if version is not None and version.default is inspect.Parameter.empty:
        kwargs["version"] = server.version
    return DatabaseJanitor(**kwargs)


@dataclass(frozen=True)
class IdempotencyDatabase:
    """A database of the test's own, with the extension's tables.

    ``dsn`` is a libpq URL: give it to your app as ``IDEMPOTENCY_DATABASE_URL``.
    """

    name: str
    dsn: str

    def connect(self) -> Any:
        """A new psycopg2 connection to this database (close it yourself)."""
        import psycopg2

        return psycopg2.connect(self.dsn)

    def records(self) -> list[tuple[str, int | None]]:
        """``(state, status_code)`` of every idempotency record, oldest first."""
        with contextlib.closing(self.connect()) as conn, conn.cursor() as cur:
            cur.execute("SELECT state, status_code FROM idempotency_records ORDER BY created_at")
            return [(str(state), status) for state, status in cur.fetchall()]

    def __repr__(self) -> str:
        return f"<IdempotencyDatabase {self.name}>"
