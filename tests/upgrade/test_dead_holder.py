"""A holder of either release that dies is taken over by the other once its lease
has ended, and one that only stalled is fenced: its late completion is refused.

Leases are ended by moving the record's clock (``support.records.end_leases``),
not by waiting: the lease columns are part of the schema both releases share.
In transaction claim mode there is no lease: a dead holder's connection closes,
which ends its transaction and its locks.
"""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from support.http_client import HttpResponse
from support.records import end_leases
from support.waiting import wait_until

from .answers import assert_error, assert_replays
from .rollout import Server, Stack, new_key
from .test_replay import DIRECTIONS, _servers


def _take_over(stack: Stack, server: Server, key: str, body: dict[str, object]) -> HttpResponse:
    """Retry ``key`` on ``server`` until it is no longer in progress (a dead
    transaction-mode holder's session ends a moment after its process)."""
    answers: list[HttpResponse] = []

    def taken() -> bool:
        answers.append(server.charge(key, body))
        return answers[-1].status != 409

    wait_until(taken, 15, f"a takeover of {key}", describe=lambda: repr(answers[-1:]), interval=0.1)
    return answers[-1]


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_a_dead_holder_is_taken_over_by_the_other_release(stack: Stack, direction: str) -> None:
    holder, other = _servers(stack, direction)
    key = new_key()
    body = {"amount": 900, "gate": key}
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(holder.charge, key, body)
        pid = stack.running_pid(key)
        assert_error(other.charge(key, body), 409, "in_progress")
        holder.gunicorn.kill_worker(pid)  # SIGKILL: no completion, no release
        with pytest.raises(OSError):  # its client's connection just drops
            pending.result(timeout=30)
    stack.open_gate(key)  # the takeover's view need not wait
    end_leases(stack.database_url)  # as time does; nothing to end in transaction mode

    takeover = _take_over(stack, other, key, body)
    assert takeover.status == 201, takeover
    assert takeover.headers["Idempotent-Replayed"] == "false"
    assert stack.runs(key) == [holder.release.name, other.release.name]
    assert_replays(holder.charge(key, body), takeover)


def _all_threads_stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is stopped (SIGSTOP reaches one thread first,
    and the others stop once it runs)."""
    states = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
        except OSError:
            continue  # a thread that ended meanwhile
    return bool(states) and all(state in ("T", "t") for state in states)


# Row claims only: a transaction-mode claim has no lease, a stalled holder keeps its key.
@pytest.mark.parametrize("stack", ["row"], indirect=True)
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_a_stalled_holder_is_fenced_after_the_other_release_took_over(
    stack: Stack, direction: str
) -> None:
    holder, other = _servers(stack, direction)
    key = new_key()
    body = {"amount": 300, "gate": key}
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(holder.charge, key, body)
        pid = stack.running_pid(key)
        os.kill(pid, signal.SIGSTOP)  # stalled: its lease keeper stops with it
        try:
            wait_until(lambda: _all_threads_stopped(pid), 10, f"worker {pid} to stop")
            assert end_leases(stack.database_url) >= 1
            stack.open_gate(key)  # for when the holder resumes
            takeover = other.charge(key, body)
            assert takeover.status == 201, takeover
            assert takeover.headers["Idempotent-Replayed"] == "false"
        finally:
            os.kill(pid, signal.SIGCONT)
        late = pending.result(timeout=30)
    assert_error(late, 409, "lease_lost")
    assert late.headers["Retry-After"].isdigit()
    assert stack.runs(key) == [holder.release.name, other.release.name]
    assert_replays(holder.charge(key, body), takeover)
    assert_replays(other.charge(key, body), takeover)
