"""The store pools' slot count (``store.pool.Slots``): a bounded semaphore."""

from __future__ import annotations

import threading
import time

import pytest

from flask_idempotency.store.pool import Slots


def test_slots_are_taken_up_to_capacity_and_no_further() -> None:
    slots = Slots(2)
    assert slots.acquire(blocking=False)
    assert slots.acquire(blocking=False)
    assert not slots.acquire(blocking=False)
    assert not slots.acquire(timeout=0.05)
    slots.release()
    assert slots.acquire(blocking=False)


def test_a_slot_given_back_more_often_than_taken_is_refused() -> None:
    slots = Slots(1)
    with pytest.raises(ValueError):
        slots.release()
    assert slots.acquire(blocking=False)
    slots.release()
    with pytest.raises(ValueError):
        slots.release()


def test_a_waiter_gets_the_slot_given_back_before_its_timeout() -> None:
    slots = Slots(1)
    assert slots.acquire()
    got: list[bool] = []
    waiter = threading.Thread(target=lambda: got.append(slots.acquire(timeout=5)))
    waiter.start()
    time.sleep(0.05)
    started = time.monotonic()
    slots.release()
    waiter.join(5)
    assert got == [True]
    assert time.monotonic() - started < 1
    assert not slots.acquire(blocking=False)  # the waiter holds it now


def test_many_threads_never_hold_more_than_the_capacity() -> None:
    slots = Slots(3)
    held = 0
    most = 0
    lock = threading.Lock()

    def worker() -> None:
        nonlocal held, most
        for _ in range(200):
            assert slots.acquire(timeout=5)
            with lock:
                held += 1
                most = max(most, held)
            with lock:
                held -= 1
            slots.release()

    threads = [threading.Thread(target=worker) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert most <= 3
    for _ in range(3):  # every slot came back
        assert slots.acquire(blocking=False)
    assert not slots.acquire(blocking=False)
