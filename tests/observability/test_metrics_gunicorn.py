"""``GET /metrics`` of the payments API under gunicorn with three workers (CONTRACT §2).

Requests of known outcomes go to whichever worker accepts them; every scrape,
whichever worker answers it, must count exactly those requests by outcome.
Killing a worker loses none of its counts and removes its live gauges.
"""

from __future__ import annotations

import os
import signal
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from support.servers import GunicornFactory, child_pids, http_request
from support.waiting import wait_until

REPO_ROOT = Path(__file__).resolve().parents[2]
WORKERS = 3
POOL_SIZE = 10  # the extension's default IDEMPOTENCY_DATABASE_OPTIONS["pool_size"]
AUTH = {"Authorization": "Bearer sk_metrics"}
BODY: dict[str, Any] = {"amount": 1500, "currency": "usd", "customer": "cus_m", "source": "tok"}
REQUESTS = "flask_idempotency_requests_total"

#: A scrape: each sample name -> its (labels, value) pairs.
Samples = dict[str, list[tuple[dict[str, str], float]]]

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="finds the workers through /proc"
)


def charge(url: str, key: str | None, body: dict[str, Any] = BODY) -> int:
    headers = dict(AUTH) if key is None else {**AUTH, "Idempotency-Key": key}
    return http_request("POST", url + "/v1/charges", headers, json=body).status


def scrape(url: str) -> Samples:
    answer = http_request("GET", url + "/metrics")
    assert answer.status == 200, answer
    assert answer.headers["Content-Type"].startswith("text/plain"), answer.headers
    found: Samples = {}
    for family in text_string_to_metric_families(answer.body.decode()):
        for sample in family.samples:
            found.setdefault(sample.name, []).append((sample.labels, sample.value))
    return found


def by_outcome(samples: Samples) -> Counter[str]:
    counts: Counter[str] = Counter()
    for labels, value in samples.get(REQUESTS, []):
        if not value:
            continue  # every outcome of every idempotent route is shown, at 0 until it happens
        assert labels["route"] == "/v1/charges", labels
        outcome = labels["outcome"] + (f"/{labels['source']}" if labels["source"] else "")
        counts[outcome] += int(value)
    return +counts


def value(samples: Samples, name: str, **labels: str) -> float:
    return sum(v for found, v in samples.get(name, []) if labels.items() <= found.items())


def requests_by_worker(metrics_dir: Path) -> dict[int, int]:
    """``flask_idempotency_requests_total`` in each worker's own file."""
    counted = {}
    for path in metrics_dir.glob("counter_*.db"):
        pid = int(path.stem.split("_")[1])
        metrics = MultiProcessCollector.merge([str(path)], accumulate=False)  # type: ignore[no-untyped-call]
        counted[pid] = sum(
            int(sample.value)
            for metric in metrics
            for sample in metric.samples
            if sample.name == REQUESTS
        )
    return counted


def wait_for_every_worker(url: str) -> None:
    """gunicorn answers once one worker is up; each adds its pool when its app is built."""
    wait_until(
        lambda: value(scrape(url), "flask_idempotency_pool_connections_max") >= WORKERS * POOL_SIZE,
        30,
        "every worker to build its app",
    )


