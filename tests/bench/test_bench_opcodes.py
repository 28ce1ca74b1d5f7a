"""The bytecode count of the benchmark app: every counted request answered, and
the extension's own functions among the counted."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

if str(Path(__file__).resolve().parents[2]) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import opcodes  # noqa: E402


def test_count_covers_the_extension_and_is_steady(
    clean_db: str, clean_redis: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BENCH_DATABASE_URL", clean_db)
    monkeypatch.setenv("BENCH_REDIS_URL", clean_redis)
    bare = opcodes.count("bare", "first", n=5, warmup=2)
    first = opcodes.count("pg", "first", n=5, warmup=2)
    again = opcodes.count("pg", "first", n=5, warmup=2)
    assert bare.answers == {("201 CREATED", None): 5}
    assert first.answers == {("201 CREATED", "false"): 5}
    assert any(name.startswith("flask_idempotency/") for name in first.by_function)
    assert not any(name.startswith("flask_idempotency/") for name in bare.by_function)
    assert first.per_request > bare.per_request > 0
    # A count, not a timing: the same path costs the same to within a few percent.
    assert abs(first.per_request - again.per_request) < 0.05 * first.per_request
