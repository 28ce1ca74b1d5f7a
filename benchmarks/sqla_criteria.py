"""``python -m benchmarks.sqla_criteria``: issue 24's performance criteria, in process.

The extension on Flask-SQLAlchemy (``sqla-pg``: ``Idempotency(app, db=db)``,
``db.session`` joined to the request's transaction) is held to two marks:

1. its **added CPU per first request** over its own baseline (``sqla-pg`` -
   ``sqla-bare``) must not exceed the extension's added CPU on the raw
   psycopg2 path (``pg`` - ``bare``) by more than 15%;
2. and must be at or below what a hand-written idempotency layer on
   ``db.session`` adds (``sqla-handwritten`` - ``sqla-bare``);

and its **replays** the same: a replay's CPU on the Flask-SQLAlchemy path at
most 15% above the raw path's, and at or below the hand-written layer's. (A
replay does no business work, so it is compared as it is, not as a difference
to a baseline that does.)

All subjects' apps live in this one process (``benchmarks.inprocess``: the
WSGI app called directly, no gunicorn, no load generator) and are measured
interleaved: each round runs every subject back to back, in an order rotated
each round, and every figure is a per-round difference or ratio, then the
median over rounds with its min-max. CPU is this process's (Flask, the
extension, SQLAlchemy, the driver, every thread) plus the subject's PostgreSQL
backends' (from ``/proc``, by ``application_name``), so run it on the
database's machine. The criteria are judged on that total; the app's share
alone is printed next to it.

With ``--txclaim`` the transaction claim mode is measured too (``pg-txclaim``
and ``sqla-pg-txclaim``), against the same baselines and hand-written layer.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import secrets
import statistics
import sys
import time
from collections import Counter
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from . import app as bench_app
from . import cpu
from .inprocess import Answer, Probe, Subject, caller, environs

RESULTS_DIR = Path(__file__).resolve().parent / "results"
PATHS = ("first", "replay")

#: (extension, its baseline) on each path, and the hand-written layer.
RAW = ("pg", "bare")
SQLA = ("sqla-pg", "sqla-bare")
RAW_TX = ("pg-txclaim", "bare")
SQLA_TX = ("sqla-pg-txclaim", "sqla-bare")
HANDWRITTEN = "sqla-handwritten"

#: The issue's marks: the SQLAlchemy path's added CPU at most 15% above the raw
#: path's; at or below the hand-written layer's.
RAW_MARK = 1.15
HANDWRITTEN_MARK = 1.00

#: Requests a subject runs before the next one takes its turn.
CHUNK = 25


@dataclasses.dataclass(frozen=True)
class Spread:
    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        return cls(statistics.median(values), min(values), max(values))

    def text(self, spec: str) -> str:
        return f"{self.median:{spec}} ({self.low:{spec}} to {self.high:{spec}})"


@dataclasses.dataclass(frozen=True)
class Criterion:
    name: str
    ratio: Spread
    mark: float

    @property
    def met(self) -> bool:
        return self.ratio.median <= self.mark


def subjects_for(txclaim: bool) -> list[str]:
    chosen = [*RAW[::-1], *SQLA[::-1], HANDWRITTEN]
    if txclaim:
        chosen += [RAW_TX[0], SQLA_TX[0]]
    return chosen


def total(probe: Probe) -> float:
    """App plus PostgreSQL CPU per request (the app's alone without a meter)."""
    return probe.cpu_us + (probe.postgres_us or 0.0)


def run(
    subjects: Sequence[str], rounds: int, n: int, warmup: int, chunk: int = CHUNK
) -> list[dict[str, dict[str, Probe]]]:
    """Per round, per path, per subject: one probe of ``n`` requests.

    Within a round the subjects take turns ``chunk`` requests at a time (in an
    order rotated each round), so that a minute in which the shared machine is
    slow falls on all of them alike: measured one after the other, 2 s each,
    the same subject's CPU per request moved by a third from one measurement to
    the next here, more than the differences being measured. The app's CPU is
    summed over its chunks; its PostgreSQL backends serve no other subject, so
    theirs is read once around the whole round."""
    meter = cpu.CpuMeter(bench_app.database_url(), None) if cpu.available() else None
    results: list[dict[str, dict[str, Probe]]] = []
    try:
        with ExitStack() as stack:
            opened = {s: stack.enter_context(Subject(s, meter)) for s in subjects}
            for round_no in range(rounds):
                shift = round_no % len(subjects)
                order = [*subjects[shift:], *subjects[:shift]]
                this_round = {path: interleaved(opened, order, path, n, warmup, chunk, meter)
                              for path in PATHS}  # fmt: skip
                results.append(this_round)
                print(_round_line(round_no, this_round, subjects), flush=True)
    finally:
        if meter is not None:
            meter.close()
    return results


def interleaved(
    opened: dict[str, Subject],
    order: Sequence[str],
    path: str,
    n: int,
    warmup: int,
    chunk: int,
    meter: cpu.CpuMeter | None,
) -> dict[str, Probe]:
    """Every subject's ``path``, ``n`` requests each, taken ``chunk`` at a time in turn."""
    calls = {s: caller(opened[s].app) for s in order}
    batches = {s: environs(path, n + warmup, opened[s].replay_key) for s in order}
    for s in order:
        for environ in batches[s][:warmup]:
            calls[s](environ)
    before = {s: meter.start(os.getpid(), opened[s].label) for s in order} if meter else {}
    app_cpu = dict.fromkeys(order, 0.0)
    wall = dict.fromkeys(order, 0.0)
    answers: dict[str, Counter[Answer]] = {s: Counter() for s in order}
    for start in range(warmup, warmup + n, chunk):
        for s in order:
            call, batch = calls[s], batches[s][start : min(start + chunk, warmup + n)]
            cpu0, wall0 = time.process_time(), time.perf_counter()
            answers[s].update(call(environ) for environ in batch)
            app_cpu[s] += time.process_time() - cpu0
            wall[s] += time.perf_counter() - wall0
    found = {}
    for s in order:
        postgres_us = None
        if meter is not None:
            postgres_us = meter.delta(before[s], os.getpid(), opened[s].label).postgres / n * 1e6
        found[s] = Probe(app_cpu[s] / n * 1e6, wall[s] / n * 1e6, answers[s], postgres_us)
    return found


def _round_line(
    round_no: int, this_round: dict[str, dict[str, Probe]], subjects: Sequence[str]
) -> str:
    parts = []
    for path, probes in this_round.items():
        figures = " ".join(
            f"{s}={probes[s].cpu_us:.0f}+{probes[s].postgres_us or 0:.0f}" for s in subjects
        )
        parts.append(f"{path}: {figures}")
    return f"round {round_no + 1}: " + " | ".join(parts)


def added(
    results: list[dict[str, dict[str, Probe]]],
    pair: tuple[str, str],
    path: str = "first",
    share: str = "total",
) -> list[float]:
    """Per round: ``pair[0]``'s CPU per request minus ``pair[1]``'s on ``path``."""
    figure = total if share == "total" else (lambda p: p.cpu_us)
    return [figure(r[path][pair[0]]) - figure(r[path][pair[1]]) for r in results]


def cpu_of(
    results: list[dict[str, dict[str, Probe]]], subject: str, path: str, share: str = "total"
) -> list[float]:
    figure = total if share == "total" else (lambda p: p.cpu_us)
    return [figure(r[path][subject]) for r in results]


def _ratios(numerators: Sequence[float], denominators: Sequence[float]) -> list[float]:
    return [a / b for a, b in zip(numerators, denominators, strict=True) if b != 0]


def criteria(
    results: list[dict[str, dict[str, Probe]]],
    raw: tuple[str, str],
    sqla: tuple[str, str],
    share: str = "total",
) -> list[Criterion]:
    """The issue's four marks for one claim mode, as per-round ratios."""
    raw_added = added(results, raw, share=share)
    sqla_added = added(results, sqla, share=share)
    hand_added = added(results, (HANDWRITTEN, sqla[1]), share=share)
    raw_replay = cpu_of(results, raw[0], "replay", share)
    sqla_replay = cpu_of(results, sqla[0], "replay", share)
    hand_replay = cpu_of(results, HANDWRITTEN, "replay", share)
    return [
        Criterion(
            f"first: ({sqla[0]} - {sqla[1]}) / ({raw[0]} - {raw[1]})",
            Spread.of(_ratios(sqla_added, raw_added)),
            RAW_MARK,
        ),
        Criterion(
            f"first: ({sqla[0]} - {sqla[1]}) / ({HANDWRITTEN} - {sqla[1]})",
            Spread.of(_ratios(sqla_added, hand_added)),
            HANDWRITTEN_MARK,
        ),
        Criterion(
            f"replay: {sqla[0]} / {raw[0]}", Spread.of(_ratios(sqla_replay, raw_replay)), RAW_MARK
        ),
        Criterion(
            f"replay: {sqla[0]} / {HANDWRITTEN}",
            Spread.of(_ratios(sqla_replay, hand_replay)),
            HANDWRITTEN_MARK,
        ),
    ]


def render(
    results: list[dict[str, dict[str, Probe]]], subjects: Sequence[str], meta: dict[str, Any]
) -> str:
    lines = [
        "# Flask-SQLAlchemy path: issue 24's criteria (in process)",
        "",
        f"Run `{meta['run_id']}` started {meta['started']} ({meta['wall_seconds']} s): "
        f"{meta['rounds']} rounds x {meta['requests']} requests per subject and path "
        f"(after {meta['warmup']} discarded), the subjects taking turns {meta['chunk']} "
        "requests at a time, in an order rotated each round; "
        f"{meta['cpus']} CPUs, 1-minute load average {meta['load_average'][0]} at the "
        f"start and {meta['load_average'][1]} at the end; Python {meta['python']}, "
        f"SQLAlchemy {meta['sqlalchemy']}, Flask-SQLAlchemy {meta['flask_sqlalchemy']}."
        + _rows_text(meta),
        "",
        "CPU per request: this process (Flask, extension, SQLAlchemy, psycopg2) + the "
        "subject's PostgreSQL backends. Medians over rounds, min-max in brackets; "
        "`+` columns and ratios are taken per round, then the median.",
        "",
        "## CPU per request, us",
        "",
        "| subject | first: app + pg | first: + over its baseline | replay: app + pg |",
        "|---|---:|---:|---:|",
    ]
    baselines = {"pg": "bare", "pg-txclaim": "bare", "sqla-pg": "sqla-bare",
                 "sqla-pg-txclaim": "sqla-bare", HANDWRITTEN: "sqla-bare"}  # fmt: skip
    for subject in subjects:
        first = Spread.of(cpu_of(results, subject, "first"))
        app_first = statistics.median(cpu_of(results, subject, "first", "app"))
        replay = Spread.of(cpu_of(results, subject, "replay"))
        app_replay = statistics.median(cpu_of(results, subject, "replay", "app"))
        base = baselines.get(subject)
        plus = Spread.of(added(results, (subject, base))).text("+.0f") if base else "-"
        lines.append(
            f"| {subject} | {first.text('.0f')} [app {app_first:.0f}] | {plus} "
            f"| {replay.text('.0f')} [app {app_replay:.0f}] |"
        )
    lines += ["", "Replays of the baselines are first requests (they ignore the key).", ""]
    modes = [("row claim mode (the default)", RAW, SQLA)]
    if "sqla-pg-txclaim" in subjects:
        modes.append(("transaction claim mode", RAW_TX, SQLA_TX))
    for title, raw, sqla in modes:
        lines += [
            f"## Criteria, {title}",
            "",
            "| criterion | ratio, app + pg | mark | met | ratio, app only |",
            "|---|---:|---:|---|---:|",
        ]
        app_only = criteria(results, raw, sqla, share="app")
        for crit, app in zip(criteria(results, raw, sqla), app_only, strict=True):
            verdict = "yes" if crit.met else "**no**"
            lines.append(
                f"| {crit.name} | {crit.ratio.text('.2f')} | <= {crit.mark:.2f} | {verdict} "
                f"| {app.ratio.text('.2f')} |"
            )
        lines.append("")
    return "\n".join(lines)


def _rows_text(meta: dict[str, Any]) -> str:
    rows = meta.get("rows_at_end")
    if not rows:
        return ""
    return (
        " Tables emptied at the start; at the end idempotency_records held "
        f"{rows['idempotency_records']:,} rows (every extension subject's), "
        f"bench_sqla_keys {rows['bench_sqla_keys']:,}."
    )


def table_rows(dsn: str) -> dict[str, int]:
    """Rows in the records' and the hand-written layer's tables (the run's conditions)."""
    import psycopg2

    conn = psycopg2.connect(dsn)
    try:
        with conn, conn.cursor() as cur:
            cur.execute("SELECT count(*) FROM idempotency_records")
            records = cur.fetchone()
            cur.execute("SELECT count(*) FROM bench_sqla_keys")
            keys = cur.fetchone()
    finally:
        conn.close()
    return {
        "idempotency_records": int(records[0]) if records else 0,
        "bench_sqla_keys": int(keys[0]) if keys else 0,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sqla_criteria", description=__doc__)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("-n", type=int, default=1000, help="requests per subject, path and round")
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--chunk", type=int, default=CHUNK, help="requests per turn")
    parser.add_argument("--txclaim", action="store_true", help="the transaction claim mode too")
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    subjects = subjects_for(args.txclaim)
    reasons = [r for s in subjects if (r := bench_app.unavailable(s)) is not None]
    if reasons:
        raise SystemExit("cannot run: " + "; ".join(reasons))
    run_id = secrets.token_hex(4)
    # Every run starts from empty tables, as ``make bench`` does: the tables' sizes
    # move every subject's PostgreSQL CPU (a first request on a database where
    # earlier runs left their rows cost the hand-written layer twice what it did
    # on a fresh one here), so runs on different days compare only this way.
    dsn = bench_app.database_url()
    bench_app.prepare_database(dsn, subjects)
    bench_app.reset_database(dsn)
    started, load_before = time.time(), os.getloadavg()
    results = run(subjects, args.rounds, args.n, args.warmup, args.chunk)
    from importlib.metadata import version

    meta = {
        "run_id": run_id,
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
        "wall_seconds": round(time.time() - started, 1),
        "rounds": args.rounds,
        "requests": args.n,
        "warmup": args.warmup,
        "chunk": args.chunk,
        "cpus": os.cpu_count(),
        "load_average": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "python": sys.version.split()[0],
        "sqlalchemy": version("sqlalchemy"),
        "flask_sqlalchemy": version("flask-sqlalchemy"),
        "rows_at_end": table_rows(dsn),
    }
    markdown = render(results, subjects, meta)
    print(markdown)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    md_path = args.output_dir / f"sqla-{run_id}.md"
    md_path.write_text(markdown)
    raw = [
        {path: {s: dataclasses.asdict(p) | {"answers": _answers(p)} for s, p in probes.items()}
         for path, probes in r.items()}
        for r in results
    ]  # fmt: skip
    json_path = args.output_dir / f"sqla-{run_id}.json"
    json_path.write_text(json.dumps({"meta": meta, "rounds": raw}, indent=1))
    print(f"written: {md_path} and {json_path}")
    return 0


def _answers(probe: Probe) -> dict[str, int]:
    return {f"{status} replayed={replayed}": n for (status, replayed), n in probe.answers.items()}


if __name__ == "__main__":
    sys.exit(main())