def test_scraped_counters_add_up_over_three_workers(
    gunicorn_server: GunicornFactory, clean_db: str, clean_redis: str, tmp_path: Path
) -> None:
    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir()
    (metrics_dir / "counter_1.db").write_bytes(b"left over from an earlier run")
    server = gunicorn_server(
        "wsgi:app",
        config=REPO_ROOT / "gunicorn.conf.py",
        workers=WORKERS,
        worker_class="gthread",
        threads=2,
        health_path="/healthz",
        env={
            "DATABASE_URL": clean_db,
            "REDIS_URL": clean_redis,
            "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir),
            # Every scrape queries the table (tests/observability/test_observability.py checks the
            # once-per-interval limit).
            "METRICS_TABLE_STATS_INTERVAL": "0",
        },
    )
    url = server.url
    wait_for_every_worker(url)
    # Before any request: the contract's metric is there, with its outcome label.
    before = {labels["outcome"] for labels, _ in scrape(url)[REQUESTS]}
    assert {"executed", "replayed", "in_progress", "key_reused", "store_unavailable"} <= before
    sent: Counter[str] = Counter()
    for n in range(6):  # a new key each: the view runs and its 201 is stored
        assert charge(url, f"new-{n}") == 201
        sent["executed"] += 1
    # The first retry is answered from PostgreSQL and copies the answer to Redis
    # (IDEMPOTENCY_REDIS_OPTIONS["fill"] = "replay", the default); the next ones, from Redis.
    assert charge(url, "new-0") == 201
    sent["replayed/store"] += 1
    for _ in range(3):
        assert charge(url, "new-0") == 201
        sent["replayed/cache"] += 1
    assert charge(url, "new-1", {**BODY, "amount": 1}) == 422
    sent["key_reused"] += 1
    assert charge(url, "declined", {**BODY, "source": "tok_decline"}) == 402
    sent["executed"] += 1  # a decline is a final answer: stored
    for n in range(3):  # the view's validation 400 is not stored: released
        assert charge(url, f"invalid-{n}", {**BODY, "amount": "x"}) == 400
        sent["released"] += 1
    for _ in range(2):
        assert charge(url, None) == 400
        sent["missing_key"] += 1
    assert charge(url, "a b") == 400
    sent["invalid_key"] += 1

    # Each scrape is answered by one worker or another; every one counts all.
    for _ in range(2 * WORKERS):
        samples = scrape(url)
        assert by_outcome(samples) == sent
        assert value(samples, "flask_idempotency_claims_in_flight") == 0
        assert value(samples, "flask_idempotency_pool_connections_in_use") == 0
        assert value(samples, "flask_idempotency_pool_connections_max") == WORKERS * POOL_SIZE
        assert value(samples, "flask_idempotency_cache_lookups_total", result="hit") == 3
        assert value(samples, "flask_idempotency_redis_breaker_state", state="closed") == (WORKERS)
        # One claim per request that reached the store (not the cache hits, nor
        # the 400s refused before any claim), each timed once; new-1 was never
        # retried, so its 422 comes from the store.
        claims = sent["executed"] + sent["released"] + sent["replayed/store"] + sent["key_reused"]
        assert value(samples, "flask_idempotency_claim_duration_seconds_count") == claims
        assert (
            value(samples, "flask_idempotency_completion_duration_seconds_count")
            == (sent["executed"])
        )
        assert value(samples, "flask_idempotency_records", state="completed") == 7
        assert value(samples, "flask_idempotency_table_stats_up") == 1

    # The master emptied the directory it was given; more than one worker served
    # (and counted) requests, each in a file of its own.
    assert not (metrics_dir / "counter_1.db").exists()
    counted_by = requests_by_worker(metrics_dir)
    assert sum(counted_by.values()) == sum(sent.values())
    assert len([n for n in counted_by.values() if n]) >= 2, counted_by
    print(f"requests counted by each worker: {counted_by}; scraped by outcome: {dict(sent)}")

    # A worker killed outright: its counts stay, its live gauges go, and the
    # replacement worker's pool joins the sum.
    victim = child_pids(server.master_pid)[0]
    os.kill(victim, signal.SIGKILL)
    wait_until(
        lambda: (
            victim not in child_pids(server.master_pid)
            and len(child_pids(server.master_pid)) >= WORKERS
        ),
        15,
        "gunicorn to replace the killed worker",
    )
    assert not list(metrics_dir.glob(f"gauge_livesum_{victim}.db"))
    assert http_request("GET", url + "/healthz").status == 200
    samples = scrape(url)
    assert by_outcome(samples) == sent
    wait_for_every_worker(url)  # the new worker's pool too
    samples = scrape(url)
    assert value(samples, "flask_idempotency_pool_connections_max") == WORKERS * POOL_SIZE
