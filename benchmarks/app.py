"""The benchmark's application: one tiny payment endpoint, built once per subject.

Every subject does the same business work - parse the JSON body, INSERT one
row in PostgreSQL inside a transaction, answer 201 with a small JSON body - so
that the only difference between two subjects is what idempotency adds:

``bare``
    no idempotency; the row is written on a connection from a small
    per-process pool with BEGIN / INSERT / COMMIT (three round trips, exactly
    the business round trips the extension's subjects make through
    ``idempotency.connection()``).
``pg``
    the extension, PostgreSQL only, as configured by default (the claim commits
    with ``synchronous_commit = off``).
``pg+redis``
    the extension with the Redis cache of completed responses.
``pg-synccommit``
    ``pg`` with ``IDEMPOTENCY_DATABASE_OPTIONS["async_claim_commit"]`` off: the claim
    commits durably on its own. It exists to put a number on that setting.
``pg+redis-fill-on-completion``
    ``pg+redis`` with ``IDEMPOTENCY_REDIS_OPTIONS["fill"] = "completion"`` (the default
    before 0.3): a SET on every first request. Not in the default run; name it
    with ``--subjects``.
``pg-txclaim``, ``pg+redis-txclaim``
    ``pg`` and ``pg+redis`` with ``IDEMPOTENCY_CLAIM_MODE = "transaction"``
    (the claim inside the business transaction, one commit per request).
    Unavailable in a checkout whose library lacks that setting.
``minimum-pg+redis``
    a hand-written PostgreSQL-first layer, the floor of a durable design
    (``benchmarks.minimum``).
``sqla-bare``, ``sqla-pg``, ``sqla-pg-txclaim``, ``sqla-handwritten``
    the same view on Flask-SQLAlchemy's ``db.session``: without idempotency,
    with ``Idempotency(app, db=db)``, and a hand-written idempotency layer in
    one transaction (``benchmarks.sqla``). ``sqla-bare`` is their baseline.
``idemkit-pg``, ``flask-once-redis``, ``powertools-redis``
    other idempotency layers from the package index, each wired as its own
    documentation says (``benchmarks.peers``). Benchmark-only dependencies:
    ``pip install -r benchmarks/requirements-peers.txt`` (``make bench`` does).

The load generator is every subject's one client and sends no credentials, so
the extension's subjects choose the one global scope
(``IDEMPOTENCY_SCOPE_FUNC = global_scope``), as a single-principal app would;
under the default scope function such requests are refused (``missing_scope``).

gunicorn builds an app with ``benchmarks.app:create_app("pg")``; the server's
addresses come from ``BENCH_DATABASE_URL`` and ``BENCH_REDIS_URL``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import Collection, Iterable, Mapping
from importlib.metadata import PackageNotFoundError, version
from importlib.util import find_spec
from typing import Any

import psycopg2
import psycopg2.errors
import psycopg2.extensions
from flask import Flask, Response

from flask_idempotency import Idempotency, global_scope
from flask_idempotency.settings import Settings

from .charge import BASELINE as BASELINE
from .charge import BUSINESS_TABLE as BUSINESS_TABLE
from .charge import CHARGES_PATH as CHARGES_PATH
from .charge import DEFAULT_DATABASE_URL as DEFAULT_DATABASE_URL
from .charge import DEFAULT_REDIS_URL as DEFAULT_REDIS_URL
from .charge import HEALTH_PATH as HEALTH_PATH
from .charge import INSERT_CHARGE as INSERT_CHARGE
from .charge import POOL_SIZE as POOL_SIZE
from .charge import REDIS_PREFIX as REDIS_PREFIX
from .charge import REQUEST_BODY as REQUEST_BODY
from .charge import BarePool as BarePool
from .charge import application_name as application_name
from .charge import created as created
from .charge import database_url as database_url
from .charge import insert_charge as insert_charge
from .charge import read_charge as read_charge
from .charge import redis_url as redis_url

#: The subjects, in the order the report lists them; ``bare`` is the baseline.
SUBJECTS: tuple[str, ...] = (
    "bare",
    "pg",
    "pg+redis",
    "pg-synccommit",
    "pg+redis-fill-on-completion",
    "pg-txclaim",
    "pg+redis-txclaim",
    "minimum-pg+redis",
    "sqla-bare",
    "sqla-pg",
    "sqla-pg-txclaim",
    "sqla-handwritten",
    "idemkit-pg",
    "flask-once-redis",
    "powertools-redis",
)
#: What ``python -m benchmarks`` runs unless told otherwise: the baseline, the
#: extension's default configurations, the hand-written minimum and the peers.
DEFAULT_SUBJECTS: tuple[str, ...] = (
    "bare",
    "pg",
    "pg+redis",
    # The transaction claim mode (IDEMPOTENCY_CLAIM_MODE = "transaction").
    "pg-txclaim",
    "pg+redis-txclaim",
    "minimum-pg+redis",
    # The same view on Flask-SQLAlchemy: its baseline, the extension, by hand.
    "sqla-bare",
    "sqla-pg",
    "sqla-handwritten",
    "idemkit-pg",
    "flask-once-redis",
    # powertools-redis joins with --subjects: two peers keep the run near 18 minutes.
)
#: Subjects that run the extension (``subject_config`` configures them): named
#: after the store, ``pg`` and its variants. The other layers' names end in theirs.
EXTENSION_SUBJECTS = frozenset(subject for subject in SUBJECTS if subject.startswith("pg"))
#: Subjects that set ``IDEMPOTENCY_CLAIM_MODE = "transaction"``.
TXCLAIM_SUBJECTS = frozenset({"pg-txclaim", "pg+redis-txclaim"})
MINIMUM = "minimum-pg+redis"
#: The Flask-SQLAlchemy subjects (``benchmarks.sqla``); the first is their baseline.
SQLA_SUBJECTS: tuple[str, ...] = ("sqla-bare", "sqla-pg", "sqla-pg-txclaim", "sqla-handwritten")
SQLA_BASELINE = "sqla-bare"
SQLA_REQUIREMENT = "flask-sqlalchemy"
#: Peers from the package index: subject -> (module it needs, pinned requirement).
PEERS: dict[str, tuple[str, str]] = {
    "idemkit-pg": ("idemkit", "idemkit[postgres]"),
    "flask-once-redis": ("flask_once", "flask-once"),
    "powertools-redis": ("aws_lambda_powertools", "aws-lambda-powertools[redis,aws-sdk]"),
}
#: Subjects that use Redis (and so need it).
REDIS_SUBJECTS = frozenset(
    {
        "pg+redis",
        "pg+redis-fill-on-completion",
        "pg+redis-txclaim",
        "minimum-pg+redis",
        "flask-once-redis",
        "powertools-redis",
    }
)
#: Of those, the extension's (they also need its cache module).
EXTENSION_REDIS_SUBJECTS = REDIS_SUBJECTS & EXTENSION_SUBJECTS
PEERS_REQUIREMENTS = "benchmarks/requirements-peers.txt"


def claim_mode_available() -> bool:
    """Whether this checkout's extension has ``IDEMPOTENCY_CLAIM_MODE``."""
    return "claim_mode" in {field.name for field in dataclasses.fields(Settings)}


