"""Redis outage: Redis is killed mid-load and comes back empty.

Redis only caches finished answers, so killing it must change nothing a
client can see: no error, and every answer what it would have been (a new
key runs once, a finished one replays the same bytes, now from PostgreSQL).
Once Redis is back, the fast path must resume on its own. That is proved the
only way a client could tell: with PostgreSQL cut off from the app (a proxy
in front of it), finished charges still replay, which only Redis can serve.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator

import pytest
import redis

from support.redis_server import ThrowawayRedis

from .figures import Figures
from .load import (
    Answer,
    Call,
    Connections,
    LoadLoop,
    charge_body,
    charge_call,
    percentile,
    run_all,
    status_counts,
)
from .stack import Stack, StackOptions, own_database, running_stack

pytestmark = pytest.mark.reliability

WARM_KEYS = 40
THREADS = 8
BEFORE = 1.5
OUTAGE = 3.0
AFTER = 1.5
#: The app's circuit breaker skips Redis for 5 s after failures, then tries again;
#: the fast path must be back well within this.
RESUME_LIMIT = 20.0


@pytest.fixture(scope="module")
def redis_server() -> Iterator[ThrowawayRedis]:
    with ThrowawayRedis() as server:
        yield server


@pytest.fixture(scope="module")
def cache_stack(server_database_url: str, redis_server: ThrowawayRedis) -> Iterator[Stack]:
    options = StackOptions(workers=3, pg_proxy=True)
    with (
        own_database(server_database_url) as url,
        running_stack(url, redis_server.url, options) as stack,
    ):
        yield stack


class Traffic:
    """Half new keys, half replays of finished ones; remembers every first answer."""

    def __init__(self, api_key: str, run_id: str) -> None:
        self.api_key = api_key
        self.run_id = run_id
        self.calls: dict[str, Call] = {}
        self.first: dict[str, Answer] = {}
        self._lock = threading.Lock()
        self._rng = random.Random(11)

    def new_call(self) -> Call:
        with self._lock:
            n = len(self.calls)
            key = f"redis-{self.run_id}{n}"
            self.calls[key] = charge_call(
                self.api_key, key, charge_body(900 + n, f"{self.run_id}{n}")
            )
            return self.calls[key]

    def next_call(self) -> Call:
        with self._lock:
            finished = list(self.first)
            if finished and self._rng.random() < 0.5:
                return self.calls[self._rng.choice(finished)]
        return self.new_call()

    def on_answer(self, answer: Answer) -> None:
        if answer.status == 201 and answer.replayed == "false":
            with self._lock:
                self.first.setdefault(answer.call.tag, answer)

    def replay_all(self, connections: Connections) -> list[Answer]:
        with self._lock:
            calls = [self.calls[key] for key in self.first]
        return run_all(connections, calls, threads=THREADS)

    def mismatches(self, answers: list[Answer]) -> list[str]:
        """Replays that are not the first answer's bytes (or are not replays at all)."""
        return [
            f"{a.call.tag}: {a.describe()}"
            for a in answers
            if a.status != 201 or a.replayed != "true" or a.body != self.first[a.call.tag].body
        ]


