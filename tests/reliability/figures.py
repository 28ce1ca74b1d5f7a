"""The figures each reliability test reports: what it sent and what held.

A test calls its ``figures`` fixture with ``name=value`` pairs; they are
printed in the test's own output and collected for the "reliability figures"
section that ``conftest.py`` writes at the end of the run, so a CI log shows
them whether or not pytest captured the output.
"""

from __future__ import annotations

#: (test name, figures) in the order the tests reported them.
REPORTED: list[tuple[str, dict[str, object]]] = []


class Figures:
    """Records ``name: value`` figures for one test and prints them at once."""

    def __init__(self, test: str) -> None:
        self.test = test

    def __call__(self, **values: object) -> None:
        shown = {name.replace("_", " "): value for name, value in values.items()}
        REPORTED.append((self.test, shown))
        print(f"[figures] {self.test}: " + ", ".join(f"{k}={v}" for k, v in shown.items()))
