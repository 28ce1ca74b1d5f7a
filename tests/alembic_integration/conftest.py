"""Fixtures of the Alembic tests: the test's own database under both PostgreSQL
dialects SQLAlchemy offers, and a runner for real ``flask`` commands."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg2
import pytest
import sqlalchemy

HERE = Path(__file__).parent

Sql = Callable[[str], list[tuple[Any, ...]]]
Flask = Callable[..., str]


@pytest.fixture(params=["psycopg2", "psycopg"])
def driver(request: pytest.FixtureRequest) -> str:
    """SQLAlchemy's two PostgreSQL dialects: psycopg2, and psycopg (3)."""
    driver: str = request.param
    return driver


def sqlalchemy_url(dsn: str, driver: str) -> str:
    scheme, _, rest = dsn.partition("://")
    assert scheme in ("postgresql", "postgres"), dsn
    return f"postgresql+{driver}://{rest}"


@pytest.fixture
def engine(fresh_database_url: str, driver: str) -> Iterator[sqlalchemy.Engine]:
    engine = sqlalchemy.create_engine(sqlalchemy_url(fresh_database_url, driver))
    yield engine
    engine.dispose()


@pytest.fixture
def sql(fresh_database_url: str) -> Sql:
    """Run one statement on the test's database in a transaction of its own."""

    def run(query: str) -> list[tuple[Any, ...]]:
        conn = psycopg2.connect(fresh_database_url)
        try:
            with conn, conn.cursor() as cur:
                cur.execute(query)
                return cur.fetchall() if cur.description else []
        finally:
            conn.close()

    return run


#: The extension's tables and functions present in the database's current schema.
EXTENSION_OBJECTS = """
SELECT 'table', tablename::text FROM pg_tables
 WHERE schemaname = current_schema() AND tablename LIKE 'idempotency%'
UNION ALL
SELECT 'function', p.oid::regprocedure::text FROM pg_proc p
 WHERE p.pronamespace = current_schema()::regnamespace AND p.proname LIKE 'idempotency%'
ORDER BY 1, 2
"""


def flask_runner(app_dir: Path, database_url: str, driver: str) -> Flask:
    """``flask --app transfers_app ...`` in ``app_dir`` (where ``migrations/`` goes),
    on the test's database; returns its output, fails the test on a non-zero exit."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
        "TRANSFERS_DATABASE_URL": sqlalchemy_url(database_url, driver),
    }

    def run(*args: str, **extra_env: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "flask", "--app", "transfers_app", *args],
            cwd=app_dir,
            env={**env, **extra_env},
            capture_output=True,
            text=True,
            timeout=60,
        )
        output = done.stdout + done.stderr
        assert done.returncode == 0, f"flask {' '.join(args)} failed:\n{output}"
        return output

    return run