def test_redis_outage_changes_no_outcome_and_the_fast_path_resumes(
    cache_stack: Stack,
    redis_server: ThrowawayRedis,
    api_key: str,
    run_id: str,
    figures: Figures,
) -> None:
    stack = cache_stack
    assert stack.pg_proxy is not None
    cache = redis.Redis.from_url(redis_server.url, socket_timeout=5)
    traffic = Traffic(api_key, run_id)
    connections = stack.connections()
    try:
        warm = run_all(connections, [traffic.new_call() for _ in range(WARM_KEYS)], THREADS)
        for answer in warm:
            traffic.on_answer(answer)
        assert all(a.status == 201 and a.replayed == "false" for a in warm), status_counts(warm)
        # One retry each, from PostgreSQL, copies them to Redis (IDEMPOTENCY_REDIS_OPTIONS["fill"]
        # = "replay", the default: a first request writes nothing to Redis).
        retried = traffic.replay_all(connections)
        assert not traffic.mismatches(retried), traffic.mismatches(retried)[:10]
        cached_before = int(cache.dbsize())
        served_by_redis_before = _replays_without_postgres(stack, traffic, connections)

        loop = LoadLoop(
            connections, traffic.next_call, threads=THREADS, on_answer=traffic.on_answer, pause=0.02
        ).start()
        try:
            time.sleep(BEFORE)
            redis_server.stop()  # SIGKILL: a crash, and everything cached is gone
            down_at = time.monotonic()
            time.sleep(OUTAGE)
            up_at = time.monotonic()
            redis_server.start()
            time.sleep(AFTER)
        finally:
            answers = loop.stop()

        resumed_after, served_by_redis_after = _wait_for_fast_path(
            stack, traffic, connections, cache, up_at
        )
    finally:
        connections.close()
        cache.close()

    replays = [a for a in answers if a.replayed == "true"]
    fresh = [a for a in answers if a.replayed == "false"]
    during = [a for a in answers if a.started >= down_at and a.finished <= up_at]
    before = [a for a in answers if a.finished < down_at]
    calls_seen, charged = stack.processor_counts(run_id)
    rows = stack.charge_rows(run_id)
    figures(
        requests_sent=len(answers),
        outcomes=status_counts(answers),
        outcomes_during_outage=status_counts(during),
        errors=sum(1 for a in answers if a.status != 201),
        replays_not_identical=len(traffic.mismatches(replays)),
        p50_ms_before=round(percentile([a.finished - a.started for a in before], 0.5) * 1000),
        p99_ms_before=round(percentile([a.finished - a.started for a in before], 0.99) * 1000),
        p50_ms_during=round(percentile([a.finished - a.started for a in during], 0.5) * 1000),
        p99_ms_during=round(percentile([a.finished - a.started for a in during], 0.99) * 1000),
        cached_before=cached_before,
        replays_served_without_postgres_before=served_by_redis_before,
        fast_path_resumed_after_seconds=(
            round(resumed_after, 1) if resumed_after is not None else "never"
        ),
        replays_served_without_postgres_after=served_by_redis_after,
        executions=sum(calls_seen.values()),
        keys=len(traffic.calls),
        charge_rows=sum(rows.values()),
    )

    assert served_by_redis_before == WARM_KEYS, "the fast path was not in use before the outage"
    assert during, "no request was answered while Redis was down"
    assert all(a.status == 201 for a in answers), status_counts(answers)
    assert not traffic.mismatches(replays), traffic.mismatches(replays)[:10]
    assert len(fresh) + WARM_KEYS == len(traffic.calls), "a key ran twice or never"
    assert all(n == 1 for n in calls_seen.values()) and len(calls_seen) == len(traffic.calls)
    assert all(n == 1 for n in charged.values())
    assert all(n == 1 for n in rows.values()) and len(rows) == len(traffic.calls)
    assert resumed_after is not None, "the fast path did not resume after Redis came back"
    assert served_by_redis_after == len(traffic.first)


def _replays_without_postgres(stack: Stack, traffic: Traffic, connections: Connections) -> int:
    """Cut PostgreSQL off from the app and replay every finished key: only Redis can
    answer those. Returns how many came back as the original bytes."""
    assert stack.pg_proxy is not None
    stack.pg_proxy.cut()
    try:
        answers = traffic.replay_all(connections)
    finally:
        stack.pg_proxy.restore()
    return len(answers) - len(traffic.mismatches(answers))


def _wait_for_fast_path(
    stack: Stack,
    traffic: Traffic,
    connections: Connections,
    cache: redis.Redis[bytes],
    since: float,
) -> tuple[float | None, int]:
    """Replay finished keys (PostgreSQL up, which refills Redis) until every one is
    cached again and served without PostgreSQL. Returns (seconds since ``since``,
    replays served by Redis alone on the last try)."""
    served = 0
    while time.monotonic() - since < RESUME_LIMIT:
        refill = traffic.replay_all(connections)
        if any((a.status, a.code) == (503, "store_unavailable") for a in refill):
            # The last cut found keys not yet back in Redis: those replays had only
            # PostgreSQL, which was cut, and their failures opened the store's
            # breaker; it refuses (fails closed) until a probe after its cooldown.
            # A client retries after Retry-After: so does this loop.
            refill = [a for a in refill if a.status != 503]
            assert not traffic.mismatches(refill), traffic.mismatches(refill)[:10]
            time.sleep(0.5)
            continue
        assert not traffic.mismatches(refill), traffic.mismatches(refill)[:10]
        if int(cache.dbsize()) >= len(traffic.first):
            served = _replays_without_postgres(stack, traffic, connections)
            if served == len(traffic.first):
                return time.monotonic() - since, served
        time.sleep(0.5)
    return None, served
