"""PostgreSQL outages: fail closed (503, view not run), then recover without a restart."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from flask import Flask

from flask_idempotency import Idempotency, digests
from flask_idempotency.store.base import Claimed, LeaseHold
from support import core_app
from support.pg_query import terminate_sessions
from support.postgres_server import ThrowawayPostgres
from support.tcp_proxy import TcpProxy

ProxyFactory = Callable[..., TcpProxy]


def post(app: Flask, key: str) -> Any:
    return app.test_client().post("/plain", data=b"x", headers={"Idempotency-Key": key})


@pytest.fixture
def apps() -> Iterator[list[Flask]]:
    made: list[Flask] = []
    yield made
    for app in made:
        app.extensions["idempotency"].close()


def test_cut_connection_answers_503_and_recovers(
    clean_db: str, tcp_proxy: ProxyFactory, apps: list[Flask]
) -> None:
    proxy = tcp_proxy(clean_db)
    app = core_app.create_app(
        proxy.url_for(clean_db), {"IDEMPOTENCY_DATABASE_OPTIONS": {"connect_timeout": 1}}
    )
    apps.append(app)
    assert post(app, "before").status_code == 200

    proxy.cut()
    during = post(app, "during")
    assert during.status_code == 503
    assert during.get_json()["error"]["code"] == "store_unavailable"
    assert during.headers["Retry-After"].isdigit()
    assert "Idempotent-Replayed" not in during.headers
    assert app.extensions["runs"] == ["plain"]  # the view never ran without a claim

    proxy.restore()
    after = post(app, "after")  # stale pooled connections are replaced, no restart
    assert after.status_code == 200
    assert post(app, "before").headers["Idempotent-Replayed"] == "true"


def test_server_restart_is_survived(
    throwaway_postgres: ThrowawayPostgres, apps: list[Flask]
) -> None:
    app = core_app.create_app(
        throwaway_postgres.dsn, {"IDEMPOTENCY_DATABASE_OPTIONS": {"connect_timeout": 1}}
    )
    apps.append(app)
    for i in range(3):
        assert post(app, f"warm-{i}").status_code == 200

    throwaway_postgres.stop()
    assert post(app, "down").status_code == 503
    throwaway_postgres.start()

    assert post(app, "up").status_code == 200
    assert post(app, "warm-0").headers["Idempotent-Replayed"] == "true"
    assert app.extensions["runs"] == ["plain"] * 4


def labelled_app(database_url: str, apps: list[Flask], name: str, **config: Any) -> Flask:
    """The core app with its PostgreSQL sessions named ``name`` (so a test can end
    them, as a restart would) and a store breaker that opens at the first failure it
    counts (so a single wrongly counted one shows)."""
    options = {"breaker_threshold": 1, "application_name": name}
    app = core_app.create_app(database_url, {"IDEMPOTENCY_DATABASE_OPTIONS": options, **config})
    apps.append(app)
    return app


def breaker_state(app: Flask) -> str:
    return str(app.extensions["idempotency"].store.breaker.state.value)


@pytest.mark.parametrize("claim_mode", ["row", "transaction"])
def test_stale_pooled_connections_do_not_open_the_breaker(
    clean_db: str, apps: list[Flask], claim_mode: str
) -> None:
    """After a restart or a healed partition the pool's idle connections are dead: each
    fails its first statement, and the claim retries on a fresh connection. Such a
    failure says nothing about PostgreSQL now, so it must not count toward the store's
    circuit breaker; a burst of requests on a pool full of them would otherwise open
    it and answer 503 for a whole cooldown while the server is up. A threshold of one
    makes a single wrongly counted failure show."""
    name = f"stale-pool-{claim_mode}"
    app = labelled_app(clean_db, apps, name, IDEMPOTENCY_CLAIM_MODE=claim_mode)
    assert post(app, "warm").status_code == 200

    assert terminate_sessions(clean_db, name) >= 1
    after = post(app, "after-restart")
    assert after.status_code == 200, after.get_json()
    assert post(app, "warm").headers["Idempotent-Replayed"] == "true"
    assert breaker_state(app) == "closed"


def test_keyless_transactions_survive_stale_pooled_connections(
    clean_db: str, apps: list[Flask]
) -> None:
    """Requests that claim nothing open their transaction on a pooled connection too:
    on an optional route called without a key (``idempotency.connection()``) and in
    ``idempotency.transaction()``. A connection that died while idle is replaced
    there as well, without a 503 and without counting toward the breaker."""
    name = "stale-pool-keyless"
    app = labelled_app(clean_db, apps, name)
    idem: Idempotency = app.extensions["idem"]

    @app.post("/keyless-connection")
    @idem.optional
    def keyless_connection() -> tuple[str, int]:
        with idem.connection().cursor() as cur:
            cur.execute("INSERT INTO core_business_rows (label) VALUES ('keyless')")
        return "", 204

    client = app.test_client()
    assert client.post("/keyless-connection").status_code == 204
    assert terminate_sessions(clean_db, name) >= 1
    assert client.post("/keyless-connection").status_code == 204

    assert client.post("/optional", data=b"x").status_code == 201  # its view: transaction()
    assert terminate_sessions(clean_db, name) >= 1
    assert client.post("/optional", data=b"x").status_code == 201
    assert breaker_state(app) == "closed"
    assert app.extensions["runs"] == ["optional", "optional"]


def test_a_health_check_survives_stale_pooled_connections(clean_db: str, apps: list[Flask]) -> None:
    """``idempotency.ping()`` just after a restart: the dead pooled connection it
    draws is replaced, so the health check reports the server up (and the breaker,
    at a threshold of one, stays closed)."""
    name = "stale-pool-ping"
    app = labelled_app(clean_db, apps, name)
    idem: Idempotency = app.extensions["idem"]
    with app.app_context():
        idem.ping()
        assert terminate_sessions(clean_db, name) >= 1
        idem.ping()
    assert breaker_state(app) == "closed"


def test_lease_renewals_survive_a_dead_keeper_connection(clean_db: str, apps: list[Flask]) -> None:
    """The lease keeper renews on a connection of its own, idle between renewals:
    after a restart it is dead. A renewal then goes again at once on a fresh one
    (renewing is idempotent) instead of losing a whole renewal interval of a
    slow request's lease."""
    name = "stale-keeper"
    app = labelled_app(clean_db, apps, name)
    store = app.extensions["idempotency"].store
    record_key = digests.record_key("", "stale-keeper")
    holder = store.begin()
    try:
        claimed = holder.claim(record_key, b"fingerprint", lease=30, ttl=60)
        assert isinstance(claimed, Claimed)
        hold = LeaseHold(record_key, claimed.token, 30)
        assert store.renew([hold]) == 1  # the keeper's connection, now idle
        assert terminate_sessions(clean_db, name) >= 1
        assert store.renew([hold]) == 1
    finally:
        holder.close()