def unavailable(subject: str) -> str | None:
    """Why ``subject`` cannot run in this checkout or environment (None: it can)."""
    if subject not in SUBJECTS:
        return f"unknown subject {subject!r}; choose from {', '.join(SUBJECTS)}"
    if subject in EXTENSION_REDIS_SUBJECTS and find_spec("flask_idempotency.cache.redis") is None:
        return f"{subject}: flask_idempotency/cache/redis.py is not in this checkout"
    if subject in TXCLAIM_SUBJECTS and not claim_mode_available():
        return (
            f"{subject}: this checkout's extension has no IDEMPOTENCY_CLAIM_MODE "
            "(flask_idempotency.settings.Settings has no claim_mode field)"
        )
    if subject in SQLA_SUBJECTS and find_spec("flask_sqlalchemy") is None:
        return (
            f"{subject}: {SQLA_REQUIREMENT} is not installed "
            f"(pip install -r {PEERS_REQUIREMENTS}; make bench does)"
        )
    if subject == "sqla-pg-txclaim" and not claim_mode_available():
        return f"{subject}: this checkout's extension has no IDEMPOTENCY_CLAIM_MODE"
    if subject in PEERS:
        module, requirement = PEERS[subject]
        if find_spec(module) is None:
            return (
                f"{subject}: {requirement} is not installed "
                f"(pip install -r {PEERS_REQUIREMENTS}; make bench does)"
            )
    return None


def peer_versions(subjects: Iterable[str]) -> dict[str, str]:
    """Installed version of each peer among ``subjects``, by distribution name."""
    found = {}
    for subject in subjects:
        if subject in PEERS:
            distribution = PEERS[subject][1].split("[")[0]
            try:
                found[distribution] = version(distribution)
            except PackageNotFoundError:
                found[distribution] = "not installed"
    return found


def subject_config(subject: str, dsn: str, redis: str) -> dict[str, Any]:
    """The ``IDEMPOTENCY_*`` configuration of an extension subject."""
    if subject not in EXTENSION_SUBJECTS:
        raise ValueError(f"not an extension subject: {subject!r}")
    database: dict[str, Any] = {
        "pool_size": POOL_SIZE,
        "application_name": application_name(subject),  # a libpq parameter
    }
    if subject == "pg-synccommit":
        database["async_claim_commit"] = False
    config: dict[str, Any] = {
        "IDEMPOTENCY_DATABASE_URL": dsn,
        "IDEMPOTENCY_DATABASE_OPTIONS": database,
        "IDEMPOTENCY_SCOPE_FUNC": global_scope,
    }
    if subject in REDIS_SUBJECTS:
        config["IDEMPOTENCY_REDIS_URL"] = redis
        config["IDEMPOTENCY_REDIS_OPTIONS"] = {"prefix": REDIS_PREFIX}
    if subject == "pg+redis-fill-on-completion":
        config["IDEMPOTENCY_REDIS_OPTIONS"]["fill"] = "completion"
    if subject in TXCLAIM_SUBJECTS:
        config["IDEMPOTENCY_CLAIM_MODE"] = "transaction"
    return config


