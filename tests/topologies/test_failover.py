"""Failover under load: a streaming standby is promoted while the payments API takes charges.

Two throwaway servers, a primary and a hot standby made from it with
``pg_basebackup -R`` (support/pg_topology.py), and the payments API under
gunicorn on a multi-host DSN naming both, ``target_session_attrs=read-write``:
libpq connects to whichever of them accepts writes. Clients keep sending new
keys and duplicates of keys already sent while the servers trade places:

* ``switchover``, the controlled way (what ``patronictl switchover`` or an
  operator by hand does): the old primary is stopped first, with a fast
  shutdown, whose walsender sends the standby every WAL record up to the
  shutdown checkpoint before it exits; only then is the standby promoted.
  Promoting first would leave two writable servers for a while, and the DSN
  would keep the API on the old one, writing what the new one never sees.
  Replication is asynchronous: a clean stop loses nothing.
* ``crash``: the old primary dies at once (an immediate shutdown: every
  process exits, nothing more reaches the standby), then the standby is
  promoted. With asynchronous replication a commit the primary acknowledged
  may never have reached the standby, and a client holding a ``201`` would get
  a different answer (a new charge id) on retry. So this variant runs
  synchronously (``synchronous_standby_names = '*'``): whatever COMMIT was
  acknowledged is on the standby, which replays it before it takes writes.
  To make completions race the crash on purpose, the commits wait for the
  standby to *apply* them (``synchronous_commit = remote_apply``) and the
  standby's replay is paused for ``RACE_WINDOW`` before the crash: every
  completion sent in that window is flushed on the standby but not yet
  acknowledged when the primary dies, its client gets a 503, and after the
  promotion it must be there, whole, and replayed to the retry. (With the
  default ``on`` the window is the same, only too short to hit at will.)

Between the old primary going away and the promotion (``DECISION``, a failover
manager making up its mind) neither server accepts a claim: the API must answer
``503 store_unavailable``, never a 500 and never run a view. After the
promotion the same workers serve again by themselves; after every key has been
retried, each key was charged once at the processor and has one charge row,
each client that got a ``201`` gets the same body again, and no record is
half-applied (a completed record without its charge row or the reverse).
"""

from __future__ import annotations

import dataclasses
import json
import random
import threading
import time
from collections import defaultdict
from collections.abc import Iterator

import pytest
from reliability.figures import Figures
from reliability.load import (
    Answer,
    Call,
    LoadLoop,
    charge_body,
    charge_call,
    retry_until_final,
    status_counts,
)
from reliability.stack import Stack, StackOptions

from support.http_client import http_request
from support.pg_topology import (
    PRIMARY_SETTINGS,
    StandbyPostgres,
    is_in_recovery,
    make_synchronous,
    multi_host_dsn,
    pause_replay,
    promote,
    wait_streaming,
)
from support.postgres_server import ThrowawayPostgres

pytestmark = pytest.mark.topology

LEASE = 4.0
PROCESSOR_TIMEOUT = 2.0
#: Requests are waiting on the processor when the primary goes: their completions
#: race the switch.
PROCESSOR_LATENCY = 0.2
THREADS = 8
#: Each client pauses between requests: fast 503s would otherwise flood the test
#: with thousands of keys to retry afterwards.
PAUSE = 0.05
#: Share of requests that repeat a key sent earlier (replays, or 409s while it runs).
DUPLICATES = 0.3
BEFORE = 2.0
#: Between the old primary going away and the promotion.
DECISION = 1.0
#: Crash variant: how long completions pile up unacknowledged before the crash.
RACE_WINDOW = 0.5
#: How long the API may take to charge again once the new primary takes writes.
RECOVERY_LIMIT = 10.0
AFTER = 3.0
#: From the first new charge on the new primary, every request must be served: no
#: worker may keep failing on connections to the old one. Each worker's store
#: breaker opened during the outage and lets one probe through per cooldown (the
#: default 1 s), so a worker may refuse for up to one cooldown after another
#: worker's first charge; then none may.
SETTLE = 1.0 + 0.5

#: What the API may answer at any time here: a charge (new or replayed), a
#: fail-closed 503, or a 409 for a duplicate of a key still running.
ALLOWED = {(201, None), (503, "store_unavailable"), (409, "in_progress")}


