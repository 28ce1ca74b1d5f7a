"""``python -m benchmarks.checkouts``: app CPU per request, checkout against checkout.

``benchmarks.ab`` compares two trees under gunicorn in one virtualenv. When the
two trees want different environments (a release against the one before it,
each with its own ``make venv``), this runs every arm in an interpreter of its
own: ``<checkout>/.venv/bin/python`` with ``PYTHONPATH`` set to the checkout,
its own working directory and its own database, so neither tree ever imports
the other's code. Each worker builds one subject's app once
(``benchmarks.inprocess.Subject``, the checkout's own copy) and then answers
probes: ``n`` requests called in-process, its own CPU time per request
(``time.process_time``, all its threads).

Every arm's app gets the same ``SECRET_KEY`` (``--secret-key``): the benchmark
app of 0.3 sets one (its Redis entries are signed), the one before did not, and
with a key Flask opens and saves its cookie session on every request, a cost
that is neither checkout's extension.

Three arms by default: ``old``, ``old2`` (the same checkout again, in another
process and database: the A/A comparison that shows the noise) and ``new``.
Rounds interleave the arms (the order rotates each round) and each round gives
``new/old`` and ``old2/old`` ratios measured seconds apart; the report is the
median of those per-round ratios with their spread, never a ratio of medians,
because absolute times on a shared two-core machine drift between rounds.

``--profile DIR`` then runs each subject and path once more in the given
arms under cProfile and writes the top entries (by own time and cumulative).

    .venv/bin/python -m benchmarks.checkouts --old ../wt-old --new . \\
        --subjects pg,sqla-pg --paths first,replay --rounds 11 -n 300
"""

from __future__ import annotations

import argparse
import json
import os
import pstats
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

#: Run by each arm's own interpreter (``-P``: the script's folder is not put on
#: ``sys.path``, so ``benchmarks`` and ``flask_idempotency`` come from PYTHONPATH,
#: the checkout). One JSON line per command on the real stdout; the app's own
#: output goes to stderr.
WORKER = r"""
import cProfile, json, os, sys, time
out = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)
import flask_idempotency
from benchmarks import inprocess
subject = inprocess.Subject(sys.argv[1]).__enter__()
if os.environ.get("CHECKOUTS_SECRET_KEY"):
    subject.app.config["SECRET_KEY"] = os.environ["CHECKOUTS_SECRET_KEY"]
out.write(json.dumps({"ready": flask_idempotency.__file__}) + "\n")
for line in sys.stdin:
    cmd = line.split()
    if cmd[0] == "probe":
        probe = subject.probe(cmd[1], int(cmd[2]), int(cmd[3]))
        answers = {f"{s} replayed={r}": c for (s, r), c in probe.answers.items()}
        got = {"cpu_us": probe.cpu_us, "wall_us": probe.wall_us, "answers": answers}
        out.write(json.dumps(got) + "\n")
    elif cmd[0] == "profile":
        path, n, dest = cmd[1], int(cmd[2]), cmd[3]
        call = inprocess.caller(subject.app)
        for environ in inprocess.environs(path, 100, subject.replay_key):
            call(environ)
        batch = inprocess.environs(path, n, subject.replay_key)
        profiler = cProfile.Profile(time.process_time)  # CPU, not waits on PostgreSQL
        profiler.enable()
        for environ in batch:
            call(environ)
        profiler.disable()
        profiler.dump_stats(dest)
        out.write(json.dumps({"profile": dest}) + "\n")
    else:
        break
subject.close()
"""