def create_app(subject: str | None = None, config: Mapping[str, Any] | None = None) -> Flask:
    """The app of one subject (``BENCH_SUBJECT`` when not given).

    ``config`` overrides the subject's configuration (the round-trip test and
    the profiler pass their own).
    """
    subject = subject or os.environ.get("BENCH_SUBJECT", "")
    if subject not in SUBJECTS:
        raise ValueError(f"unknown subject {subject!r}; choose from {', '.join(SUBJECTS)}")
    if (reason := unavailable(subject)) is not None:
        raise RuntimeError(f"subject unavailable: {reason}")
    app = Flask(__name__)
    app.config["BENCH_SUBJECT"] = subject
    # The extension's Redis entries are signed with a key derived from it (no cache without).
    app.config["SECRET_KEY"] = os.environ.get("SECRET_KEY", "benchmark-secret")

    @app.get(HEALTH_PATH)
    def healthz() -> str:
        return subject

    if subject == BASELINE:
        pool = BarePool(database_url())

        @app.post(CHARGES_PATH)
        def bare_charge() -> Response:
            amount, currency = read_charge()
            return created(insert_charge(pool, amount, currency), amount, currency)

        return app

    if subject == MINIMUM:
        from . import minimum

        minimum.register(app, database_url(), redis_url())
        return app

    if subject in PEERS:
        from . import peers

        peers.register(subject, app, database_url(), redis_url())
        return app

    if subject in SQLA_SUBJECTS:
        from . import sqla

        sqla.register(subject, app, database_url(), dict(config or {}))
        return app

    app.config.update(subject_config(subject, database_url(), redis_url()))
    app.config.update(config or {})
    idempotency = Idempotency(app)

    @app.post(CHARGES_PATH)
    @idempotency.required
    def charge() -> Response:
        amount, currency = read_charge()
        with idempotency.connection().cursor() as cur:
            cur.execute(INSERT_CHARGE, (amount, currency))
            row = cur.fetchone()
        assert row is not None
        return created(int(row[0]), amount, currency)

    return app


#: Tables a run empties before the servers start, when they exist.
BENCH_TABLES = (
    "bench_charges",
    "idempotency_records",
    "bench_minimum_keys",
    "bench_sqla_keys",
    "idemkit_records",
)


def prepare_database(dsn: str, subjects: Collection[str] = ()) -> None:
    """Create the benchmark's database if missing, its table, the extension's
    schema, and the tables of the other layers among ``subjects``.

    Run once by the runner before any server starts, so that workers never
    migrate concurrently and no subject pays for it inside a measurement.
    """
    create_database_if_missing(dsn)
    conn = psycopg2.connect(dsn)
    try:
        with conn, conn.cursor() as cur:
            cur.execute(BUSINESS_TABLE)
        if MINIMUM in subjects:
            from . import minimum

            minimum.create_table(conn)
        if "sqla-handwritten" in subjects:
            from . import sqla

            sqla.create_table(conn)
    finally:
        conn.close()
    app = Flask(__name__)
    app.config.update(IDEMPOTENCY_DATABASE_URL=dsn, IDEMPOTENCY_AUTO_MIGRATE=True)
    Idempotency(app)
    app.extensions["idempotency"].close()
    if "idemkit-pg" in subjects:
        from . import peers

        asyncio.run(peers.idemkit_init_pg(dsn))


def reset_database(dsn: str) -> None:
    """Empty the benchmark's tables, so every run starts from the same sizes."""
    conn = psycopg2.connect(dsn)
    try:
        with conn, conn.cursor() as cur:
            cur.execute(
                "SELECT t FROM unnest(%s::text[]) AS t WHERE to_regclass(t) IS NOT NULL",
                (list(BENCH_TABLES),),
            )
            tables = ", ".join(row[0] for row in cur.fetchall())
            cur.execute(f"TRUNCATE {tables} RESTART IDENTITY")
    finally:
        conn.close()
    conn = psycopg2.connect(dsn)
    try:
        conn.autocommit = True  # VACUUM refuses to run in a transaction block
        with conn.cursor() as cur:
            cur.execute(f"VACUUM ANALYZE {tables}")
    finally:
        conn.close()


def create_database_if_missing(dsn: str, connect_timeout: int = 10) -> None:
    """Connect once (which doubles as the runner's probe of the server), and
    create the database when the server says it does not exist."""
    params = psycopg2.extensions.parse_dsn(dsn)
    name = params.get("dbname")
    try:
        psycopg2.connect(dsn, connect_timeout=connect_timeout).close()
        return
    except psycopg2.OperationalError as exc:
        if not name or "does not exist" not in str(exc):
            raise
    admin = psycopg2.connect(
        **{**params, "dbname": "postgres", "connect_timeout": str(connect_timeout)}
    )
    try:
        admin.autocommit = True
        with admin.cursor() as cur:
            cur.execute(f'CREATE DATABASE "{name}"')
    except psycopg2.errors.DuplicateDatabase:
        pass  # created meanwhile by another run
    finally:
        admin.close()