@dataclasses.dataclass
class Pair:
    """The two servers and how the test switches between them."""

    primary: ThrowawayPostgres
    standby: StandbyPostgres
    switch: str

    @property
    def dsn(self) -> str:
        return multi_host_dsn([self.primary, self.standby])


@pytest.fixture(params=["row", "transaction"])
def claim_mode(request: pytest.FixtureRequest) -> str:
    mode: str = request.param
    return mode


@pytest.fixture(params=["switchover", "crash"])
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    switch: str = request.param
    with ThrowawayPostgres(settings=PRIMARY_SETTINGS) as primary:
        with StandbyPostgres(primary) as standby:
            wait_streaming(primary)
            if switch == "crash":
                make_synchronous(primary, level="remote_apply")
            yield Pair(primary, standby, switch)


@pytest.fixture
def failover_stack(pair: Pair, claim_mode: str) -> Iterator[Stack]:
    options = StackOptions(
        workers=3,
        lease_seconds=LEASE,
        processor_timeout=PROCESSOR_TIMEOUT,
        extra_env={"IDEMPOTENCY_CLAIM_MODE": claim_mode},
    )
    # The test's own queries use the same DSN, so they too find the writable server.
    stack = Stack(database_url=pair.dsn, redis_url=None, options=options)
    try:
        yield stack.start()
    finally:
        stack.close()


class Traffic:
    """New keys, and repeats of keys already sent (finished or still running)."""

    def __init__(self, api_key: str, run_id: str) -> None:
        self.api_key = api_key
        self.run_id = run_id
        self.calls: dict[str, Call] = {}
        self._lock = threading.Lock()
        self._rng = random.Random(15)

    def next_call(self) -> Call:
        with self._lock:
            if self.calls and self._rng.random() < DUPLICATES:
                recent = list(self.calls.values())[-4 * THREADS :]
                return self._rng.choice(recent)
            n = len(self.calls)
            key = f"fo-{self.run_id}{n}"
            self.calls[key] = charge_call(
                self.api_key, key, charge_body(900 + n, f"{self.run_id}{n}")
            )
            return self.calls[key]

    def customer(self, key: str) -> str:
        return key.removeprefix("fo-")


