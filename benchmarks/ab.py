"""``python -m benchmarks.ab REF``: the working tree against a git ref, under gunicorn.

``benchmarks.inprocess`` counts what a change costs in Flask and the extension
alone. Under gunicorn a change can still vanish or grow: four threads share a
GIL, every blocking call hands it over, and PostgreSQL and Redis compete for
the same two cores. This runs one subject from two code trees side by side -
REF checked out in a temporary git worktree, and the working tree as it is -
behind identically configured gunicorns, and alternates short load cells
between them (ref new, new ref, ...). Each round gives a new/ref throughput
ratio measured seconds apart; the median over rounds, with its spread, is the
answer. CPU per request is counted per tree: the app's workers, the PostgreSQL
backends whose client socket they hold, and Redis.

Two servers instead of the full run's four, and no other cells, so a run of
ten rounds takes about a minute and a half.
"""

from __future__ import annotations

import argparse
import dataclasses
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from . import app as bench_app
from . import cpu, load
from .app import BASELINE, CHARGES_PATH, REDIS_SUBJECTS, SUBJECTS
from .servers import (
    REPO_ROOT,
    THREADS,
    WORKERS,
    Server,
    Servers,
    check_services,
    flush_bench_redis,
    precomplete,
    server_env,
)

TREES = ("ref", "new")


@dataclasses.dataclass(frozen=True)
class Cell:
    """One tree's measurement in one round."""

    tree: str
    rps: float
    p50_ms: float
    statuses: dict[str, int]
    cpu_us: cpu.CpuSample | None  # per request: app / postgres / redis


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ab", description=__doc__)
    parser.add_argument("ref", help="git ref to compare against (e.g. HEAD, HEAD~1, main)")
    parser.add_argument("--subject", choices=SUBJECTS, default="pg")
    parser.add_argument("--path", choices=load.PATHS, default="first")
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--duration", type=float, default=3.0, help="seconds per cell")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds per tree")
    parser.add_argument("--workers", type=int, default=WORKERS)
    parser.add_argument("--threads", type=int, default=THREADS)
    parser.add_argument("--load", choices=load.TOOLS, default="auto", help="load generator")
    parser.add_argument("--replay-keys", type=int, default=200)
    parser.add_argument("--database-url", default=bench_app.database_url())
    parser.add_argument("--redis-url", default=bench_app.redis_url())
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.duration <= 0:
        parser.error("--rounds and --duration must be positive")
    return args


