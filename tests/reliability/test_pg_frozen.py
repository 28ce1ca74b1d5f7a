"""A frozen PostgreSQL (every server process stopped, its sockets open) under load.

A server that stops answering sends nothing: no error, no RST, and its kernel
still ACKs, so only the extension's own deadline (statement timeout + grace,
enforced by the watchdog) ends a statement. Every request must get its ``503
store_unavailable`` within a bounded number of deadlines, not wait on the frozen
server: the store's circuit breaker makes the requests behind the first ones
fail at once. The bound is two deadlines (``ANSWER_BOUND``): a request that
queued for a worker thread behind requests stuck for one deadline, and was
admitted before its worker's breaker opened, then takes its own. (The engine
before 0.3 held this to one deadline under this test's load by connecting in a
thread of its own that a request could abandon; SQLAlchemy's pool connects in
the request's thread, bounded by the deadline's connect timeout. Under a quiet
machine the answers still come within one deadline: the figures say so.)

The test freezes a throwaway server of its own (SIGSTOP to the postmaster and
each of its children) while clients keep sending, records the latency of every
answer, thaws it (SIGCONT), and checks that service resumes and that no key
was executed twice.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections import defaultdict
from collections.abc import Iterator

import psycopg2
import pytest

from support.gunicorn_server import GunicornServer, child_pids
from support.postgres_server import ThrowawayPostgres

from .figures import Figures
from .load import Answer, Call, Connections, LoadLoop, percentile, retry_until_final, status_counts

pytestmark = pytest.mark.reliability

STATEMENT_TIMEOUT = 1.0
#: The extension's deadline for one statement: statement_timeout + 1 s of grace.
DEADLINE = STATEMENT_TIMEOUT + 1.0
#: What an answer may take beyond the deadline: the watchdog's 0.1 s polls, a
#: loaded two-core machine, the HTTP round trip.
SLACK = 0.75
#: The latest any answer may come while the server is frozen (see the docstring).
ANSWER_BOUND = 2 * DEADLINE + SLACK
WORKERS = 2
THREADS = 16
#: Fewer connections than threads: some requests wait for a connection.
POOL_SIZE = 10
CLIENTS = 40
#: Each client retries its key after a 503 as a client would, after this pause.
PAUSE = 0.05
BEFORE = 2.0
FROZEN = 6.0
#: How long after the thaw a new key must succeed again.
RECOVERY_LIMIT = 8.0
AFTER = 1.5


@pytest.fixture(scope="module")
def pg_server() -> Iterator[ThrowawayPostgres]:
    with ThrowawayPostgres() as server:
        yield server


def server_pids(server: ThrowawayPostgres) -> list[int]:
    """The postmaster (from its pid file) and all its children."""
    postmaster = int((server.datadir / "postmaster.pid").read_text().splitlines()[0])
    return [postmaster, *child_pids(postmaster)]


class Freezer:
    """SIGSTOP every process of a server; SIGCONT them again (also on failure)."""

    def __init__(self, server: ThrowawayPostgres) -> None:
        self.server = server
        self.stopped: list[int] = []

    def freeze(self) -> None:
        postmaster, *_ = server_pids(self.server)
        os.kill(postmaster, signal.SIGSTOP)  # first: no new child forks after the listing
        self.stopped.append(postmaster)
        for pid in child_pids(postmaster):
            try:
                os.kill(pid, signal.SIGSTOP)
                self.stopped.append(pid)
            except ProcessLookupError:
                pass

    def thaw(self) -> None:
        for pid in reversed(self.stopped):
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        self.stopped = []


class Clients:
    """Each client thread works on one key until it has a final answer, then takes
    a new one; every answer is kept with its timing."""

    def __init__(self, run: str) -> None:
        self.run = run
        self._local = threading.local()
        self._lock = threading.Lock()
        self._count = 0
        self.calls: dict[str, Call] = {}

    def next_call(self) -> Call:
        call: Call | None = getattr(self._local, "call", None)
        if call is None:
            with self._lock:
                self._count += 1
                key = f"frozen-{self.run}-{self._count}"
                call = Call(
                    "POST",
                    "/work",
                    (("Authorization", "Bearer frozen-test"), ("Idempotency-Key", key)),
                    b"",
                    key,
                )
                self.calls[key] = call
            self._local.call = call
        return call

    def on_answer(self, answer: Answer) -> None:
        if answer.status == 201:
            self._local.call = None  # done: the next request is a new key


def _latency(answer: Answer) -> float:
    return answer.finished - answer.started


def _executions(answers: list[Answer]) -> dict[str, set[str]]:
    found: dict[str, set[str]] = defaultdict(set)
    for answer in answers:
        if answer.status == 201:
            found[answer.call.tag].add(json.loads(answer.body)["execution"])
    return found


@pytest.mark.parametrize("variant", ["row", "transaction", "engine"])
def test_frozen_postgres_answers_503_within_the_deadline_and_recovers(
    pg_server: ThrowawayPostgres, variant: str, figures: Figures
) -> None:
    database = f"frozen_{variant}"
    admin = psycopg2.connect(pg_server.dsn)
    admin.autocommit = True
    with admin.cursor() as cur:
        cur.execute(f"CREATE DATABASE {database}")
    admin.close()
    env = {
        "DATABASE_URL": pg_server.dsn_for(database),
        "FROZEN_APP_STATEMENT_TIMEOUT": f"{STATEMENT_TIMEOUT:g}",
        "FROZEN_APP_POOL_SIZE": str(POOL_SIZE),
        "FROZEN_APP_CLAIM_MODE": "transaction" if variant == "transaction" else "row",
        "FROZEN_APP_ENGINE": "1" if variant == "engine" else "0",
    }
    app = GunicornServer(
        "support.frozen_app:create_app()",
        workers=WORKERS,
        worker_class="gthread",
        threads=THREADS,
        env=env,
        health_path="/healthz",
    )
    freezer = Freezer(pg_server)
    clients = Clients(variant)
    with app:
        connections = Connections(app.url, timeout=60)
        loop = LoadLoop(
            connections,
            clients.next_call,
            threads=CLIENTS,
            on_answer=clients.on_answer,
            pause=PAUSE,
        ).start()
        try:
            time.sleep(BEFORE)
            freezer.freeze()
            frozen_at = time.monotonic()  # after the last SIGSTOP: the freeze is whole
            time.sleep(FROZEN)
            thawed_at = time.monotonic()
            freezer.thaw()
            recovered_at = _wait_for_fresh_success(loop, thawed_at)
            time.sleep(AFTER)
        finally:
            freezer.thaw()
            answers = loop.stop()
        try:
            final, retries = retry_until_final(
                connections, list(clients.calls.values()), deadline=30
            )
        finally:
            connections.close()
        app_log = app.log_text()

    overlapping = [a for a in answers if a.finished > frozen_at and a.started < thawed_at]
    within = [a for a in overlapping if a.started >= frozen_at and a.finished <= thawed_at]
    latencies = [_latency(a) for a in overlapping]
    slow = sorted((a for a in overlapping if _latency(a) > ANSWER_BOUND), key=_latency)
    figures(
        variant=variant,
        requests_sent=len(answers),
        keys=len(clients.calls),
        outcomes_while_frozen=status_counts(within),
        answers_overlapping_the_freeze=len(overlapping),
        latency_max=round(max(latencies, default=0.0), 3),
        latency_p99=round(percentile(latencies, 0.99), 3),
        latency_p50=round(percentile(latencies, 0.50), 3),
        over_two_deadlines_plus_slack=len(slow),
        over_one_deadline_plus_slack=sum(1 for a in overlapping if _latency(a) > DEADLINE + SLACK),
        slowest=[
            f"{a.describe()} at +{a.started - frozen_at:.2f} s took {_latency(a):.2f} s "
            f"(in the app: {a.headers.get('x-app-seconds', '?')} s)"
            for a in slow[-10:]
        ],
        seconds_to_recover=(
            round(recovered_at - thawed_at, 2) if recovered_at is not None else "never"
        ),
        retries_after=dict(retries),
        breaker_opened=app_log.count("store circuit breaker open,"),
        breaker_closed=app_log.count("store circuit breaker closed"),
    )

    assert within, "no request was answered while PostgreSQL was frozen"
    wrong = [a.describe() for a in within if (a.status, a.code) != (503, "store_unavailable")]
    assert not wrong, f"answers other than 503 store_unavailable while frozen: {wrong[:10]}"
    assert all(a.headers.get("retry-after", "").isdigit() for a in within)
    assert not slow, (
        f"{len(slow)} answers took longer than two deadlines ({DEADLINE} s) + {SLACK} s: "
        f"up to {_latency(slow[-1]):.2f} s"
    )
    assert recovered_at is not None, "no new key succeeded after PostgreSQL was thawed"
    assert "store circuit breaker open," in app_log
    assert "store circuit breaker closed" in app_log

    executions = _executions([*answers, *final.values()])
    for key in clients.calls:
        assert final[key].status == 201, f"{key}: {final[key].describe()}"
        assert len(executions[key]) == 1, f"{key} executed {len(executions[key])} times"
    fresh: dict[str, int] = defaultdict(int)
    for answer in [*answers, *final.values()]:
        if answer.status == 201 and answer.replayed == "false":
            fresh[answer.call.tag] += 1
    assert max(fresh.values()) == 1, "a key was answered as new more than once"


def _wait_for_fresh_success(loop: LoadLoop, since: float) -> float | None:
    """When the first request sent after ``since`` succeeded, within the limit."""
    deadline = since + RECOVERY_LIMIT
    while time.monotonic() < deadline:
        for answer in loop.answers():
            if answer.started >= since and answer.status == 201:
                return answer.finished
        time.sleep(0.1)
    return None
