"""pytest plugin for apps that use flask-idempotency: ``pip install 'flask-idempotency[pytest]'``.

Registered under the ``pytest11`` entry point ``flask_idempotency``, so pytest
loads it wherever the package is installed. Loading it costs nothing beyond
the package itself: it adds a few options and defines fixtures, and nothing
happens until a test asks for a fixture by name. pytest-postgresql is not
imported here; the fixtures reach it through its own plugin when they run.

Fixtures:

``idempotency_database``
    A throwaway database with the extension's tables (an
    :class:`~flask_idempotency.testing.IdempotencyDatabase`; ``.dsn`` is its URL).
    A new one per test by default, cloned from a template migrated once per
    session; ``--idempotency-db-scope=session`` shares one for the session.
``idempotency_dsn``
    That database's URL, for ``IDEMPOTENCY_DATABASE_URL``.
``idempotency_live_server``
    ``idempotency_live_server(app)`` serves a Flask app on a threaded HTTP server
    in the test process; ``.url`` is where; stopped after the test.
``idempotency_postgresql``
    The PostgreSQL server (a pytest-postgresql executor): its ``postgresql_proc``
    (configured by its own ``--postgresql-*`` options and ``postgresql_*`` ini
    keys), or, with ``--idempotency-dsn`` (ini ``idempotency_dsn``, environment
    ``IDEMPOTENCY_TEST_DSN``), an existing server through its noproc factory.
    As root (a CI container), which PostgreSQL refuses, ``pg_ctl`` runs as an
    unprivileged account (``unprivileged.py``); a server that cannot be started
    fails in one line that names ``--idempotency-dsn``.
"""

from __future__ import annotations

import contextlib
import os
import types
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest

# Already loaded with the package (its __init__ exports from them); neither imports
# pytest-postgresql, psycopg2 or werkzeug's server before a function of it runs.
from flask_idempotency.testing import databases
from flask_idempotency.testing.live_server import LiveServer

if TYPE_CHECKING:
    from flask import Flask

#: Environment variable naming an existing server, as ``--idempotency-dsn`` does.
DSN_ENV = "IDEMPOTENCY_TEST_DSN"

#: The noproc fixture registered when a DSN is given.
NOPROC_FIXTURE = "idempotency_postgresql_noproc"

_SCOPES = ("function", "session")

_INSTALL_HINT = (
    "flask-idempotency's database fixtures need pytest-postgresql and its plugin: "
    "pip install 'flask-idempotency[pytest]' (and no -p no:pytest_postgresql)"
)

_dsn_key = pytest.StashKey[str]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("flask-idempotency", "flask-idempotency fixtures")
    # Each option's dest is argparse's, its long name with "_" for "-" (idempotency_dsn...).
    group.addoption(
        "--idempotency-dsn",
        metavar="DSN",
        help=(
            "PostgreSQL server for the idempotency_database fixture (its databases are "
            f"created and dropped there) instead of starting one; also ${DSN_ENV}"
        ),
    )
    group.addoption(
        "--idempotency-db-scope",
        choices=_SCOPES,
        help="a new idempotency_database per test (function, the default) or one per session",
    )
    parser.addini("idempotency_dsn", "as --idempotency-dsn", default="")
    parser.addini("idempotency_db_scope", "as --idempotency-db-scope", default="function")
    parser.addini(
        "idempotency_migration_dirs",
        "your own NNNN_name.sql directories, applied after the extension's migrations "
        "(relative to the ini file)",
        type="linelist",
        default=[],
    )


def pytest_configure(config: pytest.Config) -> None:
    dsn = config.stash[_dsn_key] = str(
        config.getoption("idempotency_dsn")
        or config.getini("idempotency_dsn")
        or os.environ.get(DSN_ENV, "")
    ).strip()
    if not dsn:
        return
    # An existing server was named: this run opted in, so pytest-postgresql is needed now.
    try:
        from pytest_postgresql import factories
    except ImportError:
        raise pytest.UsageError(f"--idempotency-dsn: {_INSTALL_HINT}") from None
    server = databases.noproc_arguments(dsn)
    holder = types.ModuleType("flask_idempotency.testing._noproc_fixture")
    fixture = factories.postgresql_noproc(**server, dbname=databases.base_name())
    setattr(holder, NOPROC_FIXTURE, fixture)
    config.pluginmanager.register(holder, "flask_idempotency_noproc")


def _database_scope(fixture_name: str, config: pytest.Config) -> Any:
    scope = str(config.getoption("idempotency_db_scope") or config.getini("idempotency_db_scope"))
    if scope not in _SCOPES:
        raise pytest.UsageError(f"idempotency_db_scope must be one of {_SCOPES}, not {scope!r}")
    return scope


