"""``redis+sentinel://`` and ``redis+cluster://`` URLs: what they say, and clear
errors for what they cannot say (at start-up, before any request)."""

from __future__ import annotations

import pytest
from flask import Flask

from flask_idempotency import Idempotency
from flask_idempotency.cache import topology


def test_sentinel_url() -> None:
    spec = topology.parse("redis+sentinel://:s3cret@10.0.0.1:26379,sentinel-b/payments/2")
    assert spec.kind == "sentinel" and not spec.ssl
    assert spec.nodes == (("10.0.0.1", 26379), ("sentinel-b", 26379))
    assert (spec.service, spec.db, spec.password, spec.username) == ("payments", 2, "s3cret", None)


def test_cluster_url() -> None:
    spec = topology.parse("rediss+cluster://app:pw@[::1]:7000,node-b:7001")
    assert spec.kind == "cluster" and spec.ssl
    assert spec.nodes == (("::1", 7000), ("node-b", 7001))
    assert (spec.username, spec.password, spec.db) == ("app", "pw", 0)
    assert topology.parse("redis+cluster://node").nodes == (("node", 6379),)


@pytest.mark.parametrize(
    ("url", "complaint"),
    [
        ("redis+sentinel://host:26379", "master's name"),
        ("redis+sentinel://host:26379/a/b/c", "master's name"),
        ("redis+sentinel://host:port/name", "port must be a whole number"),
        ("redis+sentinel://host/name/x", "database number"),
        ("redis+cluster://node:7000/3", "database 0 only"),
        ("redis+cluster://node:7000?ssl_cert_reqs=none", "no query options"),
        ("redis+cluster://,node:7000", "empty host"),
    ],
)
def test_malformed_urls_are_refused_clearly(url: str, complaint: str) -> None:
    with pytest.raises(ValueError, match=complaint):
        topology.parse(url)


def test_a_malformed_topology_url_stops_the_start() -> None:
    app = Flask(__name__)
    app.config.update(
        IDEMPOTENCY_DATABASE_URL="postgresql://unused@127.0.0.1:9/x",
        IDEMPOTENCY_REDIS_URL="redis+sentinel://:hunter2@host:26379",
    )
    with pytest.raises(ValueError, match="master's name") as refused:
        Idempotency(app)
    assert "hunter2" not in str(refused.value)


def test_the_password_never_appears_in_an_error() -> None:
    with pytest.raises(ValueError) as refused:
        topology.parse("redis+cluster://:hunter2@node:notaport")
    assert "hunter2" not in str(refused.value)
