"""Waiting for something to become true: poll it, never sleep a fixed time.

A fixed sleep is too long on a quiet machine and too short on a busy one. A poll
returns as soon as the condition holds, and when it never does, fails saying what
it waited for. Lease and TTL expiries are not waited for at all: tests move the
record's timestamps in SQL (see STYLE.md, "Tests that name the clock").
"""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(
    ready: Callable[[], object],
    timeout: float,
    what: str,
    *,
    describe: Callable[[], str] | None = None,
    interval: float = 0.02,
) -> None:
    """Poll ``ready`` every ``interval`` s until it returns something true.

    After ``timeout`` s raise ``TimeoutError`` naming ``what`` was awaited, followed
    by ``describe()`` when given (a server's log tail, the state last seen).
    """
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            detail = f"\n{describe()}" if describe is not None else ""
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}{detail}")
        time.sleep(interval)
