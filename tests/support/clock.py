"""A clock a test moves by hand, for code that takes ``clock=time.monotonic``."""

from __future__ import annotations


class FakeClock:
    """Returns ``now`` when called; the test sets or ``advance``\\s it."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
