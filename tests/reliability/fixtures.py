"""Per-test fixtures and hooks shared by the reliability and topology suites.

Each suite's conftest imports the fixtures by name (pytest collects fixtures a
conftest imports) and calls the helpers from its own hooks, with its own time
limit and its own figures section.
"""

from __future__ import annotations

import faulthandler
import secrets
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest


@pytest.fixture
def run_id() -> str:
    """A prefix unique to this test, for its customers (and so its ledger entries)."""
    return f"cus_{secrets.token_hex(3)}_"


@pytest.fixture
def api_key() -> str:
    """A fresh API key: a tenant whose records no other test can have touched."""
    return f"sk_test_{secrets.token_hex(8)}"


@contextmanager
def time_limited(seconds: float) -> Iterator[None]:
    """Dump all stacks and exit if the block runs past ``seconds``; print its time."""
    faulthandler.dump_traceback_later(seconds, exit=True, file=sys.stderr)
    started = time.monotonic()
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
        print(f"[time] {time.monotonic() - started:.1f} s")


def write_figures(terminalreporter: pytest.TerminalReporter, section: str) -> None:
    """The figures the run's tests reported for ``section`` (``Figures``), test by
    test in the order of their reports, in a section of the summary of its own."""
    reported = [
        (report.nodeid.rsplit("::", 1)[-1], values)
        for reports in terminalreporter.stats.values()
        for report in reports
        if getattr(report, "when", None) == "call"
        for name, values in getattr(report, "user_properties", ())
        if name == section
    ]
    if not reported:
        return
    terminalreporter.section(section)
    for test, values in reported:
        terminalreporter.write_line(f"{test}:")
        for name, value in values.items():
            terminalreporter.write_line(f"    {name}: {value}")
