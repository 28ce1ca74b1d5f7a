"""Real concurrency: many threads, one key, through gunicorn, against real PostgreSQL."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import psycopg2

from support.core_app import CLIENT_AUTHORIZATION
from support.http_client import HttpResponse, http_request

GunicornFactory = Callable[..., Any]


def count_executions(database_url: str) -> int:
    with psycopg2.connect(database_url) as conn, conn.cursor() as cur:
        cur.execute("SELECT count(*) FROM core_executions")
        row = cur.fetchone()
    conn.close()
    assert row is not None
    return int(row[0])


def storm(url: str, key: str, body: dict[str, Any], clients: int) -> list[HttpResponse]:
    """``clients`` threads released at once by a barrier, all with the same key."""
    barrier = threading.Barrier(clients)
    results: list[HttpResponse] = []
    lock = threading.Lock()

    def client() -> None:
        barrier.wait()
        response = http_request(
            "POST",
            url + "/charges",
            {"Idempotency-Key": key, "Authorization": CLIENT_AUTHORIZATION},
            json=body,
            timeout=30,
        )
        with lock:
            results.append(response)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def test_sixty_concurrent_duplicates_run_the_view_once(
    gunicorn_server: GunicornFactory, clean_db: str
) -> None:
    server = gunicorn_server(
        "support.core_app:create_app()",
        env={
            "DATABASE_URL": clean_db,
            "CORE_APP_IDEMPOTENCY_DATABASE_OPTIONS": '{"pool_size": 24}',
        },
        workers=3,
        worker_class="gthread",
        threads=20,
    )
    first_wave = storm(server.url, "storm-key", {"sleep": 1.0}, clients=60)
    statuses = Counter(r.status for r in first_wave)
    print(f"first wave: {dict(statuses)}")
    assert len(first_wave) == 60
    assert set(statuses) <= {201, 409}
    assert statuses[201] >= 1
    for response in first_wave:
        if response.status == 409:
            assert response.headers["Retry-After"].isdigit()
            assert b'"in_progress"' in response.body
    assert count_executions(clean_db) == 1

    second_wave = storm(server.url, "storm-key", {"sleep": 1.0}, clients=30)
    bodies = {r.body for r in first_wave + second_wave if r.status == 201}
    print(f"second wave: {dict(Counter(r.status for r in second_wave))}")
    assert all(r.status == 201 for r in second_wave)
    assert all(r.headers["Idempotent-Replayed"] == "true" for r in second_wave)
    assert len(bodies) == 1, "every 2xx for one key must be byte-identical"
    assert count_executions(clean_db) == 1


def test_many_keys_in_parallel_each_run_once(
    gunicorn_server: GunicornFactory, clean_db: str
) -> None:
    server = gunicorn_server(
        "support.core_app:create_app()",
        env={"DATABASE_URL": clean_db},
        workers=2,
        worker_class="gthread",
        threads=8,
    )
    keys = [f"key-{i}" for i in range(20)]
    barrier = threading.Barrier(len(keys) * 3)
    results: dict[str, list[int]] = {k: [] for k in keys}
    lock = threading.Lock()

    def client(key: str) -> None:
        barrier.wait()
        response = http_request(
            "POST",
            server.url + "/charges",
            {"Idempotency-Key": key, "Authorization": CLIENT_AUTHORIZATION},
            json={"k": key},
            timeout=30,
        )
        with lock:
            results[key].append(response.status)

    threads = [threading.Thread(target=client, args=(k,)) for k in keys for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert count_executions(clean_db) == len(keys)
    for statuses in results.values():
        assert 201 in statuses and set(statuses) <= {201, 409}
