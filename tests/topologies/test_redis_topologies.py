"""Redis Cluster and Redis Sentinel as the replay cache.

A real three-master cluster (each master with a replica) and a master-replica
pair watched by three sentinels, all started from ``redis-server`` here
(``support/redis_topology.py``). The app names them by URL
(``redis+cluster://``, ``redis+sentinel://``) or is handed a redis-py client.
Checked: answers land on several masters and replays come from the cache; the
evictions of ``purge`` and ``unlock`` never send a multi-key command across
slots; and a failover of a Redis master while requests run changes no outcome
(each key's view runs once, every replay is the first answer's bytes, no 5xx),
after which the fast path serves again.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psycopg2
import pytest
import redis
import redis.cluster
import redis.sentinel
from flask import Flask, jsonify, request
from reliability.figures import Figures

from flask_idempotency import Idempotency, global_scope
from flask_idempotency.digests import record_key
from support._procs import LOOPBACK
from support.postgres_server import ThrowawayPostgres
from support.redis_topology import RedisCluster, SentinelPair

pytestmark = pytest.mark.topology

PREFIX = "idem-topology"


@pytest.fixture(scope="module")
def postgres() -> Iterator[ThrowawayPostgres]:
    with ThrowawayPostgres() as pg:
        yield pg


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisCluster]:
    try:
        topology = RedisCluster().start()
    except RuntimeError as exc:
        pytest.skip(f"cannot start a Redis Cluster here: {str(exc)[-600:]}")
    try:
        yield topology
    finally:
        topology.close()


@pytest.fixture(scope="module")
def sentinel_pair() -> Iterator[SentinelPair]:
    try:
        topology = SentinelPair().start()
    except RuntimeError as exc:
        pytest.skip(f"cannot start Redis Sentinel here: {str(exc)[:300]}")
    try:
        yield topology
    finally:
        topology.close()


def make_app(dsn: str, **redis_config: Any) -> Flask:
    """A charges route; ``runs`` counts its executions per key."""
    app = Flask(__name__)
    app.config.update(
        IDEMPOTENCY_DATABASE_URL=dsn,
        IDEMPOTENCY_AUTO_MIGRATE=True,
        SECRET_KEY="topology-test-secret",  # the Redis cache is off without one
        IDEMPOTENCY_SCOPE_FUNC=global_scope,
        IDEMPOTENCY_REDIS_OPTIONS={
            "prefix": PREFIX,
            "timeout": 0.5,
            "breaker_cooldown": 1.0,
            # Every answer goes to Redis as it commits, so that each one tests the topology.
            "fill": "completion",
        },
        **redis_config,
    )
    idempotency = Idempotency(app)
    runs: Counter[str] = Counter()
    lock = threading.Lock()
    app.extensions["runs"] = runs

    @app.post("/charges")
    @idempotency.required
    def charge() -> Any:
        key = request.headers["Idempotency-Key"]
        with lock:
            runs[key] += 1
        return jsonify(key=key, amount=request.get_json()["amount"], at=time.time()), 201

    return app


def post(app: Flask, key: str) -> Any:
    headers = {"Idempotency-Key": key}
    return app.test_client().post("/charges", json={"amount": 100}, headers=headers)


def counters(app: Flask) -> dict[str, int]:
    snapshot: dict[str, int] = app.extensions["idempotency"].metrics.snapshot()
    return snapshot


def first_and_replays(app: Flask, keys: list[str]) -> dict[str, bytes]:
    firsts = {}
    for key in keys:
        answer = post(app, key)
        assert answer.status_code == 201, answer.get_data()
        firsts[key] = answer.get_data()
    for key in keys:
        replay = post(app, key)
        assert replay.headers["Idempotent-Replayed"] == "true"
        assert replay.get_data() == firsts[key]
    return firsts


def expire_and_purge(app: Flask, dsn: str) -> str:
    with psycopg2.connect(dsn) as conn, conn.cursor() as cur:
        cur.execute("UPDATE idempotency_records SET expires_at = now() - interval '1 second'")
    conn.close()
    result = app.test_cli_runner().invoke(args=["idempotency", "purge"])
    assert result.exit_code == 0, result.output
    return result.output


def cluster_keys_by_master(cluster: RedisCluster) -> dict[int, int]:
    return {n.port: int(n.client().dbsize()) for n in cluster.master_nodes()}


def under_load(
    app: Flask, run_id: str, action: Callable[[], None], *, seconds_after: float = 3.0
) -> tuple[Counter[str], dict[str, set[bytes]]]:
    """Eight threads send new keys and repeats of earlier ones while ``action``
    runs; returns the answers' statuses and every 201 body per key."""
    stop = threading.Event()
    statuses: Counter[str] = Counter()
    bodies: dict[str, set[bytes]] = {}
    lock = threading.Lock()

    def client(n: int) -> None:
        i = 0
        while not stop.is_set():
            i += 1
            key = f"{run_id}-{n}-{i // 2}"  # each key twice: a first request, then a replay
            answer = post(app, key)
            with lock:
                statuses[str(answer.status_code)] += 1
                if answer.status_code == 201:
                    bodies.setdefault(key, set()).add(answer.get_data())

    with ThreadPoolExecutor(max_workers=8) as pool:
        futures = [pool.submit(client, n) for n in range(8)]
        try:
            time.sleep(1.0)
            action()
            time.sleep(seconds_after)
        finally:
            stop.set()  # also when the action failed: the clients must end
        for future in futures:
            future.result(60)
    return statuses, bodies


def assert_no_outcome_changed(app: Flask, bodies: dict[str, set[bytes]]) -> None:
    runs: Counter[str] = app.extensions["runs"]
    twice = {key: n for key, n in runs.items() if n > 1}
    assert not twice, f"views ran more than once: {twice}"
    differing = {key for key, seen in bodies.items() if len(seen) > 1}
    assert not differing, f"replays differ from the first answer: {sorted(differing)[:5]}"


