"""Storm: 200 keys, each sent by 20 clients at the same instant, across the workers.

Every key must be executed exactly once (one processor call, one charge row),
every 2xx for a key must be byte-identical, and everything else must be a
``409 in_progress``. Executions are counted at the sources of truth (the
processor's ledger and the charges table), not from the answers.
"""

from __future__ import annotations

import pytest

from .figures import Figures
from .load import status_counts
from .stack import Stack
from .storm import assert_each_key_ran_once, run_storm, tally

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
    try:
        run = run_storm(
            stack,
            stack.connections(),
            api_key,
            run_id,
            keys=KEYS,
            duplicates=DUPLICATES,
            keys_per_wave=KEYS_PER_WAVE,
            replay_threads=16,
        )
    finally:
        stack.control(latency_seconds=0)
    counted = tally(stack, run_id)
    figures(
        requests_sent=len(run.storm),
        keys=KEYS,
        concurrent_per_key=DUPLICATES,
        seconds=round(run.seconds, 1),
        requests_per_second=round(len(run.storm) / run.seconds),
        outcomes=status_counts(run.storm),
        replays_after=status_counts(run.after),
        **counted.figures(),
    )
    assert_each_key_ran_once(stack, run, counted)
