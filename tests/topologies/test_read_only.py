"""A read-only PostgreSQL is never claimed on: 503, fresh connections, recovery by itself.

A hot standby, a former primary after a failover, or a server fenced with
``default_transaction_read_only = on`` answers reads but refuses writes with
SQLSTATE 25006. The extension must treat that like an unreachable server:
``503 store_unavailable`` with ``Retry-After``, no view run, and the connection
and its idle peers discarded, so that the next request connects afresh; with a
multi-host DSN and ``target_session_attrs=read-write`` that lands on whichever
server is writable now. Here a throwaway server is switched read-only with
``ALTER SYSTEM`` and a reload, then back, with the app running throughout.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import psycopg2
import pytest
from flask import Flask

from support import core_app
from support.pg_topology import backend_pids, multi_host_dsn, set_read_only
from support.postgres_server import ThrowawayPostgres

pytestmark = pytest.mark.topology

#: ``application_name`` of the app's sessions, to find them in pg_stat_activity.
APP_NAME = "topology-read-only"


@pytest.fixture(params=["row", "transaction"])
def claim_mode(request: pytest.FixtureRequest) -> str:
    mode: str = request.param
    return mode


def make_app(dsn: str, claim_mode: str) -> Flask:
    return core_app.create_app(
        dsn,
        {
            "IDEMPOTENCY_CLAIM_MODE": claim_mode,
            "IDEMPOTENCY_DATABASE_OPTIONS": {"application_name": APP_NAME},
            # No keeper connection: every session of the app is a pool slot.
            "IDEMPOTENCY_LEASE_RENEW_INTERVAL": 0,
        },
    )


@pytest.fixture
def server() -> Iterator[ThrowawayPostgres]:
    with ThrowawayPostgres() as pg:
        yield pg


def post(app: Flask, key: str, label: str = "x") -> Any:
    return app.test_client().post(
        "/charges", json={"label": label}, headers={"Idempotency-Key": key}
    )


def records(dsn: str) -> dict[bytes, str]:
    conn = psycopg2.connect(dsn, connect_timeout=5)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT record_key, state FROM idempotency_records")
            return {bytes(key): str(state) for key, state in cur.fetchall()}
    finally:
        conn.close()


def wait_gone(dsn: str, pids: set[int], timeout: float = 5.0) -> set[int]:
    """``pids`` still connected after up to ``timeout`` (a closed session's backend
    leaves pg_stat_activity a moment after the client hung up)."""
    deadline = time.monotonic() + timeout
    while True:
        left = pids & backend_pids(dsn, APP_NAME)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def test_read_only_server_answers_503_then_recovers_without_restart(
    server: ThrowawayPostgres, claim_mode: str
) -> None:
    app = make_app(server.dsn, claim_mode)
    try:
        first = post(app, "k1")
        assert first.status_code == 201, first.get_data()
        # Two idle connections in the pool: both must go, not only the one that failed.
        pool = app.extensions["idempotency"].store.pool
        held = [pool.getconn(), pool.getconn()]
        for conn in held:
            pool.putconn(conn)
        before = backend_pids(server.dsn, APP_NAME)
        assert len(before) >= 2

        set_read_only(server.dsn, True)
        runs = len(app.extensions["runs"])
        for key in ("k2", "k1"):  # a new key, and a replay: neither is claimed on it
            answer = post(app, key)
            assert answer.status_code == 503, (key, answer.get_data())
            assert answer.get_json()["error"]["code"] == "store_unavailable"
            assert answer.headers.get("Retry-After", "").isdigit()
        assert len(app.extensions["runs"]) == runs, "a view ran on a read-only server"
        assert not wait_gone(server.dsn, before), "pooled connections to it were kept"

        set_read_only(server.dsn, False)
        second = post(app, "k2")
        assert second.status_code == 201, second.get_data()
        assert second.headers["Idempotent-Replayed"] == "false"
        replay = post(app, "k1")
        assert replay.status_code == 201
        assert replay.headers["Idempotent-Replayed"] == "true"
        assert replay.get_data() == first.get_data()
        assert len(app.extensions["runs"]) == runs + 1
        assert sorted(records(server.dsn).values()) == ["completed", "completed"]
    finally:
        app.extensions["idempotency"].close()


def test_multi_host_dsn_follows_the_server_that_is_writable(claim_mode: str) -> None:
    """Two servers named in one DSN with ``target_session_attrs=read-write``; they trade
    places (the first fenced read-only, the second opened): the next request's claim
    fails on its pooled connection, the pool is emptied, and the one retry on a new
    connection lands on the writable server. No 503, the view runs once."""
    with ThrowawayPostgres() as first, ThrowawayPostgres() as second:
        # The second server gets the same tables, then stands in for a standby.
        make_app(second.dsn, claim_mode).extensions["idempotency"].close()
        set_read_only(second.dsn, True)
        app = make_app(multi_host_dsn([first, second]), claim_mode)
        try:
            assert post(app, "before").status_code == 201
            set_read_only(first.dsn, True)
            set_read_only(second.dsn, False)
            answers = [post(app, f"after-{i}") for i in range(3)]
            assert [a.status_code for a in answers] == [201, 201, 201], [
                a.get_data() for a in answers
            ]
            assert app.extensions["runs"].count("charges") == 4
            on_second = records(second.dsn)
            assert len(on_second) == 3 and set(on_second.values()) == {"completed"}
            assert len(records(first.dsn)) == 1
        finally:
            app.extensions["idempotency"].close()
