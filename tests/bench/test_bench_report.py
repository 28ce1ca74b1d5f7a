"""The benchmark's arithmetic: per-round ratios, the cell plan, the ceiling, the targets.

The figures in the README come from this code, so it is tested on rows whose
answers are known, without running a server.
"""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks import report
from benchmarks.__main__ import cells, rotated


def row(subject: str, path: str, conns: int, rnd: int, rps: float, p50: float = 1.0) -> Any:
    return {
        "round": rnd,
        "subject": subject,
        "path": path,
        "connections": conns,
        "rps": rps,
        "p50_ms": p50,
        "p99_ms": p50 * 2,
        "errors": 0,
        "statuses": {"201": int(rps)},
    }


def test_cells_run_hot_and_noop_at_saturation_only() -> None:
    assert cells(["first", "replay", "hot", "noop"], 16) == [
        ("first", 1),
        ("first", 16),
        ("replay", 1),
        ("replay", 16),
        ("hot", 16),
        ("noop", 16),
    ]


def test_rotation_puts_every_subject_in_every_slot() -> None:
    subjects = ["bare", "pg", "pg+redis", "pg-synccommit"]
    slots = [rotated(subjects, r) for r in range(4)]
    for position in range(4):
        assert sorted(s[position] for s in slots) == sorted(subjects)


def test_ratios_are_medians_of_per_round_ratios_not_ratios_of_medians() -> None:
    # Bare drifts from 1000 to 3000 req/s; pg is always half of bare in its round.
    rows = [row("bare", "replay", 16, r, rps) for r, rps in enumerate((1000, 2000, 3000))]
    rows += [row("pg", "replay", 16, r, rps / 2) for r, rps in enumerate((1000, 2000, 3000))]
    (_, pg) = report.summarize(rows, ["bare", "pg"], "bare")
    assert pg.ratio == pytest.approx(0.5)
    assert pg.ratio_min == pytest.approx(0.5) and pg.ratio_max == pytest.approx(0.5)


def test_replay_targets_carry_the_no_op_ceiling_and_are_judged_against_bare() -> None:
    rows = []
    for rnd in range(3):
        rows += [
            row("bare", "replay", 16, rnd, 1000),
            row("pg", "replay", 16, rnd, 1250),
            row("pg+redis", "replay", 16, rnd, 1700),
            row("bare", "noop", 16, rnd, 2500),
            row("pg", "noop", 16, rnd, 2450),
        ]
    summaries = report.summarize(rows, ["bare", "pg", "pg+redis"], "bare")
    assert report.framework_ceiling(summaries, "replay") == pytest.approx(2.5)
    targets = {
        (t.subject, t.cell): t
        for t in report.evaluate_targets(summaries)
        if t.target.startswith("x bare")
    }
    redis_replay = targets[("pg+redis", "replay, 16 conn")]
    assert redis_replay.measured == pytest.approx(1.7)
    assert redis_replay.met is False  # 1.8 is the bar
    assert redis_replay.ceiling == pytest.approx(2.5)
    assert targets[("pg", "replay, 16 conn")].met is True  # 1.25 >= 1.2
    noop = next(s for s in summaries if s.subject == "pg" and s.path == "noop")
    assert noop.ratio == pytest.approx(0.98)  # the error bar: identical code, 2% apart
    markdown = report.render_markdown(
        summaries,
        report.evaluate_targets(summaries),
        {
            "run_id": "t",
            "started": "now",
            "wall_seconds": 1,
            "rounds": 3,
            "duration": 1,
            "load_tool": "wrk",
            "saturation_connections": 16,
            "gunicorn": "2 x 4",
            "cpus": 2,
            "load_average": [0, 0],
            "python": "3",
            "postgres": "15",
            "synchronous_commit": "on",
        },
    )
    assert "| 1.70 x | **no** | 2.50 x |" in markdown


def test_a_target_whose_cell_was_not_measured_says_so() -> None:
    rows = [row("bare", "first", 1, 0, 800, p50=1.0), row("pg", "first", 1, 0, 500, p50=1.6)]
    results = report.evaluate_targets(report.summarize(rows, ["bare", "pg"], "bare"))
    latency = next(t for t in results if t.subject == "pg" and t.target.startswith("added p50"))
    assert latency.measured == pytest.approx(0.6) and latency.met is True
    saturated = next(t for t in results if t.subject == "pg" and t.cell == "first, saturation")
    assert saturated.met is None and saturated.measured is None


def test_side_by_side_lists_every_subject_but_bare_with_first_and_replay_costs() -> None:
    rows = []
    for rnd in range(3):
        for subject, first, replay, app_us in (
            ("bare", 1000, 1000, 1000.0),
            ("pg", 600, 1200, 1667.0),
            ("idemkit-pg", 400, 700, 2500.0),
        ):
            cpu = {"cpu_app_us": app_us, "cpu_postgres_us": 100.0, "cpu_redis_us": 0.0}
            rows += [
                {**row(subject, "first", 16, rnd, first), **cpu},
                row(subject, "replay", 16, rnd, replay),
            ]
    summaries = report.summarize(rows, ["bare", "pg", "idemkit-pg"], "bare")
    lines = report.render_side_by_side(summaries)
    assert lines[0] == "## Side by side"
    body = [line for line in lines if line.startswith("| ") and not line.startswith("| subject")]
    assert [line.split(" | ")[0] for line in body] == ["| pg", "| idemkit-pg"]
    assert body[0].startswith("| pg | 0.60 (0.60-0.60) | +667 | - | 1.20 (1.20-1.20) | - | - |")
    assert body[1].startswith("| idemkit-pg | 0.40 (0.40-0.40) | +1500 |")
    assert report.render_side_by_side(report.summarize(rows[:2], ["bare"], "bare")) == []
