"""``python -m benchmarks.statements`` at a tiny size: every sequence runs through the
library's own store and is reported (the figures are for the benchmarks README)."""

from __future__ import annotations

from importlib.util import find_spec

import psycopg2
import pytest

from benchmarks import statements


def test_statements_smoke(clean_db: str, capsys: pytest.CaptureFixture[str]) -> None:
    try:
        statements.main(["--requests", "20", "--rounds", "1", "--database-url", clean_db])
    except FileNotFoundError as exc:  # /proc/<backend pid>: PostgreSQL on another machine
        pytest.skip(f"the backend's CPU cannot be read here: {exc}")
    out = capsys.readouterr().out
    lines = {line.split("  ")[0]: line for line in out.splitlines()[2:]}
    expected = {
        "bare",
        "row",
        "transaction",
        "hand-written",
        "bare + record",
        "begin+rollback",
        "transaction claim only",
        "bare + savepoint",
        "row texts",
        "transaction texts",
    }
    if find_spec("sqlalchemy") is not None:  # the savepoint's cost through SQLAlchemy
        expected |= {"sqlalchemy bare", "sqlalchemy + savepoint"}
    assert set(lines) == expected, out
    # Each first request of the five sequences that store one (row, transaction,
    # their texts alone, bare + record) left its record, completed: 20 measured and
    # 20 of warm-up; the transaction claim alone rolled back and left none.
    with psycopg2.connect(clean_db) as conn, conn.cursor() as cur:
        cur.execute("SELECT state, count(*) FROM idempotency_records GROUP BY state")
        assert dict(cur.fetchall()) == {"completed": 5 * 40}
        # The hand-written layer's keys, each with its stored answer.
        cur.execute("SELECT status, count(*) FROM bench_sqla_keys GROUP BY status")
        assert dict(cur.fetchall()) == {201: 40}
    conn.close()
