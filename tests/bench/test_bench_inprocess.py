"""The in-process probe of the benchmark app answers every request it times."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

if str(Path(__file__).resolve().parents[2]) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import inprocess  # noqa: E402
from benchmarks.app import REQUEST_BODY  # noqa: E402


@pytest.mark.parametrize(
    ("subject", "path", "answer"),
    [
        ("bare", "first", ("201 CREATED", None)),
        ("pg", "first", ("201 CREATED", "false")),
        ("pg", "replay", ("201 CREATED", "true")),
        ("pg+redis", "replay", ("201 CREATED", "true")),
        ("pg", "noop", ("200 OK", None)),
    ],
)
def test_measure_times_the_path_it_names(
    subject: str,
    path: str,
    answer: inprocess.Answer,
    clean_db: str,
    clean_redis: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("BENCH_DATABASE_URL", clean_db)
    monkeypatch.setenv("BENCH_REDIS_URL", clean_redis)
    probe = inprocess.measure(subject, path, n=5, warmup=1)
    assert probe.answers == {answer: 5}
    assert probe.cpu_us > 0 and probe.wall_us > 0


def test_environ_carries_the_key_and_the_body() -> None:
    environ = inprocess.make_environ("k-1")
    assert environ["HTTP_IDEMPOTENCY_KEY"] == "k-1"
    assert environ["wsgi.input"].read() == REQUEST_BODY
    assert "HTTP_IDEMPOTENCY_KEY" not in inprocess.make_environ(None, "GET", "/healthz")