def test_failover_under_load(
    failover_stack: Stack,
    pair: Pair,
    claim_mode: str,
    api_key: str,
    run_id: str,
    figures: Figures,
) -> None:
    stack = failover_stack
    stack.control(latency_seconds=PROCESSOR_LATENCY)
    traffic = Traffic(api_key, run_id)
    connections = stack.connections()
    workers_before = stack.app.worker_pids()
    loop = LoadLoop(connections, traffic.next_call, threads=THREADS, pause=PAUSE).start()
    try:
        time.sleep(BEFORE)
        if pair.switch == "crash":
            pause_replay(pair.standby)
            time.sleep(RACE_WINDOW)
        switch_at = time.monotonic()
        pair.primary.stop("fast" if pair.switch == "switchover" else "immediate")
        gone_at = time.monotonic()
        health_during = http_request("GET", stack.url + "/healthz", timeout=10).status
        time.sleep(max(0.0, DECISION - (time.monotonic() - gone_at)))
        promote_at = time.monotonic()
        promote(pair.standby)
        promoted_at = time.monotonic()
        recovered_at = _wait_for_fresh_charge(loop, promoted_at)
        time.sleep(AFTER)
    finally:
        answers = loop.stop()
        stack.control(latency_seconds=0)
    workers_after = stack.app.worker_pids()

    try:
        time.sleep(LEASE + 0.5)  # claims orphaned on the old primary expire
        final, retries = retry_until_final(connections, list(traffic.calls.values()), deadline=40)
    finally:
        connections.close()

    in_flight = [a for a in answers if a.started < switch_at < a.finished]
    during = [a for a in answers if a.started >= gone_at and a.finished <= promote_at]
    settled = recovered_at + SETTLE if recovered_at is not None else float("inf")
    after = [a for a in answers if a.started >= settled]
    calls_seen, charged = stack.processor_counts(run_id)
    rows = stack.charge_ids(run_id)
    records = _records(stack)
    first_answers = _first_answers(answers)
    # Keys whose request the switch cut before any client saw a 201 for them: each
    # either committed in time (durable, replayed on retry) or not at all (run again).
    answered = {a.call.tag for a in answers if a.status == 201}
    raced = {a.call.tag for a in in_flight if a.status != 201} - answered
    durable = {key for key in raced if final[key].replayed == "true"}
    figures(
        switch=pair.switch,
        claim_mode=claim_mode,
        requests_sent=len(answers),
        keys=len(traffic.calls),
        outcomes=status_counts(answers),
        outcomes_in_flight_at_the_switch=status_counts(in_flight),
        outcomes_while_no_primary=status_counts(during),
        outcomes_while_promoting=status_counts(
            a for a in answers if a.started >= promote_at and a.finished <= promoted_at
        ),
        outcomes_after_recovery=status_counts(after),
        healthz_while_no_primary=health_during,
        seconds_old_primary_took_to_stop=round(gone_at - switch_at, 2),
        seconds_to_promote=round(promoted_at - promote_at, 2),
        seconds_to_recover_after_promotion=(
            round(recovered_at - promoted_at, 2) if recovered_at is not None else "never"
        ),
        raced_keys_durable_replayed=len(durable),
        raced_keys_executed_on_retry=len(raced - durable),
        retries_after=dict(retries),
        processor_calls=dict(stack.processor_outcomes(run_id)),
        effective_charges=sum(charged.values()),
        charge_rows=sum(len(ids) for ids in rows.values()),
        records=dict(stack.record_states()),
    )

    outside = [a.describe() for a in answers if (a.status, a.code) not in ALLOWED]
    assert not outside, f"answers outside 201/503/409: {outside[:10]}"
    for answer in answers:
        if answer.status == 503:
            assert answer.headers.get("retry-after", "").isdigit()
            assert "idempotent-replayed" not in answer.headers
    assert during, "no request was answered while there was no primary"
    assert all(a.status == 503 for a in during), status_counts(during)
    assert health_during == 503
    assert recovered_at is not None, "no new charge succeeded after the promotion"
    assert after and not [a for a in after if a.status == 503], status_counts(after)
    assert set(workers_after) == set(workers_before), "workers restarted"
    assert not is_in_recovery(pair.standby)
    if pair.switch == "crash":
        assert durable, "no completion flushed on the standby before the crash came back"

    by_key: dict[str, set[bytes]] = defaultdict(set)
    for answer in [*answers, *final.values()]:
        if answer.status == 201:
            by_key[answer.call.tag].add(answer.body)
    for key in traffic.calls:
        customer = traffic.customer(key)
        assert final[key].status == 201, f"{key}: {final[key].describe()}"
        assert charged[customer] == 1, f"{key}: {charged[customer]} effective charges"
        assert len(rows.get(customer, [])) == 1, f"{key}: charge rows {rows.get(customer)}"
        # A 201 a client saw before the switch is what it sees after: no lost commit.
        assert len(by_key[key]) == 1, f"{key}: different 2xx bodies ({first_answers.get(key)})"
    assert calls_seen

    # Not half-applied: each completed record stores the answer of exactly one
    # charge row, and each charge row is the stored answer of one completed record.
    assert set(records.values()) == {"completed"}, records
    stored = _stored_charge_ids(stack)
    charge_ids = sorted(i for ids in rows.values() for i in ids)
    assert sorted(stored) == charge_ids, "a completion without its charge, or the reverse"
    assert len(stored) == len(traffic.calls)


def _wait_for_fresh_charge(loop: LoadLoop, since: float) -> float | None:
    """When the first new charge started after ``since`` succeeded, within the limit."""
    deadline = since + RECOVERY_LIMIT
    while time.monotonic() < deadline:
        for answer in loop.answers():
            if answer.started >= since and answer.status == 201 and answer.replayed == "false":
                return answer.finished
        time.sleep(0.1)
    return None


def _first_answers(answers: list[Answer]) -> dict[str, str]:
    first: dict[str, str] = {}
    for answer in answers:
        first.setdefault(answer.call.tag, answer.describe())
    return first


def _records(stack: Stack) -> dict[bytes, str]:
    rows = stack.query("SELECT record_key, state FROM idempotency_records")
    return {bytes(key): str(state) for key, state in rows}


def _stored_charge_ids(stack: Stack) -> list[str]:
    """The charge id in each completed record's stored 201 body."""
    rows = stack.query(
        "SELECT body FROM idempotency_records WHERE state = 'completed' AND status_code = 201"
    )
    return [str(json.loads(bytes(body))["id"]) for (body,) in rows]
