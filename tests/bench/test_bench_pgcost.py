"""``python -m benchmarks.pgcost`` at a tiny size: a PostgreSQL of its own with
``pg_stat_statements`` and ``pg_walinspect``, and the counts that do not drift."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import pgcost


def test_statements_round_trips_and_wal_are_counted_per_subject(tmp_path: Path) -> None:
    found = sorted(Path("/usr/lib/postgresql").glob("*/lib/pg_walinspect.so"))
    if not found:
        pytest.skip("no PostgreSQL 15 or later with pg_walinspect under /usr/lib/postgresql")
    out = tmp_path / "pgcost.json"
    pgcost.main(
        ["--subjects", "bare,prod-row,prod-tx", "--requests", "20", "--warmup", "5"]
        + ["--bindir", str(found[-1].parent.parent / "bin"), "--out", str(out)]
    )
    by = {r["subject"]: r for r in json.loads(out.read_text())}
    bare, row, tx = by["bare"]["first"], by["prod-row"]["first"], by["prod-tx"]["first"]
    assert (bare["statements"], bare["round_trips"], bare["commits"]) == (3, 3, 1)
    # Issue 38's budget: bare + 2 statements, no SET LOCAL; a row-mode replay is one.
    assert (row["statements"], row["set_local"], row["round_trips"]) == (5, 0, 4)
    assert (tx["statements"], tx["set_local"], tx["round_trips"], tx["commits"]) == (5, 0, 3, 1)
    assert by["prod-row"]["replay"]["statements"] == by["prod-row"]["replay"]["round_trips"] == 1
    assert (by["prod-tx"]["replay"]["statements"], by["prod-tx"]["replay"]["round_trips"]) == (3, 2)
    assert by["prod-tx"]["replay"]["wal_bytes"] == 0
    assert bare["wal_bytes"] < tx["wal_bytes"] < row["wal_bytes"]
    assert by["prod-row"]["stored_per_key"] > 0
