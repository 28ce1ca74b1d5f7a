"""``IDEMPOTENCY_POOL``: the application's own psycopg2 pool, lent to the extension.

Its connections come back exactly as they were lent (the ``autocommit`` flag
above all: one left in autocommit mode makes the application's next
``rollback()`` undo nothing). A connection on which the application ran
``DEALLOCATE ALL`` or ``DISCARD ALL`` gets the claim prepared again instead of
a 503. The lease keeper renews on one connection it keeps from that pool, not
on the connections requests hold.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import psycopg2
import psycopg2.extensions
import psycopg2.pool
import pytest
from flask import Flask

from support.records import wait_for_renewal

MakeApp = Callable[..., Flask]


class LendingPool(psycopg2.pool.ThreadedConnectionPool):
    """A real ``ThreadedConnectionPool`` that notes, for each connection given back,
    its ``autocommit`` when lent and when returned, and which connections are out."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: (autocommit when lent, autocommit when given back), one per return.
        self.returned: list[tuple[bool, bool]] = []
        #: Connections given back to be closed.
        self.discarded = 0
        self._lent: dict[int, bool] = {}

    @property
    def out(self) -> set[int]:
        return set(self._lent)

    def getconn(self, key: Any = None) -> Any:
        conn = super().getconn(key)
        self._lent[id(conn)] = bool(conn.autocommit)
        return conn

    def putconn(self, conn: Any = None, key: Any = None, close: bool = False) -> None:
        self.returned.append((self._lent.pop(id(conn)), bool(conn.autocommit)))
        self.discarded += bool(close)
        super().putconn(conn, key, close)

    def all_as_lent(self) -> bool:
        return all(lent == back for lent, back in self.returned)

    def idle(self) -> list[Any]:
        """Every idle connection, taken out (give them back with ``putconn``)."""
        taken = []
        while self._pool:  # type: ignore[attr-defined]
            taken.append(self.getconn())
        return taken


def sql(database_url: str, query: str) -> list[tuple[Any, ...]]:
    conn = psycopg2.connect(database_url)
    try:
        with conn, conn.cursor() as cur:
            cur.execute(query)
            return cur.fetchall() if cur.description else []
    finally:
        conn.close()


def post(app: Flask, key: str, body: dict[str, Any] | None = None) -> Any:
    return app.test_client().post("/charges", json=body or {}, headers={"Idempotency-Key": key})


def test_connections_go_back_as_they_were_lent(make_app: MakeApp, clean_db: str) -> None:
    pool = LendingPool(4, 4, clean_db)
    try:
        app = make_app(IDEMPOTENCY_POOL=pool)
        assert post(app, "a").status_code == 201
        assert post(app, "a").headers["Idempotent-Replayed"] == "true"
        assert post(app, "b", {"status": 500}).status_code == 500  # released
        assert post(app, "c", {"raise": True}).status_code == 500  # released
        assert pool.returned and pool.all_as_lent()
        assert not any(back for _, back in pool.returned)  # psycopg2's default

        # The application's own use of its pool: a rollback undoes its work.
        for conn in pool.idle():
            with conn.cursor() as cur:
                cur.execute("INSERT INTO core_business_rows (label) VALUES ('app')")
            conn.rollback()
            pool.putconn(conn)
        assert sql(clean_db, "SELECT count(*) FROM core_business_rows WHERE label = 'app'") == [
            (0,)
        ]

        # A connection the application keeps in autocommit mode comes back so too.
        for conn in pool.idle():
            conn.autocommit = True
            pool.putconn(conn)
        pool.returned.clear()
        assert post(app, "d").status_code == 201
        assert pool.returned and pool.all_as_lent()
        assert all(back for _, back in pool.returned)
    finally:
        pool.closeall()


@pytest.mark.parametrize("claim_mode", ["row", "transaction"])
def test_a_claim_deallocated_by_the_application_is_prepared_again(
    make_app: MakeApp, clean_db: str, claim_mode: str
) -> None:
    pool = LendingPool(4, 4, clean_db)
    try:
        app = make_app(IDEMPOTENCY_POOL=pool, IDEMPOTENCY_CLAIM_MODE=claim_mode)
        assert post(app, "a").status_code == 201  # each connection prepared the claim
        for statement in ("DEALLOCATE ALL", "DISCARD ALL"):
            for conn in pool.idle():
                conn.autocommit = True  # DISCARD ALL refuses to run in a transaction
                with conn.cursor() as cur:
                    cur.execute(statement)
                conn.autocommit = False
                pool.putconn(conn)
            key = statement.replace(" ", "-")
            answer = post(app, key)
            assert answer.status_code == 201, answer.data
            assert post(app, key).headers["Idempotent-Replayed"] == "true"
        assert sql(clean_db, "SELECT count(*) FROM core_business_rows") == [(3,)]
        assert pool.discarded == 0  # prepared again, not thrown away as if broken
    finally:
        pool.closeall()


def test_the_keeper_renews_on_a_connection_it_keeps_from_the_borrowed_pool(
    make_app: MakeApp, clean_db: str
) -> None:
    from flask_idempotency.workers import check_pool_size

    pool = LendingPool(1, 4, clean_db)
    try:
        app = make_app(
            IDEMPOTENCY_POOL=pool,
            IDEMPOTENCY_LEASE=1.0,
            IDEMPOTENCY_LEASE_RENEW_INTERVAL=0.2,
            IDEMPOTENCY_FINGERPRINT_FUNC=lambda request: b"same request",
        )
        answers: list[Any] = []
        holder = threading.Thread(target=lambda: answers.append(post(app, "k", {"gate": "g"})))
        holder.start()
        gates = app.extensions["gates"]
        try:
            assert gates.entered_event("g").wait(10)
            wait_for_renewal(clean_db)  # the keeper has its connection, and has used it
            assert len(pool.out) == 2  # the request's connection and the keeper's
            duplicate = post(app, "k")
            assert duplicate.status_code == 409
            assert duplicate.get_json()["error"]["code"] == "in_progress"
        finally:
            gates.get("g").set()
            holder.join(10)
        assert answers[0].status_code == 201
        assert app.extensions["runs"] == ["charges"]

        class Log:
            warnings: list[str] = []

            def warning(self, message: str, *args: Any) -> None:
                self.warnings.append(message % args)

        # Four connections, one kept by the keeper: three for requests.
        assert check_pool_size(app, threads=3, log=Log())
        assert not check_pool_size(app, threads=4, log=Log())

        app.extensions["idempotency"].close()
        assert not pool.out  # the keeper's connection went back, as lent
        assert pool.all_as_lent()
    finally:
        pool.closeall()
