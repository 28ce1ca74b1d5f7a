"""``python -m benchmarks.big_table`` at a tiny size: the script runs end to end and
prints every section (the figures themselves are for the benchmarks README)."""

from __future__ import annotations

import pytest

from benchmarks import big_table


def test_big_table_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    big_table.main(
        ["--records", "5000", "--rounds", "1", "--per-block", "5", "--threads", "2",
         "--churn-cycles", "2"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert "Index Scan using idempotency_records_pkey" in out
    for mode in ("row", "transaction"):
        for op in ("first", "replay"):
            assert f"| {mode} | {op} |" in out
    assert "purge: 1,750 of 1,750 expired rows" in out  # 35 % of the fill
    assert out.count("\n| 1 |") == 1 and "| 2 |" in out  # one line per churn cycle