class Arm:
    """One checkout serving one subject in a worker interpreter of its own."""

    def __init__(
        self, name: str, checkout: Path, subject: str, dsn: str, redis_url: str, secret_key: str
    ) -> None:
        self.name, self.checkout, self.subject = name, checkout, subject
        env = dict(os.environ)
        env.update(
            PYTHONPATH=str(checkout),
            BENCH_DATABASE_URL=dsn,
            BENCH_REDIS_URL=redis_url,
            PYTHONHASHSEED="0",
            CHECKOUTS_SECRET_KEY=secret_key,
        )
        python = checkout / ".venv" / "bin" / "python"
        self.proc = subprocess.Popen(
            [str(python), "-P", "-c", WORKER, subject],
            cwd=checkout,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        ready = self._read()
        source = Path(ready["ready"]).resolve()
        if not source.is_relative_to(checkout.resolve()):
            raise RuntimeError(f"{name}: imported {source}, not {checkout}'s code")

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(
                f"{self.name} {self.subject}: the worker exited ({self.proc.wait()})"
            )
        result: dict[str, Any] = json.loads(line)
        return result

    def ask(self, command: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=30)


def instructions(
    checkout: Path, subject: str, path: str, counts: tuple[int, int], dsn: str
) -> float:
    """Instructions per request of ``checkout``'s app, all its threads, counted by
    callgrind at two request counts: the difference over the difference of the
    counts, so start-up and warm-up cancel out. Deterministic, unlike CPU time
    (``benchmarks.inprocess`` describes the recipe)."""
    collected = []
    for n in counts:
        done = subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                "--callgrind-out-file=/dev/null",
                str(checkout / ".venv" / "bin" / "python"),
                "-P",
                "-m",
                "benchmarks.inprocess",
                subject,
                path,
                "-n",
                str(n),
                "--warmup",
                "20",
            ],
            cwd=checkout,
            env={**os.environ, "PYTHONPATH": str(checkout), "BENCH_DATABASE_URL": dsn},
            capture_output=True,
            text=True,
            check=True,
        )
        found = re.search(r"Collected : (\d+)", done.stderr)
        if found is None:
            raise RuntimeError(f"no callgrind total for {checkout} {subject} {path}")
        collected.append(int(found.group(1)))
    return (collected[1] - collected[0]) / (counts[1] - counts[0])


