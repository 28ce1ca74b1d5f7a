"""``benchmarks.claim_shapes`` and ``benchmarks.hot_completion`` at tiny sizes: every
sequence runs and is reported, and the HOT probe's two copies really differ in
what it says they differ in."""

from __future__ import annotations

from collections.abc import Callable

import psycopg2
import pytest

from benchmarks import claim_shapes, hot_completion


@pytest.fixture
def bench_db(clean_db: str, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("BENCH_DATABASE_URL", clean_db)
    return clean_db


def _run(
    main: Callable[[list[str]], None], argv: list[str], capsys: pytest.CaptureFixture[str]
) -> list[str]:
    try:
        main(argv)
    except FileNotFoundError as exc:  # /proc/<backend pid>: PostgreSQL on another machine
        pytest.skip(f"the backend's CPU cannot be read here: {exc}")
    return capsys.readouterr().out.splitlines()


def test_claim_shapes_reports_every_shape(
    bench_db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = _run(claim_shapes.main, ["--rounds", "1", "--chunk", "5"], capsys)
    names = [line[:22].strip() for line in lines[1:]]
    assert names == [
        "bare",
        "row, before",
        "row, now",
        "transaction, before",
        "transaction, now",
    ], lines


def test_only_the_current_schema_updates_heap_only(bench_db: str) -> None:
    try:
        found, shares = hot_completion.measure(bench_db, rounds=1, chunk=20)
    except FileNotFoundError as exc:
        pytest.skip(f"the backend's CPU cannot be read here: {exc}")
    assert set(found) == {"bare", "before", "now"}
    assert all(len(figures) == 1 and figures[0] >= 0 for figures in found.values())
    # Before 0009 the completion changed indexed columns: never HOT. Now, nearly
    # always (an update that does not fit its row's page goes elsewhere, not HOT).
    assert shares["before"] == 0.0
    assert shares["now"] > 0.8, shares


def test_the_hot_probe_drops_its_copies(bench_db: str, capsys: pytest.CaptureFixture[str]) -> None:
    lines = _run(hot_completion.main, ["--rounds", "1", "--chunk", "5"], capsys)
    assert [line.split()[0] for line in lines[1:]] == ["bare", "before", "now"], lines
    with psycopg2.connect(bench_db) as conn, conn.cursor() as cur:
        cur.execute("SELECT count(*) FROM pg_tables WHERE tablename LIKE 'bench_records_%'")
        assert cur.fetchone() == (0,)
    conn.close()
