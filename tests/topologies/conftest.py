"""Fixtures of the topology tests: the reliability suite's per-test fixtures
(``reliability/fixtures.py``), a time limit, and a figures section of their own."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from reliability.figures import Figures
from reliability.fixtures import api_key, run_id, time_limited, write_figures

#: A hung test dumps every thread's stack and ends the run.
TEST_TIME_LIMIT = 240.0


class TopologyFigures(Figures):
    """The reliability suite's figures (its tests are reused here), reported in a
    "topology figures" section of their own."""

    section = "topology figures"


@pytest.fixture
def figures(request: pytest.FixtureRequest) -> Figures:
    return TopologyFigures(request.node)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    write_figures(terminalreporter, TopologyFigures.section)


@pytest.fixture(autouse=True)
def time_limit() -> Iterator[None]:
    with time_limited(TEST_TIME_LIMIT):
        yield


__all__ = ["api_key", "run_id"]  # fixtures shared with the other suite
