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
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
from sa_harness import *  # noqa: F403  (the fixtures, used by name)
from sa_harness import (
    DIALECTS,
    Gates,
    new_label,
    post,
    record_states,
    rows,
    sa_url,
    serving,
    storm,
)

from support.gunicorn_server import GunicornServer
from support.http_client import HttpResponse
from support.pg_query import query
from support.records import end_leases
from support.waiting import wait_until

#: ``make test-transaction-mode`` runs this folder again with the claim in the
#: view's transaction (sa_app reads ``SA_APP_IDEMPOTENCY_*``).
TRANSACTION_MODE = os.environ.get("SA_APP_IDEMPOTENCY_CLAIM_MODE") == "transaction"


@pytest.fixture(scope="module", params=DIALECTS)
def server(
    request: pytest.FixtureRequest, database_url: str, gates: Gates
) -> Iterator[GunicornServer]:
    with serving(sa_url(database_url, str(request.param)), gates) as running:
        yield running


def test_storm_of_duplicates_runs_each_key_once(server: GunicornServer) -> None:
    storm(server, keys=4, duplicates=50)


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
    if TRANSACTION_MODE:
        # The claim was the killed session's transaction: it died with it.
        assert record_states(database_url).get("processing", 0) == 0
    else:
        assert record_states(database_url).get("processing", 0) >= 1
        assert end_leases(database_url) >= 1  # the dead holder's lease ran out
    retry = post(server, label)
    assert retry.status == 201, retry.body
    assert retry.headers["Idempotent-Replayed"] == "false"
    assert rows(url, label) == ["first"]
    replay = post(server, label)
    assert replay.headers["Idempotent-Replayed"] == "true" and replay.body == retry.body
    assert rows(url, label) == ["first"]


def _all_threads_stopped(pid: int) -> bool:
    """Whether every thread of process ``pid`` is stopped (``T``, or ``t`` when traced)."""
    states = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as stat:
                states.append(stat.read().rsplit(")", 1)[1].split()[0])
        except OSError:
            continue  # a thread that ended meanwhile
    return bool(states) and all(state in ("T", "t") for state in states)


def _stall_facts(database_url: str, pid: int) -> str:
    """The stalled worker's process state, and the records' states and live leases."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            process = stat.read().rsplit(")", 1)[1].split()[0]  # T: stopped
    except OSError:
        process = "gone"
    live = query(
        database_url,
        "SELECT count(*) FROM idempotency_records"
        " WHERE state = 'processing' AND lease_expires_at > now()",
    )[0][0]
    states = record_states(database_url)
    return f"worker {pid} state {process}, records {states}, live leases {live}"


@pytest.mark.skipif(
    TRANSACTION_MODE, reason="transaction claim mode has no lease: a stalled holder keeps its key"
)
def test_stalled_holder_is_fenced_after_a_takeover(
    server: GunicornServer, gates: Gates, database_url: str
) -> None:
    url = server.env["SA_APP_DATABASE_URL"]
    label = gate = new_label("fenced")
    holder = _in_background(lambda: post(server, label, headers={"X-Then": "gate", "X-Gate": gate}))
    pid = gates.wait_entered(gate)  # the holder has committed, and waits
    os.kill(pid, signal.SIGSTOP)  # stalled: its lease keeper stops with it
    try:
        # SIGSTOP goes to one thread of the worker (the main one, here), which stops
        # the others once it runs; on a loaded machine it waited for a CPU while the
        # view's thread woke from its sleep, found the gate open and completed the
        # attempt (CI: main thread "R", the record completed, the retry a replay).
        # Go on only once every thread of the worker is stopped.
        wait_until(lambda: _all_threads_stopped(pid), 10, f"worker {pid} to stop")
        assert end_leases(database_url) >= 1
        gates.open(gate)  # for when the holder resumes
        before = _stall_facts(database_url, pid)
        retry = post(server, label)  # taken over, on the other worker
        # (What to look at if this ever fails: a replay here means the record was
        # completed while the holder was meant to be stopped.)
        facts = f"before the retry: {before}; after: {_stall_facts(database_url, pid)}"
        assert retry.status == 201, f"{retry.body!r}; {facts}"
        assert retry.headers["Idempotent-Replayed"] == "false", facts
        assert rows(url, label) == ["first"], facts
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
