"""A claim by either release shuts out the other: while a view runs on one, a
retry on the other is ``409 in_progress`` and never runs the view."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from .answers import assert_error, assert_replays
from .rollout import Stack, new_key
from .test_replay import DIRECTIONS, _servers


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_a_request_in_flight_on_one_release_shuts_out_the_other(
    stack: Stack, direction: str
) -> None:
    holder, other = _servers(stack, direction)
    key = new_key()
    body = {"amount": 500, "gate": key}
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(holder.charge, key, body)
        try:
            stack.running_pid(key)  # the holder's view has started, and waits
            for _ in range(2):  # both of the other release's workers, likely
                busy = assert_error(other.charge(key, body), 409, "in_progress")
                assert busy["error"]["type"] == "idempotency_error"
            refused = other.charge(key, body)
            assert refused.headers["Retry-After"].isdigit(), refused
        finally:
            stack.open_gate(key)
        first = pending.result(timeout=30)
    assert first.status == 201, first
    assert stack.runs(key) == [holder.release.name]
    assert_replays(other.charge(key, body), first)
