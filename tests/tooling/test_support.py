"""Tests of the test harness itself, against real servers.

Outage and crash tests are only as trustworthy as the proxy, the servers and
the gunicorn wrapper they stand on; these pin down what those promise.
"""

from __future__ import annotations

import os
import time

import psycopg2
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from support.servers import (
    GunicornFactory,
    GunicornServer,
    HttpSession,
    ProxyFactory,
    TcpProxy,
    ThrowawayPostgres,
    ThrowawayRedis,
    check_postgres,
    check_redis,
    flush_redis,
    free_port,
    http_request,
    redact,
    redis_answers,
    truncate_public_tables,
)

TINY_APP = "support.tiny_app:create_app()"

# A cut must be noticed at once, not after some client timeout.
FAIL_FAST_SECONDS = 2.0


def _fetch(url: str, query: str) -> list[tuple[object, ...]]:
    conn = psycopg2.connect(url, connect_timeout=5)
    try:
        with conn, conn.cursor() as cur:
            cur.execute(query)
            return cur.fetchall() if cur.description else []
    finally:
        conn.close()


def test_proxy_rewrites_urls_keeping_credentials() -> None:
    with TcpProxy.for_url("postgresql://app:s3cret@db.internal/payments?sslmode=disable") as proxy:
        assert proxy.target == ("db.internal", 5432)
        assert proxy.url == (
            f"postgresql://app:s3cret@127.0.0.1:{proxy.port}/payments?sslmode=disable"
        )
        assert proxy.url_for("redis://127.0.0.1:6379/2") == f"redis://127.0.0.1:{proxy.port}/2"
    with pytest.raises(ValueError, match="no TCP host"):
        TcpProxy.for_url("postgresql:///test?host=/var/run/postgresql")


def test_proxy_carries_postgres_and_a_cut_fails_fast(
    database_url: str, tcp_proxy: ProxyFactory
) -> None:
    proxy = tcp_proxy(database_url)
    conn = psycopg2.connect(proxy.url, connect_timeout=5)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT 1")
            assert cur.fetchone() == (1,)
        assert proxy.open_connections == 1

        proxy.cut()
        started = time.monotonic()
        with pytest.raises(psycopg2.OperationalError), conn.cursor() as cur:
            cur.execute("SELECT 1")
        with pytest.raises(psycopg2.OperationalError):
            psycopg2.connect(proxy.url, connect_timeout=5).close()
        assert time.monotonic() - started < FAIL_FAST_SECONDS
    finally:
        conn.close()

    proxy.restore()
    assert _fetch(proxy.url, "SELECT 2") == [(2,)]


def test_proxy_carries_redis_and_a_cut_fails_fast(
    clean_redis: str, tcp_proxy: ProxyFactory
) -> None:
    proxy = tcp_proxy(clean_redis)
    client = redis.Redis.from_url(proxy.url, socket_timeout=5, retry=Retry(NoBackoff(), 0))
    try:
        client.set("support:proxy", b"through")
        assert client.get("support:proxy") == b"through"

        proxy.cut()
        started = time.monotonic()
        with pytest.raises(redis.ConnectionError):
            client.get("support:proxy")
        with pytest.raises(redis.ConnectionError):
            client.ping()  # a new connection is reset too
        assert time.monotonic() - started < FAIL_FAST_SECONDS

        proxy.restore()
        assert client.get("support:proxy") == b"through"
    finally:
        client.close()


def test_throwaway_postgres_keeps_data_and_port_across_stops(
    throwaway_postgres: ThrowawayPostgres,
) -> None:
    pg = throwaway_postgres
    dsn = pg.dsn
    _fetch(dsn, "CREATE TABLE t (x int); INSERT INTO t VALUES (1)")

    started = time.monotonic()
    pg.stop()
    assert not pg.running
    with pytest.raises(psycopg2.OperationalError):
        psycopg2.connect(dsn, connect_timeout=2).close()
    pg.start()
    assert time.monotonic() - started < 10
    assert pg.dsn == dsn
    assert _fetch(dsn, "SELECT x FROM t") == [(1,)]

    # A committed row survives the closest thing to a crash: durable settings.
    _fetch(dsn, "INSERT INTO t VALUES (2)")
    pg.restart(mode="immediate")
    assert _fetch(dsn, "SELECT x FROM t ORDER BY x") == [(1,), (2,)]


