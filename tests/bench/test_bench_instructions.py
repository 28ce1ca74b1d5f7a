"""``python -m benchmarks.pg_instructions`` at a tiny size: a PostgreSQL of its own
under callgrind, each sequence's backends counted, and gone afterwards."""

from __future__ import annotations

import shutil

import pytest

from benchmarks import pg_instructions


def test_instructions_per_request_are_counted_per_sequence(
    capsys: pytest.CaptureFixture[str],
) -> None:
    if shutil.which("valgrind") is None:
        pytest.skip("valgrind is not installed")
    try:
        bindir = pg_instructions.server_bindir(None)
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    with pg_instructions.counted_postgres(bindir) as (dsn, counts):
        found = pg_instructions.measure(dsn, counts, ["bare", "row"], warm=3, requests=10)
        workdir = counts.parent
    pg_instructions.report(found)
    # A first request through the extension is the business INSERT and more.
    assert 50 < found["bare"] < found["row"], found
    assert not workdir.exists()
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[1:]] == ["bare", "row"], lines