# -- Redis Cluster ----------------------------------------------------------------


def test_cluster_by_url_spreads_answers_and_evicts_per_slot(
    postgres: ThrowawayPostgres, cluster: RedisCluster, figures: Figures
) -> None:
    app = make_app(postgres.dsn_for("postgres"), IDEMPOTENCY_REDIS_URL=cluster.url)
    try:
        keys = [f"cluster-url-{i}" for i in range(60)]
        first_and_replays(app, keys)
        assert counters(app)["replayed_from_cache"] == len(keys)
        spread = cluster_keys_by_master(cluster)
        assert len(spread) == 3 and all(n > 0 for n in spread.values()), spread

        # unlock's eviction (one key), then purge's (a batch across every slot).
        cache = app.extensions["idempotency"].cache
        cache.evict([record_key("", keys[0])])
        output = expire_and_purge(app, postgres.dsn_for("postgres"))
        after = cluster_keys_by_master(cluster)
        assert sum(after.values()) == 0, (after, output)
        assert cache.breaker.state.value == "closed"
        figures(keys=len(keys), keys_per_master=sorted(spread.values()), purge=output.strip())
    finally:
        app.extensions["idempotency"].close()


def test_cluster_client_passed_in_serves_replays(
    postgres: ThrowawayPostgres, cluster: RedisCluster
) -> None:
    client: redis.cluster.RedisCluster[bytes] = redis.cluster.RedisCluster(
        host=LOOPBACK, port=cluster.nodes[0].port
    )
    app = make_app(postgres.dsn_for("postgres"), IDEMPOTENCY_REDIS=client)
    try:
        first_and_replays(app, [f"cluster-client-{i}" for i in range(20)])
        assert counters(app)["replayed_from_cache"] == 20
    finally:
        app.extensions["idempotency"].close()
        client.close()


def test_cluster_master_failover_changes_no_outcome(
    postgres: ThrowawayPostgres, cluster: RedisCluster, figures: Figures
) -> None:
    app = make_app(postgres.dsn_for("postgres"), IDEMPOTENCY_REDIS_URL=cluster.url)
    victim = cluster.master_nodes()[0]
    started = time.monotonic()
    try:
        statuses, bodies = under_load(
            app, "cluster-failover", lambda: cluster.fail_over_by_death(victim)
        )
        assert set(statuses) == {"201"}, statuses
        assert_no_outcome_changed(app, bodies)
        before = counters(app)["replayed_from_cache"]
        keys = [f"cluster-after-{i}" for i in range(30)]
        first_and_replays(app, keys)
        assert counters(app)["replayed_from_cache"] - before == len(keys)  # fast path is back
        figures(
            answers=dict(statuses),
            keys=len(bodies),
            replays_from_cache=counters(app)["replayed_from_cache"],
            replays_from_postgres=counters(app)["replayed_from_store"],
            seconds=round(time.monotonic() - started, 1),
        )
    finally:
        app.extensions["idempotency"].close()


# -- Redis Sentinel ---------------------------------------------------------------


def test_sentinel_by_url_and_by_client_serve_replays(
    postgres: ThrowawayPostgres, sentinel_pair: SentinelPair
) -> None:
    by_url = make_app(postgres.dsn_for("postgres"), IDEMPOTENCY_REDIS_URL=sentinel_pair.url)
    sentinel = redis.sentinel.Sentinel(
        [(LOOPBACK, s.port) for s in sentinel_pair.sentinels], socket_timeout=0.5
    )
    by_client = make_app(
        postgres.dsn_for("postgres"),
        IDEMPOTENCY_REDIS=sentinel.master_for(sentinel_pair.service, socket_timeout=0.5),
    )
    try:
        first_and_replays(by_url, [f"sentinel-url-{i}" for i in range(20)])
        assert counters(by_url)["replayed_from_cache"] == 20
        first_and_replays(by_client, [f"sentinel-client-{i}" for i in range(20)])
        assert counters(by_client)["replayed_from_cache"] == 20
        master = sentinel_pair.master_port()
        assert master == sentinel_pair.master.port
        assert int(sentinel_pair.master.client().dbsize()) >= 40
    finally:
        by_url.extensions["idempotency"].close()
        by_client.extensions["idempotency"].close()


def test_sentinel_failover_changes_no_outcome(
    postgres: ThrowawayPostgres, sentinel_pair: SentinelPair, figures: Figures
) -> None:
    app = make_app(postgres.dsn_for("postgres"), IDEMPOTENCY_REDIS_URL=sentinel_pair.url)
    started = time.monotonic()
    moved: list[int] = []
    try:
        old = sentinel_pair.master_port()
        statuses, bodies = under_load(
            app, "sentinel-failover", lambda: moved.append(sentinel_pair.fail_over())
        )
        assert moved and moved[0] != old
        assert set(statuses) == {"201"}, statuses
        assert_no_outcome_changed(app, bodies)
        time.sleep(1.2)  # the breaker's cooldown, if the switch opened it
        before = counters(app)["replayed_from_cache"]
        keys = [f"sentinel-after-{i}" for i in range(20)]
        first_and_replays(app, keys)
        assert counters(app)["replayed_from_cache"] - before == len(keys)  # on the new master
        figures(
            answers=dict(statuses),
            keys=len(bodies),
            master_port_before_after=(old, moved[0]),
            replays_from_cache=counters(app)["replayed_from_cache"],
            replays_from_postgres=counters(app)["replayed_from_store"],
            seconds=round(time.monotonic() - started, 1),
        )
    finally:
        app.extensions["idempotency"].close()