@contextmanager
def worktree(ref: str) -> Iterator[Path]:
    """``ref`` checked out, detached, in a temporary worktree removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="bench-ab-") as tmp:
        path = Path(tmp) / "ref"
        subprocess.run(
            ["git", "-C", str(REPO_ROOT), "worktree", "add", "--detach", "--quiet", str(path), ref],
            check=True,
        )
        try:
            yield path
        finally:
            subprocess.run(
                ["git", "-C", str(REPO_ROOT), "worktree", "remove", "--force", str(path)],
                check=False,
            )


def order(round_no: int) -> tuple[str, str]:
    """ref first in even rounds, new first in odd ones: neither always goes second."""
    return TREES if round_no % 2 == 0 else (TREES[1], TREES[0])


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.subject == BASELINE and args.path != "noop":
        print("note: bare ignores the extension; only the benchmark app differs between trees")
    uses_redis = args.subject in REDIS_SUBJECTS
    check_services(args.database_url, args.redis_url if uses_redis else None)
    tool = load.choose_tool(args.load)
    run_id = secrets.token_hex(4)
    bench_app.prepare_database(args.database_url, [args.subject])
    bench_app.reset_database(args.database_url)
    if uses_redis:
        flush_bench_redis(args.redis_url)

    with worktree(args.ref) as ref_root, tempfile.TemporaryDirectory(prefix="bench-ab-") as tmp:
        workdir = Path(tmp)
        roots = {"ref": ref_root, "new": REPO_ROOT}
        env = server_env(args.database_url, args.redis_url)
        servers = [
            Server(
                args.subject,
                env,
                workdir,
                args.workers,
                args.threads,
                root=root,
                label=f"{tree}-{args.subject}",
            )
            for tree, root in roots.items()
        ]
        by_tree = dict(zip(TREES, servers, strict=True))
        print(
            f"ab {run_id}: {args.subject} {args.path} at {args.connections} connections, "
            f"{args.ref} ({_describe(args.ref)}) against the working tree; "
            f"{args.rounds} rounds x {args.duration:g} s; load: {tool}; "
            f"gunicorn {args.workers} x {args.threads}",
            flush=True,
        )
        meter = (
            cpu.CpuMeter(args.database_url, args.redis_url if uses_redis else None)
            if cpu.available()
            else None
        )
        try:
            with Servers(servers):
                cells = _measure(args, run_id, by_tree, workdir, tool, meter)
        finally:
            if meter is not None:
                meter.close()
        for server in servers:
            if note := server.log_note():
                print(f"note: {note}")
    print(summary(cells))
    return 0


def _describe(ref: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(REPO_ROOT), "log", "-1", "--format=%h %s", ref],
        capture_output=True,
        text=True,
        check=False,
    )
    return done.stdout.strip()[:72] or "?"


def _measure(
    args: argparse.Namespace,
    run_id: str,
    servers: dict[str, Server],
    workdir: Path,
    tool: str,
    meter: cpu.CpuMeter | None,
) -> list[list[Cell]]:
    keys_files: dict[str, Path] = {}
    if args.path == "replay":
        for tree, server in servers.items():
            keys = [f"{run_id}-ab-{tree}-{i}" for i in range(args.replay_keys)]
            precomplete(server.url, keys)
            keys_files[tree] = workdir / f"keys-{tree}.txt"
            keys_files[tree].write_text("\n".join(keys) + "\n")

    def spec(tree: str, duration: float, tag: str) -> load.LoadSpec:
        return load.LoadSpec(
            url=servers[tree].url + CHARGES_PATH,
            path=args.path,
            connections=args.connections,
            duration=duration,
            key_prefix=f"{run_id}-{tag}-{tree}",
            keys_file=keys_files.get(tree),
        )

    if args.warmup > 0:
        for tree in TREES:
            load.run_load(spec(tree, args.warmup, "warm"), tool)

    rounds: list[list[Cell]] = []
    for round_no in range(args.rounds):
        cells = []
        for tree in order(round_no):
            server = servers[tree]
            before = meter.start(server.pid, None) if meter is not None else None
            result = load.run_load(spec(tree, args.duration, f"r{round_no}"), tool)
            used = None
            if meter is not None and before is not None and result.requests:
                spent = meter.delta(before, server.pid, None)
                scale = 1e6 / result.requests
                used = cpu.CpuSample(spent.app * scale, spent.postgres * scale, spent.redis * scale)
            cells.append(Cell(tree, result.rps, result.p50_ms, result.statuses, used))
        rounds.append(sorted(cells, key=lambda c: TREES.index(c.tree)))
        print(_round_line(round_no, rounds[-1]), flush=True)
    return rounds


def _round_line(round_no: int, cells: list[Cell]) -> str:
    ref, new = cells
    parts = [f"round {round_no + 1:>2}"]
    for cell in cells:
        text = f"{cell.tree} {cell.rps:6.0f}/s p50 {cell.p50_ms:5.2f}"
        if cell.cpu_us is not None:
            text += f" cpu {_cpu_text(cell.cpu_us)}"
        parts.append(text)
    parts.append(f"new/ref {new.rps / ref.rps:.3f}" if ref.rps else "new/ref -")
    return " | ".join(parts)


def _cpu_text(sample: cpu.CpuSample) -> str:
    return f"{sample.app:.0f}/{sample.postgres:.0f}/{sample.redis:.0f}"


def summary(rounds: list[list[Cell]]) -> str:
    """The median new/ref ratio over rounds, its spread, and each tree's medians."""
    ratios = [new.rps / ref.rps for ref, new in rounds if ref.rps > 0]
    lines = []
    for index, tree in enumerate(TREES):
        cells = [r[index] for r in rounds]
        line = f"{tree}: {statistics.median(c.rps for c in cells):.0f} req/s (median)"
        samples = [c.cpu_us for c in cells if c.cpu_us is not None]
        if samples:
            median = cpu.CpuSample(
                statistics.median(s.app for s in samples),
                statistics.median(s.postgres for s in samples),
                statistics.median(s.redis for s in samples),
            )
            line += f", CPU us/req app/postgres/redis {_cpu_text(median)}"
        statuses: dict[str, int] = {}
        for cell in cells:
            for status, count in cell.statuses.items():
                statuses[status] = statuses.get(status, 0) + count
        line += f", answers {statuses}"
        lines.append(line)
    if ratios:
        above = sum(r > 1 for r in ratios)
        lines.append(
            f"new/ref throughput: median {statistics.median(ratios):.3f} "
            f"(min {min(ratios):.3f}, max {max(ratios):.3f}; new ahead in {above} of "
            f"{len(ratios)} rounds)"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    started = time.monotonic()
    status = main()
    print(f"({time.monotonic() - started:.0f} s)")
    sys.exit(status)
