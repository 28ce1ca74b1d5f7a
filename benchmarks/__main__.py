"""``python -m benchmarks``: measure what idempotency costs, side by side, in one run.

Absolute figures on a shared two-core machine drift by tens of percent from
minute to minute, so nothing is judged on them. Every subject runs behind its
own gunicorn (all started up front, identically configured), and each cell -
a path at a concurrency - is measured for every subject back to back, in an
order rotated each round (A B C D, then B C D A, ...). The report then takes,
per round, each subject's ratio to ``bare`` measured seconds before, and
reports the median over rounds.
"""

from __future__ import annotations

import argparse
import os
import resource
import secrets
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psycopg2

from . import app as bench_app
from . import cpu, load, report
from .app import BASELINE, CHARGES_PATH, DEFAULT_SUBJECTS, REDIS_SUBJECTS, SUBJECTS, unavailable
from .servers import (
    THREADS,
    WORKER_CLASS,
    WORKERS,
    Server,
    Servers,
    check_services,
    flush_bench_redis,
    precomplete,
    server_env,
    slug,
)

RESULTS_DIR = Path(__file__).resolve().parent / "results"

#: Connections for the saturation cells: twice the server's 8 request slots,
#: so a slot is never idle for want of a request, and few enough that wrk's
#: queueing does not swamp the latency figures.
SATURATION_CONNECTIONS = 16

#: Completed keys per subject for the replay path: enough that concurrent
#: replays rarely meet on one row, few enough to pre-complete in seconds.
REPLAY_KEYS = 500


def cells(paths: Sequence[str], saturation: int) -> list[tuple[str, int]]:
    """(path, connections) pairs. The hot key only makes sense with many clients,
    and the no-op route is there for the throughput ceiling."""
    found: list[tuple[str, int]] = []
    for path in paths:
        if path not in ("hot", "noop"):
            found.append((path, 1))
        found.append((path, saturation))
    return found


def rotated(items: Sequence[str], by: int) -> list[str]:
    """The subjects' order in round ``by``: each subject takes each position in
    turn, so none is always measured right after a particular other."""
    if not items:
        return []
    shift = by % len(items)
    return [*items[shift:], *items[:shift]]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="The cost of idempotency: subjects interleaved, ratios to bare, medians.",
    )
    parser.add_argument("--rounds", type=int, default=7, help="rounds (default 7)")
    parser.add_argument(
        "--duration", type=float, default=3.0, help="seconds per cell (default 3; wrk: whole s)"
    )
    parser.add_argument(
        "--warmup", type=float, default=1.0, help="seconds of discarded load per server and path"
    )
    parser.add_argument(
        "--subjects",
        default=None,
        help=f"comma-separated, from {', '.join(SUBJECTS)} (bare is always included; "
        f"default: {','.join(DEFAULT_SUBJECTS)})",
    )
    parser.add_argument(
        "--paths", default=",".join(load.PATHS), help=f"comma-separated, from {load.PATHS}"
    )
    parser.add_argument(
        "--connections",
        type=int,
        default=SATURATION_CONNECTIONS,
        help=f"connections for the saturation cells (default {SATURATION_CONNECTIONS})",
    )
    parser.add_argument("--workers", type=int, default=WORKERS)
    parser.add_argument("--threads", type=int, default=THREADS)
    parser.add_argument("--load", choices=load.TOOLS, default="auto", help="load generator")
    parser.add_argument("--replay-keys", type=int, default=REPLAY_KEYS)
    parser.add_argument(
        "--quick", action="store_true", help="a ~2-minute smoke run: 2 rounds of 1 s cells"
    )
    parser.add_argument("--database-url", default=bench_app.database_url())
    parser.add_argument("--redis-url", default=bench_app.redis_url())
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.duration, args.warmup = 2, 1.0, 0.5
        args.replay_keys = min(args.replay_keys, 100)
    return args


def selected(raw: str, allowed: Sequence[str], what: str) -> list[str]:
    chosen = [part.strip() for part in raw.split(",") if part.strip()]
    unknown = [c for c in chosen if c not in allowed]
    if unknown:
        raise SystemExit(f"unknown {what}: {', '.join(unknown)}; choose from {', '.join(allowed)}")
    return [a for a in allowed if a in chosen]


