"""Storm: 200 keys, each sent by 20 clients at the same instant, across the workers.

Every key must be executed exactly once (one processor call, one charge row),
every 2xx for a key must be byte-identical, and everything else must be a
``409 in_progress``. Executions are counted at the sources of truth (the
processor's ledger and the charges table), not from the answers.
"""

from __future__ import annotations

import time
from collections import defaultdict

import pytest

from .figures import Figures
from .load import Answer, Call, charge_body, charge_call, run_all, run_waves, status_counts
from .stack import Stack

pytestmark = pytest.mark.reliability

KEYS = 200
DUPLICATES = 20
#: Keys per wave: 3 x 20 = 60 client threads fire together, each on its own
#: keep-alive connection, which gunicorn spreads over the workers.
KEYS_PER_WAVE = 3
#: Long enough that the duplicates of a wave meet a running claim (409), short
#: enough that late ones meet a finished record (replay): both paths are exercised.
PROCESSOR_LATENCY = 0.05


def test_storm_executes_each_key_exactly_once(
    stack: Stack, api_key: str, run_id: str, figures: Figures
) -> None:
    stack.control(latency_seconds=PROCESSOR_LATENCY)
    calls: dict[str, Call] = {}
    for i in range(KEYS):
        key = f"storm-{run_id}{i}"
        calls[key] = charge_call(api_key, key, charge_body(1000 + i, f"{run_id}{i}"), tag=key)
    keys = list(calls)
    waves = [
        [calls[key] for key in keys[start : start + KEYS_PER_WAVE] for _ in range(DUPLICATES)]
        for start in range(0, KEYS, KEYS_PER_WAVE)
    ]

    connections = stack.connections()
    started = time.monotonic()
    try:
        storm = run_waves(connections, waves)
        storm_seconds = time.monotonic() - started
        # Afterwards every key must replay the same bytes, from wherever it is stored.
        after = run_all(connections, list(calls.values()), threads=16)
    finally:
        connections.close()
        stack.control(latency_seconds=0)

    by_key: dict[str, list[Answer]] = defaultdict(list)
    for answer in storm + after:
        by_key[answer.call.tag].append(answer)
    calls_seen, charged = stack.processor_counts(run_id)
    rows = stack.charge_ids(run_id)
    executions = sum(calls_seen.values())
    duplicates = sum(n - 1 for n in calls_seen.values() if n > 1) + sum(
        len(ids) - 1 for ids in rows.values() if len(ids) > 1
    )
    figures(
        requests_sent=len(storm),
        keys=KEYS,
        concurrent_per_key=DUPLICATES,
        seconds=round(storm_seconds, 1),
        requests_per_second=round(len(storm) / storm_seconds),
        outcomes=status_counts(storm),
        executions=executions,
        charges=sum(charged.values()),
        charge_rows=sum(len(ids) for ids in rows.values()),
        duplicates=duplicates,
        replays_after=status_counts(after),
    )

    unexpected = [a.describe() for a in storm if (a.status, a.code) not in _ALLOWED]
    assert not unexpected, (
        f"answers outside 201 / 409 in_progress: {unexpected[:10]}; "
        f"the app said: {stack.app_warnings()}"
    )
    for answer in storm:
        if answer.status == 409:
            assert answer.headers.get("retry-after", "").isdigit()
    assert all(a.status == 201 and a.replayed == "true" for a in after), status_counts(after)

    assert duplicates == 0
    assert executions == KEYS
    for i, key in enumerate(keys):
        customer = f"{run_id}{i}"
        answers = by_key[key]
        fresh = [a for a in answers if a.status == 201 and a.replayed == "false"]
        assert len(fresh) == 1, f"{key}: {len(fresh)} answers ran the view"
        assert calls_seen[customer] == 1 and charged[customer] == 1
        assert len(rows.get(customer, [])) == 1
        bodies = {a.body for a in answers if 200 <= a.status < 300}
        assert len(bodies) == 1, f"{key}: {len(bodies)} different 2xx bodies"
        assert fresh[0].json()["id"] == rows[customer][0]


_ALLOWED = {(201, None), (409, "in_progress")}
