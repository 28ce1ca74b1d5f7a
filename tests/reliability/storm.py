"""The duplicate storm, one drill for every server: keys sent by many clients at
once, wave by wave, then each replayed; counted at the sources of truth (the
processor's ledger and the charges table), not from the answers."""

from __future__ import annotations

import dataclasses
import time
from collections import Counter, defaultdict

from .load import Answer, Call, Connections, charge_body, charge_call, run_all, run_waves
from .stack import Stack

#: What a storm may answer: the one execution, or a duplicate meeting its running claim.
ALLOWED = {(201, None), (409, "in_progress")}


@dataclasses.dataclass
class Storm:
    keys: list[str]
    #: key -> the processor's customer of its charge.
    customers: dict[str, str]
    storm: list[Answer]
    after: list[Answer]
    seconds: float


def run_storm(
    stack: Stack,
    connections: Connections,
    api_key: str,
    prefix: str,
    *,
    keys: int,
    duplicates: int,
    keys_per_wave: int,
    replay_threads: int,
) -> Storm:
    """Each of ``keys`` keys sent by ``duplicates`` clients at once, ``keys_per_wave``
    keys a wave, then every key once more (a replay); closes ``connections``."""
    calls: dict[str, Call] = {}
    customers: dict[str, str] = {}
    for i in range(keys):
        key, customers_key = f"storm-{prefix}{i}", f"{prefix}{i}"
        calls[key] = charge_call(api_key, key, charge_body(1000 + i, customers_key), tag=key)
        customers[key] = customers_key
    order = list(calls)
    waves = [
        [calls[key] for key in order[start : start + keys_per_wave] for _ in range(duplicates)]
        for start in range(0, keys, keys_per_wave)
    ]
    started = time.monotonic()
    try:
        storm = run_waves(connections, waves)
        seconds = time.monotonic() - started
        # Afterwards every key must replay the same bytes, from wherever it is stored.
        after = run_all(connections, list(calls.values()), threads=replay_threads)
    finally:
        connections.close()
    return Storm(order, customers, storm, after, seconds)


@dataclasses.dataclass
class Tally:
    """What the sources of truth counted for a storm's keys."""

    calls_seen: Counter[str]
    charged: Counter[str]
    rows: dict[str, list[str]]

    @property
    def executions(self) -> int:
        return sum(self.calls_seen.values())

    @property
    def duplicates(self) -> int:
        return sum(n - 1 for n in self.calls_seen.values() if n > 1) + sum(
            len(ids) - 1 for ids in self.rows.values() if len(ids) > 1
        )

    def figures(self) -> dict[str, int]:
        return {
            "executions": self.executions,
            "charges": sum(self.charged.values()),
            "charge_rows": sum(len(ids) for ids in self.rows.values()),
            "duplicates": self.duplicates,
        }


def tally(stack: Stack, prefix: str) -> Tally:
    calls_seen, charged = stack.processor_counts(prefix)
    return Tally(calls_seen, charged, stack.charge_ids(prefix))


def assert_each_key_ran_once(stack: Stack, run: Storm, counted: Tally) -> None:
    """Every answer a 201 or a 409 in_progress (with Retry-After), every key executed
    exactly once with one charge row, its 2xx bodies byte-identical and replayed
    afterwards."""
    unexpected = [a.describe() for a in run.storm if (a.status, a.code) not in ALLOWED]
    assert not unexpected, (
        f"answers outside 201 / 409 in_progress: {unexpected[:10]}; "
        f"the app said: {stack.app_warnings()}"
    )
    for answer in run.storm:
        if answer.status == 409:
            assert answer.headers.get("retry-after", "").isdigit()
    after = run.after
    assert all(a.status == 201 and a.replayed == "true" for a in after), [
        a.describe() for a in after if a.status != 201 or a.replayed != "true"
    ][:10]
    assert counted.duplicates == 0
    assert counted.executions == len(run.keys)
    by_key: dict[str, list[Answer]] = defaultdict(list)
    for answer in run.storm + after:
        by_key[answer.call.tag].append(answer)
    rows = counted.rows
    for key in run.keys:
        customer = run.customers[key]
        answers = by_key[key]
        fresh = [a for a in answers if a.status == 201 and a.replayed == "false"]
        assert len(fresh) == 1, f"{key}: {len(fresh)} answers ran the view"
        assert counted.calls_seen[customer] == 1 and counted.charged[customer] == 1, key
        assert len(rows.get(customer, [])) == 1, key
        bodies = {a.body for a in answers if 200 <= a.status < 300}
        assert len(bodies) == 1, f"{key}: {len(bodies)} different 2xx bodies"
        assert fresh[0].json()["id"] == rows[customer][0], key
