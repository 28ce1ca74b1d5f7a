"""The figures each reliability test reports: what it sent and what held.

A test calls its ``figures`` fixture with ``name=value`` pairs; they are
printed in the test's own output and kept on its report (``user_properties``)
for the "reliability figures" section that ``conftest.py`` writes at the end
of the run, so a CI log shows them whether or not pytest captured the output,
and under pytest-xdist too: a worker's reports, their properties included,
reach the controller that writes the summary.
"""

from __future__ import annotations

import pytest


class Figures:
    """Records ``name: value`` figures for one test and prints them at once."""

    #: The summary section the figures are written to (``fixtures.write_figures``).
    section = "reliability figures"

    def __init__(self, node: pytest.Item) -> None:
        self.node = node
        self.test = node.name

    def __call__(self, **values: object) -> None:
        # As text: a report's properties cross from an xdist worker serialised.
        shown = {name.replace("_", " "): str(value) for name, value in values.items()}
        self.node.user_properties.append((self.section, shown))
        print(f"[figures] {self.test}: " + ", ".join(f"{k}={v}" for k, v in shown.items()))