def test_truncate_empties_public_tables_but_keeps_migration_records(
    fresh_database_url: str,
) -> None:
    dsn = fresh_database_url
    _fetch(
        dsn,
        """
        CREATE TABLE charges (id serial PRIMARY KEY, note text);
        CREATE TABLE refunds (id serial, charge_id int REFERENCES charges);
        CREATE TABLE "Odd Name" (x int);
        CREATE TABLE idempotency_schema_migrations (version text);
        CREATE SCHEMA other;
        CREATE TABLE other.kept (x int);
        INSERT INTO charges (note) VALUES ('a'), ('b');
        INSERT INTO refunds (charge_id) VALUES (1);
        INSERT INTO "Odd Name" VALUES (1);
        INSERT INTO idempotency_schema_migrations VALUES ('0001');
        INSERT INTO other.kept VALUES (1);
        """,
    )

    assert truncate_public_tables(dsn) == ["Odd Name", "charges", "refunds"]

    counts = _fetch(
        dsn,
        """
        SELECT (SELECT count(*) FROM charges), (SELECT count(*) FROM refunds),
               (SELECT count(*) FROM "Odd Name"),
               (SELECT count(*) FROM idempotency_schema_migrations),
               (SELECT count(*) FROM other.kept)
        """,
    )
    assert counts == [(0, 0, 0, 1, 1)]
    assert _fetch(dsn, "INSERT INTO charges (note) VALUES ('c') RETURNING id") == [(1,)]


def test_throwaway_redis_stop_loses_everything(throwaway_redis: ThrowawayRedis) -> None:
    server = throwaway_redis
    client = redis.Redis.from_url(server.url)
    try:
        client.set("a", b"1")
        client.set("b", b"2")
        flush_redis(server.url)
        assert client.dbsize() == 0

        client.set("a", b"1")
        server.stop()
        assert not redis_answers(server.host, server.port)
        server.start()
        assert client.get("a") is None  # no persistence: a restart is a wipe
    finally:
        client.close()


def test_reachability_checks_name_the_server_without_its_password() -> None:
    port = free_port()
    with pytest.raises(RuntimeError, match=r"postgres:\*\*\*@127\.0\.0\.1.*unreachable"):
        check_postgres(f"postgresql://postgres:pw@127.0.0.1:{port}/postgres", timeout=2)
    with pytest.raises(RuntimeError, match="unreachable"):
        check_redis(f"redis://127.0.0.1:{port}/0", timeout=2)
    assert redact("redis://:pw@host:1/0") == "redis://:***@host:1/0"


def test_gunicorn_serves_and_replaces_a_killed_worker(gunicorn_server: GunicornFactory) -> None:
    server = gunicorn_server(
        TINY_APP, workers=2, health_path="/healthz", env={"TINY_APP_MARKER": "from-test"}
    )
    workers = server.worker_pids()
    assert len(workers) == 2
    assert server.master_pid not in workers

    status, headers, body = http_request("GET", server.url + "/whoami")
    assert status == 200
    assert headers["content-type"] == "application/json"
    answer = http_request("GET", server.url + "/whoami").json()
    assert answer["pid"] in workers
    assert answer["env"] == "from-test"

    with pytest.raises(ValueError, match="not a worker"):
        server.kill_worker(os.getpid())
    victim = workers[0]
    server.kill_worker(victim)
    replacements = server.wait_for_workers(exclude=[victim], timeout=15)
    assert len(replacements) == 2
    assert victim not in replacements
    assert http_request("GET", server.url + "/healthz").status == 200


def test_gunicorn_gthread_keeps_connections_alive(gunicorn_server: GunicornFactory) -> None:
    server = gunicorn_server(TINY_APP, worker_class="gthread", threads=2)
    with HttpSession(server.url) as session:
        first = session.request("GET", "/whoami").json()
        second = session.request("GET", "/whoami").json()
        assert first["remote_port"] == second["remote_port"]  # one connection

        echoed = session.request("POST", "/echo", json={"amount": 1500})
        assert echoed.status == 200
        assert echoed.body == b'{"amount": 1500}'
        assert echoed.headers["Content-Type"] == "application/json"
        assert echoed.headers["x-echo-length"] == "16"


def test_gunicorn_that_cannot_load_its_app_fails_with_its_log() -> None:
    server = GunicornServer("support.tiny_app:no_such_factory()", startup_timeout=20)
    try:
        with pytest.raises(RuntimeError, match="gunicorn exited") as failure:
            server.start()
        assert "no_such_factory" in str(failure.value)
    finally:
        server.close()
