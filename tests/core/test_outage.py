"""PostgreSQL outages: fail closed (503, view not run), then recover without a restart."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from flask import Flask

from support import core_app
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
    app = core_app.create_app(proxy.url_for(clean_db), {"IDEMPOTENCY_CONNECT_TIMEOUT": 1})
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
    app = core_app.create_app(throwaway_postgres.dsn, {"IDEMPOTENCY_CONNECT_TIMEOUT": 1})
    apps.append(app)
    for i in range(3):
        assert post(app, f"warm-{i}").status_code == 200

    throwaway_postgres.stop()
    assert post(app, "down").status_code == 503
    throwaway_postgres.start()

    assert post(app, "up").status_code == 200
    assert post(app, "warm-0").headers["Idempotent-Replayed"] == "true"
    assert app.extensions["runs"] == ["plain"] * 4
