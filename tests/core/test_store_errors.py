"""Only "PostgreSQL cannot be reached" is a 503.

``idempotency.transaction()`` runs the application's own statements: their
errors (an ``IntegrityError``, a cancelled statement, a deferred constraint
failing at ``COMMIT``) are the application's, and reach its error handlers
unchanged after the rollback. A ``503 store_unavailable`` would make clients
retry a request that can never succeed. One classifier,
``store.errors.is_unreachable``, decides everywhere.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import psycopg2
import pytest
from flask import Flask, Response, jsonify

from flask_idempotency import Idempotency
from support import core_app
from support.servers import ProxyFactory, free_port

MakeApp = Callable[..., Flask]

TABLES = """
CREATE TABLE IF NOT EXISTS store_errors_items (id integer PRIMARY KEY);
CREATE TABLE IF NOT EXISTS store_errors_deferred (
    id integer, CONSTRAINT store_errors_deferred_once UNIQUE (id) DEFERRABLE INITIALLY DEFERRED
);
"""


def sql(database_url: str, query: str) -> list[tuple[Any, ...]]:
    conn = psycopg2.connect(database_url)
    try:
        with conn, conn.cursor() as cur:
            cur.execute(query)
            return cur.fetchall() if cur.description else []
    finally:
        conn.close()


def add_routes(app: Flask, *, handler: bool = True) -> None:
    """Routes outside idempotency that use ``idempotency.transaction()``."""
    idem: Idempotency = app.extensions["idem"]

    @app.post("/items/<int:item>")
    def add_item(item: int) -> tuple[Response, int]:
        with idem.transaction() as conn, conn.cursor() as cur:
            cur.execute("INSERT INTO store_errors_items (id) VALUES (%s)", (item,))
            cur.execute("INSERT INTO core_business_rows (label) VALUES ('item')")
            cur.execute("INSERT INTO store_errors_items (id) VALUES (%s)", (item,))
        return jsonify({"id": item}), 201

    @app.post("/deferred")
    def deferred() -> tuple[Response, int]:
        with idem.transaction() as conn, conn.cursor() as cur:
            cur.execute(
                "INSERT INTO store_errors_deferred (id) VALUES (1), (1)"
            )  # fine until COMMIT
        return jsonify({}), 201

    @app.post("/cancelled")
    def cancelled() -> tuple[Response, int]:
        with idem.transaction() as conn, conn.cursor() as cur:
            cur.execute("SET LOCAL statement_timeout = 50")
            cur.execute("SELECT pg_sleep(2)")
        return jsonify({}), 201

    @app.post("/fine")
    def fine() -> tuple[Response, int]:
        with idem.transaction() as conn, conn.cursor() as cur:
            cur.execute("INSERT INTO core_business_rows (label) VALUES ('fine')")
        return jsonify({}), 201

    if handler:

        @app.errorhandler(psycopg2.Error)
        def database_error(exc: psycopg2.Error) -> tuple[Response, int]:
            return jsonify({"pgcode": exc.pgcode, "type": type(exc).__name__}), 409


@pytest.fixture
def make_tx_app(clean_db: str) -> Iterator[Callable[..., Flask]]:
    sql(clean_db, TABLES)
    made: list[Flask] = []

    def make(database_url: str = clean_db, *, handler: bool = True, **config: Any) -> Flask:
        app = core_app.create_app(database_url, config)
        add_routes(app, handler=handler)
        made.append(app)
        return app

    yield make
    for app in made:
        app.extensions["idempotency"].close()


def test_an_integrity_error_reaches_the_apps_handler_unchanged(
    make_tx_app: Callable[..., Flask], clean_db: str
) -> None:
    client = make_tx_app().test_client()
    answer = client.post("/items/1")
    assert answer.status_code == 409, answer.data
    assert answer.get_json() == {"pgcode": "23505", "type": "UniqueViolation"}
    # Rolled back: nothing of the block was kept, and the connection serves on.
    assert sql(clean_db, "SELECT count(*) FROM store_errors_items") == [(0,)]
    assert sql(clean_db, "SELECT count(*) FROM core_business_rows") == [(0,)]
    assert client.post("/fine").status_code == 201
    assert sql(clean_db, "SELECT count(*) FROM core_business_rows") == [(1,)]


def test_without_a_handler_an_integrity_error_is_a_500_not_a_503(
    make_tx_app: Callable[..., Flask],
) -> None:
    answer = make_tx_app(handler=False).test_client().post("/items/1")
    assert answer.status_code == 500
    assert "Retry-After" not in answer.headers


def test_a_failing_commit_that_is_not_an_outage_propagates(
    make_tx_app: Callable[..., Flask], clean_db: str
) -> None:
    answer = make_tx_app().test_client().post("/deferred")
    assert answer.status_code == 409, answer.data
    assert answer.get_json() == {"pgcode": "23505", "type": "UniqueViolation"}
    assert sql(clean_db, "SELECT count(*) FROM store_errors_deferred") == [(0,)]


def test_a_cancelled_statement_of_the_app_propagates(make_tx_app: Callable[..., Flask]) -> None:
    answer = make_tx_app().test_client().post("/cancelled")
    assert answer.status_code == 409, answer.data
    assert answer.get_json() == {"pgcode": "57014", "type": "QueryCanceled"}


def test_an_unreachable_database_is_a_503(
    make_tx_app: Callable[..., Flask], clean_db: str, tcp_proxy: ProxyFactory
) -> None:
    proxy = tcp_proxy(clean_db)
    app = make_tx_app(proxy.url_for(clean_db), IDEMPOTENCY_DATABASE_OPTIONS={"connect_timeout": 2})
    client = app.test_client()
    assert client.post("/fine").status_code == 201  # a pooled connection, about to go stale
    proxy.cut()
    answer = client.post("/fine")
    assert answer.status_code == 503
    assert answer.get_json()["error"]["code"] == "store_unavailable"
    assert answer.headers["Retry-After"].isdigit()
    proxy.restore()
    assert client.post("/fine").status_code == 201


# -- the classifier, on real errors -----------------------------------------------


def error_of(conn: Any, query: str) -> psycopg2.Error:
    with pytest.raises(psycopg2.Error) as raised:
        with conn.cursor() as cur:
            cur.execute(query)
    return raised.value


def test_the_classifier_on_real_errors(database_url: str) -> None:
    from flask_idempotency.store.errors import is_unreachable

    with pytest.raises(psycopg2.OperationalError) as refused:
        psycopg2.connect(host="127.0.0.1", port=free_port(), dbname="x", connect_timeout=2)
    assert refused.value.pgcode is None
    assert is_unreachable(refused.value)

    conn = psycopg2.connect(database_url)
    conn.autocommit = True
    try:
        assert not is_unreachable(error_of(conn, "SELECT 1/0"), conn)
        cancelled = error_of(conn, "SET statement_timeout = 10; SELECT pg_sleep(1)")
        assert isinstance(cancelled, psycopg2.OperationalError)  # and yet the server answered
        assert not is_unreachable(cancelled, conn)
        with conn.cursor() as cur:
            cur.execute("SET statement_timeout = 0")
        missing = error_of(conn, "EXECUTE no_such_statement")
        assert isinstance(missing, psycopg2.OperationalError) and missing.pgcode == "26000"
        assert not is_unreachable(missing, conn)
        duplicate = error_of(
            conn, "CREATE TEMP TABLE t (id int PRIMARY KEY); INSERT INTO t VALUES (1), (1)"
        )
        assert isinstance(duplicate, psycopg2.IntegrityError)
        assert not is_unreachable(duplicate, conn)

        with conn.cursor() as cur:
            cur.execute("SELECT pg_backend_pid()")
            row = cur.fetchone()
            assert row is not None
        sql(database_url, f"SELECT pg_terminate_backend({row[0]})")
        terminated = error_of(conn, "SELECT 1")
        assert is_unreachable(terminated, conn)
        assert is_unreachable(terminated)  # by its SQLSTATE or its lost socket alone
    finally:
        conn.close()
    closed = error_of(conn, "SELECT 1")
    assert isinstance(closed, psycopg2.InterfaceError)
    assert is_unreachable(closed)


def test_a_start_without_postgres_logs_why_the_connection_failed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The start-up log names what libpq reported (here: refused, on which port), so
    an operator can tell a closed port from a bad certificate or a wrong password;
    the class name alone ("OperationalError") could not."""
    from flask_idempotency.store.errors import MAX_REASON_LENGTH, reason_of

    port = free_port()
    app = Flask(__name__)
    app.config.update(
        IDEMPOTENCY_DATABASE_URL=f"postgresql://nobody@127.0.0.1:{port}/none",
        IDEMPOTENCY_DATABASE_OPTIONS={"connect_timeout": 2},
        IDEMPOTENCY_AUTO_MIGRATE=True,
    )
    caplog.set_level(logging.ERROR, logger="flask_idempotency")
    Idempotency(app)  # starts anyway; migrates once PostgreSQL answers
    app.extensions["idempotency"].close()
    logged = [r.getMessage() for r in caplog.records if "unreachable at start" in r.getMessage()]
    assert len(logged) == 1, logged
    assert f"port {port} failed" in logged[0] and "Connection refused" in logged[0], logged
    assert "nobody@" not in logged[0]  # the DSN itself is not logged

    long = psycopg2.OperationalError("x" * 500 + "\nsecond line")
    assert reason_of(long) == "OperationalError: " + "x" * (MAX_REASON_LENGTH - 1) + "…"
    assert reason_of(psycopg2.OperationalError("")) == "OperationalError"