def arm_database(base: str, arm: str) -> str:
    """``base`` with the database name suffixed by the arm: no arm shares tables."""
    parts = urlsplit(base)
    return urlunsplit(parts._replace(path=f"{parts.path}_{arm}"))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.checkouts", description=__doc__)
    parser.add_argument("--old", type=Path, help="the reference checkout, with .venv")
    parser.add_argument("--new", type=Path, help="the checkout under test, with .venv")
    parser.add_argument("--subjects", default="pg,sqla-pg")
    parser.add_argument("--paths", default="first,replay")
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("-n", type=int, default=300, help="measured requests per cell")
    parser.add_argument("--warmup", type=int, default=30, help="discarded requests per cell")
    parser.add_argument(
        "--database-url", default="postgresql://postgres@127.0.0.1:5432/checkouts_bench"
    )
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/13")
    parser.add_argument("--profile", type=Path, help="folder for cProfile output after the rounds")
    parser.add_argument("--profile-arms", default="new,old")
    parser.add_argument("--profile-n", type=int, default=2000, help="requests per profile")
    parser.add_argument("--profile-repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, help="write every measurement here")
    parser.add_argument(
        "--secret-key",
        default="benchmark-secret",
        help="the SECRET_KEY of every arm's app (Flask then opens its cookie session on "
        "each request, which a checkout whose benchmark app sets none skips); "
        "'' leaves each app as its checkout builds it",
    )
    parser.add_argument(
        "--summarize", type=Path, help="only print the summaries of the profiles in this folder"
    )
    parser.add_argument("--top", type=int, default=12, help="entries per profile summary")
    parser.add_argument(
        "--callgrind",
        metavar="N1,N2",
        help="only count instructions per request under callgrind, at these request counts",
    )
    args = parser.parse_args(argv)
    if args.summarize is None and (args.old is None or args.new is None):
        parser.error("--old and --new are required (unless --summarize)")
    return args


#: Who owns a profile entry's own time, first match wins (``~`` is a C function).
OWNERS = (
    ("flask_idempotency", "flask_idempotency/"),
    ("flask_sqlalchemy", "flask_sqlalchemy/"),
    ("sqlalchemy", "sqlalchemy/"),
    ("psycopg2 (C, incl. socket I/O)", "psycopg2"),
    ("flask / werkzeug", ("flask/", "werkzeug/", "itsdangerous/", "blinker/")),
)


def owner(filename: str, function: str) -> str:
    text = f"{filename} {function}"
    for name, marks in OWNERS:
        if any(mark in text for mark in ((marks,) if isinstance(marks, str) else marks)):
            return name
    return "stdlib / other"


def short(entry: tuple[str, int, str]) -> str:
    filename, line, function = entry
    for root in ("site-packages/", "/flask_idempotency/", "python3.11/"):
        if root in filename:
            prefix = "flask_idempotency/" if root == "/flask_idempotency/" else ""
            filename = prefix + filename.split(root, 1)[1]
            break
    return f"{filename}:{line}({function})" if filename != "~" else function


def load(files: list[Path]) -> dict[Any, Any]:
    """The entries of one or more profiles, summed."""
    return pstats.Stats(*(str(f) for f in files)).stats  # type: ignore[attr-defined,no-any-return]


def owners(files: list[Path]) -> tuple[dict[str, float], dict[str, int]]:
    """Own time (seconds) and calls of a profile's entries, summed by owning package."""
    spent: dict[str, float] = {}
    calls: dict[str, int] = {}
    for (filename, _line, function), (_cc, nc, tottime, _ct, _callers) in load(files).items():
        key = owner(filename, function)
        spent[key] = spent.get(key, 0.0) + tottime
        calls[key] = calls.get(key, 0) + nc
    return spent, calls


def compare(name: str, old: list[Path], new: list[Path], requests: int) -> str:
    """Own time and Python-level calls per request by package, two checkouts side
    by side. Times include cProfile's overhead (about a microsecond per call), so
    read the differences, not the totals; the calls are exact."""
    (before, calls_before), (after, calls_after) = owners(old), owners(new)
    scale = 1e6 / (requests * len(new))
    per = 1 / (requests * len(new))
    lines = [f"#### {name}: by package, old -> new (per request; us under cProfile)", ""]
    lines += [
        "| own time in | old us | new us | new - old us | old calls | new calls |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    keys = sorted(set(before) | set(after), key=lambda k: -(after.get(k, 0) - before.get(k, 0)))
    for key in [*keys, "total"]:
        b = sum(before.values()) if key == "total" else before.get(key, 0.0)
        a = sum(after.values()) if key == "total" else after.get(key, 0.0)
        cb = sum(calls_before.values()) if key == "total" else calls_before.get(key, 0)
        ca = sum(calls_after.values()) if key == "total" else calls_after.get(key, 0)
        lines.append(
            f"| {key} | {b * scale:.0f} | {a * scale:.0f} | {(a - b) * scale:+.0f} | "
            f"{cb * per:.0f} | {ca * per:.0f} |"
        )
    return "\n".join(lines) + "\n"


def groups(folder: Path) -> dict[str, list[Path]]:
    """Profiles by arm-subject-path, the repeats of one cell together."""
    found: dict[str, list[Path]] = {}
    for prof in sorted(folder.glob("*.prof")):
        found.setdefault(prof.stem.rsplit("-", 1)[0], []).append(prof)
    return found


def summarize(name: str, files: list[Path], requests: int, top: int) -> str:
    """One cell's profiles as markdown: own CPU per request by package, then the
    entries with the most own time and the extension's and SQLAlchemy's with the
    most cumulative time (microseconds per request, cProfile's overhead included)."""
    stats = load(files)
    requests *= len(files)
    per_owner: dict[str, float] = {}
    total = 0.0
    for (filename, _line, function), (_cc, _nc, tottime, _ct, _callers) in stats.items():
        key = owner(filename, function)
        per_owner[key] = per_owner.get(key, 0.0) + tottime
        total += tottime
    scale = 1e6 / requests
    lines = [f"#### {name} ({total * scale:.0f} us/request under cProfile)", ""]
    lines.append("| own time in | us/req | share |")
    lines.append("|---|---:|---:|")
    for key, spent in sorted(per_owner.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {key} | {spent * scale:.0f} | {spent / total:.0%} |")
    lines += ["", "| top own time | calls/req | own us/req | cum us/req |", "|---|---:|---:|---:|"]
    ranked = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    for entry, (_cc, nc, tottime, cumtime, _callers) in ranked:
        own, cum = tottime * scale, cumtime * scale
        lines.append(f"| `{short(entry)}` | {nc / requests:g} | {own:.0f} | {cum:.0f} |")
    lines += [
        "",
        "| top cumulative (extension, SQLAlchemy) | calls/req | cum us/req |",
        "|---|---:|---:|",
    ]
    ours = [
        kv for kv in stats.items() if "sqlalchemy" in kv[0][0] or "flask_idempotency" in kv[0][0]
    ]
    for entry, (_cc, nc, _tt, cumtime, _callers) in sorted(ours, key=lambda kv: -kv[1][3])[:top]:
        lines.append(f"| `{short(entry)}` | {nc / requests:g} | {cumtime * scale:.0f} |")
    return "\n".join(lines) + "\n"


def median_ratio(rows: list[dict[str, float]], num: str, den: str) -> str:
    ratios = [row[num] / row[den] for row in rows]
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.callgrind is not None:
        low, high = (int(n) for n in args.callgrind.split(","))
        print("| subject | path | old instr/req | new instr/req | new/old |")
        print("|---|---|---:|---:|---:|")
        for subject in args.subjects.split(","):
            for path in args.paths.split(","):
                counted = {
                    name: instructions(
                        checkout.resolve(),
                        subject,
                        path,
                        (low, high),
                        arm_database(args.database_url, f"{name}_cg"),
                    )
                    for name, checkout in (("old", args.old), ("new", args.new))
                }
                print(
                    f"| {subject} | {path} | {counted['old']:,.0f} | {counted['new']:,.0f} | "
                    f"{counted['new'] / counted['old']:.2f} |",
                    flush=True,
                )
        return 0
    if args.summarize is not None:
        found = groups(args.summarize)
        for name, files in found.items():
            old = found.get(name.replace("new-", "old-", 1))
            if name.startswith("new-") and old:
                print(compare(name.removeprefix("new-"), old, files, args.profile_n))
        for name, files in found.items():
            print(summarize(name, files, args.profile_n, args.top))
        return 0
    checkouts = {"old": args.old.resolve(), "old2": args.old.resolve(), "new": args.new.resolve()}
    subjects = args.subjects.split(",")
    paths = args.paths.split(",")
    arms: dict[tuple[str, str], Arm] = {}
    cells: dict[tuple[str, str], list[dict[str, float]]] = {}
    try:
        for subject in subjects:
            for name, checkout in checkouts.items():
                dsn = arm_database(args.database_url, name)
                arms[(name, subject)] = Arm(
                    name, checkout, subject, dsn, args.redis_url, args.secret_key
                )
        names = list(checkouts)
        for round_no in range(args.rounds):
            order = names[round_no % 3 :] + names[: round_no % 3]
            for subject in subjects:
                for path in paths:
                    row: dict[str, float] = {}
                    for name in order:
                        got = arms[(name, subject)].ask(f"probe {path} {args.n} {args.warmup}")
                        row[name] = got["cpu_us"]
                        if round_no == 0 or len(got["answers"]) != 1:
                            print(f"{name} {subject} {path} answered {got['answers']}")
                    cells.setdefault((subject, path), []).append(row)
                    print(
                        f"round {round_no + 1:>2} {subject:8s} {path:6s} "
                        + " ".join(f"{k} {row[k]:6.0f}" for k in names)
                        + f" | new/old {row['new'] / row['old']:.3f}"
                        + f" old2/old {row['old2'] / row['old']:.3f}",
                        flush=True,
                    )
        print()
        print("| subject | path | old us | old2 us | new us | new/old | old2/old (A/A) |")
        print("|---|---|---:|---:|---:|---:|---:|")
        for (subject, path), rows in cells.items():
            meds = " | ".join(f"{statistics.median(r[k] for r in rows):.0f}" for k in names)
            print(
                f"| {subject} | {path} | {meds} | "
                f"{median_ratio(rows, 'new', 'old')} | {median_ratio(rows, 'old2', 'old')} |"
            )
        if args.json is not None:
            args.json.write_text(json.dumps({f"{s} {p}": rows for (s, p), rows in cells.items()}))
        if args.profile is not None:
            args.profile.mkdir(parents=True, exist_ok=True)
            # The arms alternate within each cell, repeated: the machine's drift
            # reaches both alike (the repeats are summed when summarized).
            profiled = args.profile_arms.split(",")
            for repeat in range(args.profile_repeats):
                for subject in subjects:
                    for path in paths:
                        for name in profiled if repeat % 2 == 0 else profiled[::-1]:
                            dest = args.profile / f"{name}-{subject}-{path}-{repeat}.prof"
                            arms[(name, subject)].ask(f"profile {path} {args.profile_n} {dest}")
                            print(f"profile: {dest}", flush=True)
    finally:
        for arm in arms.values():
            arm.close()
    return 0


if __name__ == "__main__":
    started = time.monotonic()
    status = main()
    print(f"({time.monotonic() - started:.0f} s)")
    sys.exit(status)
