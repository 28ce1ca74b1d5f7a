"""Contract section 6 through real gunicorn (2 workers x 32 threads) and PostgreSQL.

The Flask-SQLAlchemy app (``sa_app``) on both dialects: a storm of concurrent
duplicates, a worker SIGKILLed between the view's ``commit()`` and the stored
answer, and a holder stalled (SIGSTOP) past its lease while a retry takes its
key over. Each test counts its rows in PostgreSQL; leases are ended in SQL,
never waited out.
"""

from __future__ import annotations

import http.client
import os
import signal
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
from sa_harness import *  # noqa: F403  (the fixtures, used by name)
from sa_harness import (
    API_KEY,
    DIALECTS,
    GUNICORN_PYTHONPATH,
    Gates,
    new_label,
    record_states,
    rows,
    sa_url,
)

from support.gunicorn_server import GunicornServer
from support.http_client import HttpResponse, http_request
from support.records import end_leases

WORKERS = 2
THREADS = 32
#: Connections per worker: fewer than its threads, as in production; waiting
#: duplicates give theirs back while they wait.
POOL_SIZE = 12
#: Duplicates wait for the first attempt and replay it (the contract's opt-in wait mode),
#: so every answer of a storm is the same 201.
WAIT_SECONDS = 10


@pytest.fixture(scope="module", params=DIALECTS)
def server(
    request: pytest.FixtureRequest, database_url: str, gates: Gates
) -> Iterator[GunicornServer]:
    env = {
        "PYTHONPATH": GUNICORN_PYTHONPATH,
        "SA_APP_DATABASE_URL": sa_url(database_url, str(request.param)),
        "SA_APP_GATE_DIR": str(gates.root),
        "SA_APP_SQLALCHEMY_POOL_SIZE": str(POOL_SIZE),
        "SA_APP_IDEMPOTENCY_WAIT": str(WAIT_SECONDS),
    }
    running = GunicornServer(
        "sa_app:create_app()",
        env=env,
        workers=WORKERS,
        worker_class="gthread",
        threads=THREADS,
    )
    try:
        running.start()
        yield running
    finally:
        running.stop()
        print(f"--- {running!r} log ---\n{running.log_text()[-6000:]}")
        running.close()


def post(
    server: GunicornServer,
    label: str,
    *,
    headers: dict[str, str] | None = None,
    body: dict[str, object] | None = None,
    timeout: float = 30.0,
) -> HttpResponse:
    sent = {"Authorization": f"Bearer {API_KEY}", "Idempotency-Key": label, **(headers or {})}
    return http_request(
        "POST",
        server.url + "/transfers",
        sent,
        json=body or {"label": label, "amount": 100},
        timeout=timeout,
    )


def test_storm_of_duplicates_runs_each_key_once(server: GunicornServer) -> None:
    keys, duplicates = 4, 50
    labels = [new_label("storm") for _ in range(keys)]
    start = threading.Barrier(keys * duplicates)

    def send(label: str) -> HttpResponse:
        start.wait()
        return post(server, label, body={"label": label, "then": "sleep", "seconds": 0.3})

    with ThreadPoolExecutor(max_workers=keys * duplicates) as pool:
        futures = {label: [pool.submit(send, label) for _ in range(duplicates)] for label in labels}
        answers = {label: [f.result(timeout=60) for f in fs] for label, fs in futures.items()}

    for label, got in answers.items():
        statuses = sorted({a.status for a in got})
        assert statuses == [201], f"{label}: {statuses} {got[0].body!r}"
        assert len({a.body for a in got}) == 1, f"{label}: different answers"
        replayed = sorted(a.headers["Idempotent-Replayed"] for a in got)
        assert replayed == ["false"] + ["true"] * (duplicates - 1), label
        assert rows(server.env["SA_APP_DATABASE_URL"], label) == ["first"], label


def _in_background(send: Callable[[], HttpResponse]) -> Future[HttpResponse | BaseException]:
    """``send()`` on a thread of its own; its answer, or the error of a cut connection."""
    pool = ThreadPoolExecutor(max_workers=1)

    def run() -> HttpResponse | BaseException:
        try:
            return send()
        except (OSError, http.client.HTTPException) as exc:
            return exc

    future = pool.submit(run)
    pool.shutdown(wait=False)
    return future


def test_worker_killed_after_commit_keeps_nothing_and_the_retry_runs_once(
    server: GunicornServer, gates: Gates, database_url: str
) -> None:
    url = server.env["SA_APP_DATABASE_URL"]
    label = gate = new_label("killed")
    cut = _in_background(lambda: post(server, label, headers={"X-Then": "gate", "X-Gate": gate}))
    pid = gates.wait_entered(gate)  # the view has committed, and waits
    server.kill_worker(pid)
    server.wait_for_workers(exclude=[pid])
    outcome = cut.result(timeout=30)
    assert not isinstance(outcome, HttpResponse), f"the killed attempt answered {outcome}"
    assert rows(url, label) == [], "a killed attempt's commit was kept"
    assert record_states(database_url).get("processing", 0) >= 1

    assert end_leases(database_url) >= 1  # the dead holder's lease ran out
    retry = post(server, label)
    assert retry.status == 201, retry.body
    assert retry.headers["Idempotent-Replayed"] == "false"
    assert rows(url, label) == ["first"]
    replay = post(server, label)
    assert replay.headers["Idempotent-Replayed"] == "true" and replay.body == retry.body
    assert rows(url, label) == ["first"]


def test_stalled_holder_is_fenced_after_a_takeover(
    server: GunicornServer, gates: Gates, database_url: str
) -> None:
    url = server.env["SA_APP_DATABASE_URL"]
    label = gate = new_label("fenced")
    holder = _in_background(lambda: post(server, label, headers={"X-Then": "gate", "X-Gate": gate}))
    pid = gates.wait_entered(gate)  # the holder has committed, and waits
    os.kill(pid, signal.SIGSTOP)  # stalled: its lease keeper stops with it
    try:
        assert end_leases(database_url) >= 1
        gates.open(gate)  # for when the holder resumes
        retry = post(server, label)  # taken over, on the other worker
        assert retry.status == 201, retry.body
        assert retry.headers["Idempotent-Replayed"] == "false"
        assert rows(url, label) == ["first"]
    finally:
        os.kill(pid, signal.SIGCONT)

    late = holder.result(timeout=30)
    assert isinstance(late, HttpResponse), f"the holder got no answer: {late!r}"
    assert late.status == 409, late.body
    assert late.json()["error"]["code"] == "lease_lost"
    assert late.headers["Retry-After"].isdigit()
    assert rows(url, label) == ["first"], "the fenced holder's commit was kept"
    replay = post(server, label)
    assert replay.headers["Idempotent-Replayed"] == "true" and replay.body == retry.body