@pytest.fixture(scope="session")
def idempotency_postgresql(request: pytest.FixtureRequest) -> Any:
    """The PostgreSQL server the idempotency databases live on (a pytest-postgresql executor)."""
    dsn = request.config.stash[_dsn_key]
    if dsn:
        import psycopg2

        # libpq's message names the host and port it tried, never the password.
        try:
            psycopg2.connect(dsn, connect_timeout=5).close()
        except psycopg2.Error as exc:  # fail, never skip: a CI run without its database is red
            reason = f"PostgreSQL is unreachable: {exc}"
            pytest.fail(f"--idempotency-dsn is set but unusable: {reason}", pytrace=False)
        return request.getfixturevalue(NOPROC_FIXTURE)
    if not request.config.pluginmanager.has_plugin("pytest_postgresql"):
        pytest.fail(_INSTALL_HINT, pytrace=False)
    from flask_idempotency.testing import unprivileged

    if unprivileged.running_as_root():
        _run_pg_ctl_unprivileged(request.config)
    try:
        return request.getfixturevalue("postgresql_proc")
    except Exception as exc:  # pg_ctl's own output went to the captured stderr
        reason = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
    pytest.fail(
        f"flask-idempotency: pytest-postgresql could not start PostgreSQL ({reason}); "
        f"{unprivileged.USE_A_SERVER}",
        pytrace=False,
    )


def _run_pg_ctl_unprivileged(config: pytest.Config) -> None:
    """As root, make pytest-postgresql's process fixture run ``pg_ctl`` through a
    wrapper that runs it as an unprivileged account (``unprivileged.py``); fail in
    one line when that cannot work."""
    import shutil

    from flask_idempotency.testing import unprivileged

    configured = config.getoption("postgresql_exec") or config.getini("postgresql_exec")
    pg_ctl = unprivileged.find_pg_ctl(str(configured or ""))
    if pg_ctl is None or unprivileged.is_script(pg_ctl):
        return  # pytest-postgresql's own error lists where it looked; a wrapper knows
    workdir = unprivileged.make_workdir()
    # After the session's fixtures, so after pytest-postgresql stopped the server.
    config.add_cleanup(lambda: shutil.rmtree(workdir, ignore_errors=True))
    try:
        config.option.postgresql_exec = unprivileged.wrapper_for(pg_ctl, workdir)
        return
    except unprivileged.CannotRunUnprivileged as exc:
        reason = str(exc)
    pytest.fail(reason, pytrace=False)  # (outside the except: no chained traceback)


@pytest.fixture(scope="session")
def idempotency_database_template(
    request: pytest.FixtureRequest, idempotency_postgresql: Any
) -> Iterator[str]:
    """Name of the session's template database: the extension's tables, migrated once."""
    server, config = idempotency_postgresql, request.config
    # idempotency_migration_dirs' entries are relative to the ini file (else the rootdir).
    base = config.inipath.parent if config.inipath is not None else config.rootpath
    extra_dirs = [str(base / entry) for entry in config.getini("idempotency_migration_dirs")]
    dsn = config.stash[_dsn_key] or None
    if dsn is not None:
        # pytest-postgresql's noproc factory made this template (with any postgresql_load).
        name, made = str(server.template_dbname), contextlib.nullcontext()
    else:
        # On its process fixture's server: a copy of its template (with any postgresql_load).
        name = f"{databases.base_name()}_tmpl"
        made = databases.janitor(server, name, getattr(server, "template_dbname", None))
    with made:
        databases.migrate(databases.dsn_for(server, name, dsn=dsn), extra_dirs)
        yield name


@pytest.fixture(scope=_database_scope)
def idempotency_database(
    request: pytest.FixtureRequest, idempotency_postgresql: Any, idempotency_database_template: str
) -> Iterator[databases.IdempotencyDatabase]:
    """A throwaway database with the extension's tables; ``.dsn`` is its URL."""
    server = idempotency_postgresql
    name = databases.next_name(databases.base_name())
    # Its drop at the end also ends the connections the app's pool still holds.
    with databases.janitor(server, name, idempotency_database_template):
        dsn = databases.dsn_for(server, name, dsn=request.config.stash[_dsn_key] or None)
        yield databases.IdempotencyDatabase(name=name, dsn=dsn)


@pytest.fixture(scope=_database_scope)
def idempotency_dsn(idempotency_database: databases.IdempotencyDatabase) -> str:
    """The URL of ``idempotency_database``: your app's ``IDEMPOTENCY_DATABASE_URL``."""
    return idempotency_database.dsn


@pytest.fixture
def idempotency_live_server() -> Iterator[Callable[[Flask], LiveServer]]:
    """Factory: ``idempotency_live_server(app)`` -> a started LiveServer (``.url``).

    A threaded HTTP server in this process, so concurrent requests really run
    concurrently; stopped at the end of the test.
    """
    with contextlib.ExitStack() as started:  # stops them, the last started first
        yield lambda app: started.enter_context(LiveServer(app))