def choose_subjects(raw: str | None) -> tuple[list[str], list[str]]:
    """The subjects to run, and notes on those left out.

    A subject named with ``--subjects`` that cannot run here (a peer not
    installed, a setting this checkout's extension lacks) stops the run with
    the reason; the default run leaves it out with a note, so that
    ``python -m benchmarks`` works without the peers.
    """
    explicit = raw is not None
    subjects = selected(raw, SUBJECTS, "subjects") if raw is not None else list(DEFAULT_SUBJECTS)
    if BASELINE not in subjects:
        subjects.insert(0, BASELINE)  # every figure is a ratio to it
    reasons = {s: reason for s in subjects if (reason := unavailable(s)) is not None}
    if explicit and reasons:
        raise SystemExit("cannot run: " + "; ".join(reasons.values()))
    notes = [f"skipped {reason}" for reason in reasons.values()]
    return [s for s in subjects if s not in reasons], notes


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    subjects, notes = choose_subjects(args.subjects)
    for skipped in notes:
        print(f"note: {skipped}", file=sys.stderr, flush=True)
    paths = selected(args.paths, load.PATHS, "paths")
    tool = load.choose_tool(args.load)
    uses_redis = any(s in REDIS_SUBJECTS for s in subjects)
    check_services(args.database_url, args.redis_url if uses_redis else None)

    run_id = secrets.token_hex(4)
    print(
        f"benchmark {run_id}: subjects {', '.join(subjects)}; paths {', '.join(paths)}; "
        f"{args.rounds} rounds x {args.duration:g} s; load: {tool}; gunicorn {args.workers} "
        f"x {args.threads} {WORKER_CLASS}",
        flush=True,
    )
    bench_app.prepare_database(args.database_url, subjects)
    bench_app.reset_database(args.database_url)
    if uses_redis:
        flush_bench_redis(args.redis_url)

    env = server_env(args.database_url, args.redis_url)
    started = time.time()
    load_before = os.getloadavg()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        workdir = Path(tmp)
        servers = [Server(s, env, workdir, args.workers, args.threads) for s in subjects]
        try:
            meter = (
                cpu.CpuMeter(args.database_url, args.redis_url if uses_redis else None)
                if cpu.available()
                else None
            )
            try:
                with Servers(servers) as running:
                    rows = _measure(args, run_id, subjects, paths, tool, running, workdir, meter)
            finally:
                if meter is not None:
                    meter.close()
            notes += [note for server in servers if (note := server.log_note())]
        except BaseException:
            for server in servers:
                if server.log_path.exists():
                    tail = server.log_path.read_text(errors="replace")[-3000:]
                    print(f"--- {server.subject} gunicorn log ---\n{tail}", file=sys.stderr)
            raise
    meta = {
        "run_id": run_id,
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
        "wall_seconds": round(time.time() - started, 1),
        "rounds": args.rounds,
        "duration": args.duration,
        "load_tool": tool,
        "saturation_connections": args.connections,
        "gunicorn": f"{args.workers} workers x {args.threads} threads, {WORKER_CLASS}",
        "cpus": os.cpu_count(),
        # Other work on the machine during the run (1-minute load averages), for
        # judging how much to trust the absolute figures.
        "load_average": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "python": sys.version.split()[0],
        "postgres": _server_setting(args.database_url, "server_version"),
        "synchronous_commit": _server_setting(args.database_url, "synchronous_commit"),
        "peer_versions": bench_app.peer_versions(subjects),
        "notes": notes,
    }
    summary = report.summarize(rows, subjects, BASELINE)
    written = report.write(summary, rows, meta, args.output_dir)
    print(written.markdown, flush=True)
    print(f"written: {written.markdown_path} and {written.json_path}")
    return 0


def _measure(
    args: argparse.Namespace,
    run_id: str,
    subjects: Sequence[str],
    paths: Sequence[str],
    tool: str,
    servers: Servers,
    workdir: Path,
    meter: cpu.CpuMeter | None,
) -> list[dict[str, Any]]:
    keys_files: dict[str, Path] = {}
    if "replay" in paths:
        for subject in subjects:
            keys = [f"{run_id}-replay-{slug(subject)}-{i}" for i in range(args.replay_keys)]
            precomplete(servers.by_subject[subject].url, keys)
            keys_files[subject] = workdir / f"keys-{slug(subject)}.txt"
            keys_files[subject].write_text("\n".join(keys) + "\n")
        print(f"pre-completed {args.replay_keys} replay keys per subject", flush=True)

    def spec(subject: str, path: str, conns: int, duration: float, tag: str) -> load.LoadSpec:
        return load.LoadSpec(
            url=servers.by_subject[subject].url + CHARGES_PATH,
            path=path,
            connections=conns,
            duration=duration,
            key_prefix=f"{run_id}-{tag}-{slug(subject)}-{path}-{conns}",
            keys_file=keys_files.get(subject),
        )

    if args.warmup > 0:
        for subject in subjects:
            for path in paths:
                load.run_load(spec(subject, path, args.connections, args.warmup, "warm"), tool)
        print("warmed up", flush=True)

    rows: list[dict[str, Any]] = []
    plan = cells(paths, args.connections)
    for round_no in range(args.rounds):
        for path, conns in plan:
            line = []
            for subject in rotated(subjects, round_no):
                server = servers.by_subject[subject]
                label = bench_app.application_name(subject)
                before = meter.start(server.pid, label) if meter is not None else None
                load_before = _children_cpu()
                result = load.run_load(
                    spec(subject, path, conns, args.duration, f"r{round_no}"), tool
                )
                row: dict[str, Any] = {
                    "round": round_no,
                    "subject": subject,
                    "path": path,
                    "connections": conns,
                    **result.as_dict(),
                    "cpu_load_us": _per_request(_children_cpu() - load_before, result.requests),
                }
                if meter is not None and before is not None:
                    used = meter.delta(before, server.pid, label)
                    row["cpu_app_us"] = _per_request(used.app, result.requests)
                    row["cpu_postgres_us"] = _per_request(used.postgres, result.requests)
                    row["cpu_redis_us"] = _per_request(used.redis, result.requests)
                rows.append(row)
                line.append(f"{subject} {result.rps:.0f}/s p50 {result.p50_ms:.2f}")
            print(f"round {round_no + 1} {path:6} c={conns:<3} " + " | ".join(line), flush=True)
    return rows


def _children_cpu() -> float:
    """CPU seconds of this process's finished children: the load generator's cost."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _per_request(seconds: float, requests: int) -> float | None:
    return seconds / requests * 1e6 if requests else None


def _server_setting(dsn: str, name: str) -> str:
    conn = psycopg2.connect(dsn)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT current_setting(%s)", (name,))
            row = cur.fetchone()
            return str(row[0]) if row else "?"
    finally:
        conn.close()


if __name__ == "__main__":
    sys.exit(main())
