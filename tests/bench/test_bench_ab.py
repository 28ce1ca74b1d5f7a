"""The two-tree comparison (``benchmarks.ab``) and the CPU attribution it relies on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psycopg2
import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import ab, cpu  # noqa: E402

pytestmark = pytest.mark.skipif(not cpu.available(), reason="needs Linux /proc")


def test_backends_are_attributed_to_the_process_holding_their_socket(clean_db: str) -> None:
    """Two servers of one subject share an application_name; the socket tells them apart."""
    ours = psycopg2.connect(clean_db)
    theirs = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, psycopg2; c = psycopg2.connect(sys.argv[1]); "
            "print(c.get_backend_pid(), flush=True); sys.stdin.read()",
            clean_db,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    meter = cpu.CpuMeter(clean_db, None)
    try:
        assert theirs.stdout is not None
        their_backend = int(theirs.stdout.readline())
        assert meter._backends_of([]) == []
        found = meter._backends_of([os.getpid()])
        assert ours.get_backend_pid() in found
        assert their_backend not in found
        assert meter._backends_of([theirs.pid]) == [their_backend]
    finally:
        meter.close()
        ours.close()
        theirs.communicate("")


def test_rounds_alternate_which_tree_goes_first() -> None:
    assert [ab.order(n) for n in range(3)] == [("ref", "new"), ("new", "ref"), ("ref", "new")]


def test_summary_gives_the_median_ratio_and_its_spread() -> None:
    def cell(tree: str, rps: float) -> ab.Cell:
        return ab.Cell(tree, rps, 1.0, {"201": int(rps)}, cpu.CpuSample(500.0, 200.0, 0.0))

    rounds = [
        [cell("ref", 100), cell("new", 110)],
        [cell("ref", 100), cell("new", 90)],
        [cell("ref", 100), cell("new", 105)],
    ]
    text = ab.summary(rounds)
    assert "median 1.050 (min 0.900, max 1.100; new ahead in 2 of 3 rounds)" in text
    assert "CPU us/req app/postgres/redis 500/200/0" in text


def _in_git_checkout() -> bool:
    done = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--verify", "--quiet", "HEAD"],
        capture_output=True,
        check=False,
    )
    return done.returncode == 0


@pytest.mark.skipif(not _in_git_checkout(), reason="needs a git checkout with a HEAD")
def test_a_short_run_against_head_serves_both_trees(
    clean_db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """End to end: a worktree of HEAD and the working tree, each behind its own
    gunicorn, both answering the path's requests; the worktree is removed after."""
    argv = ["HEAD", "--subject", "pg", "--path", "first", "--rounds", "2"]
    argv += ["--duration", "1", "--warmup", "0", "--connections", "2"]
    argv += ["--database-url", clean_db]
    assert ab.main(argv) == 0
    out = capsys.readouterr().out
    assert "round  2 |" in out and "new/ref throughput: median" in out
    for tree in ("ref", "new"):
        line = next(x for x in out.splitlines() if x.startswith(f"{tree}: "))
        assert "answers {'201':" in line, line  # every request a first execution
    worktrees = subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "list"], capture_output=True, text=True, check=True
    ).stdout
    assert "bench-ab-" not in worktrees
