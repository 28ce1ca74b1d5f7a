"""``python -m benchmarks.opcodes``: Python bytecodes per request, and where they go.

CPU time per request moves by a tenth between runs on a shared machine; the
number of bytecodes the interpreter executes for one request does not (to a
few per thousand). So a hot-path change is checked here first: the subject's
requests are called in-process (``benchmarks.inprocess``), under
``sys.settrace`` with opcode events, and each executed bytecode is counted
against the function it belongs to. C code (the drivers, ``json``,
``hashlib``, PostgreSQL itself) is not counted: for that, the callgrind recipe
in ``benchmarks.inprocess`` or ``benchmarks.sqla_criteria``'s CPU figures.

    python -m benchmarks.opcodes sqla-pg first -n 200
    python -m benchmarks.opcodes pg replay -n 200 --top 30
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

from . import inprocess
from .app import SUBJECTS

#: Where a function's file lives, shortened for the report.
_ROOTS = (str(Path(sys.prefix)), str(Path(__file__).resolve().parents[1]))


@dataclasses.dataclass(frozen=True)
class Count:
    #: Bytecodes per request, all functions together.
    per_request: float
    #: Bytecodes per request by function (``file:function``).
    by_function: dict[str, float]
    answers: Counter[inprocess.Answer]


def count(subject: str, path: str, n: int, warmup: int = 30) -> Count:
    """Run ``n`` requests of ``subject``'s ``path`` (after ``warmup`` uncounted ones)
    and count the bytecodes each function executed."""
    counts: Counter[tuple[str, str]] = Counter()

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        where = (frame.f_code.co_filename, frame.f_code.co_name)

        def local(frame: FrameType, event: str, arg: Any) -> Any:
            if event == "opcode":
                counts[where] += 1
            return local

        return local

    with inprocess.Subject(subject) as opened:
        call = inprocess.caller(opened.app)
        for environ in inprocess.environs(path, warmup, opened.replay_key):
            call(environ)
        batch = inprocess.environs(path, n, opened.replay_key)
        answers: Counter[inprocess.Answer] = Counter()
        sys.settrace(trace)
        try:
            for environ in batch:
                answers[call(environ)] += 1
        finally:
            sys.settrace(None)
    by_function = {f"{_short(file)}:{name}": c / n for (file, name), c in counts.items()}
    return Count(sum(counts.values()) / n, by_function, answers)


def _short(filename: str) -> str:
    for root in _ROOTS:
        if filename.startswith(root):
            return filename[len(root) :].lstrip("/")
    return filename


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.opcodes", description=__doc__)
    parser.add_argument("subject", choices=SUBJECTS)
    parser.add_argument("path", choices=inprocess.PATHS)
    parser.add_argument("-n", type=int, default=200, help="counted requests")
    parser.add_argument("--top", type=int, default=20, help="functions to list")
    args = parser.parse_args(argv)
    counted = count(args.subject, args.path, args.n)
    answers = ", ".join(f"{s} (replayed: {r}) x{c}" for (s, r), c in counted.answers.items())
    print(f"{args.subject} {args.path}: {counted.per_request:,.0f} bytecodes per request")
    print(f"answers: {answers}")
    top = sorted(counted.by_function.items(), key=lambda item: -item[1])[: args.top]
    for function, per_request in top:
        print(f"{per_request:9,.0f}  {function}")


if __name__ == "__main__":
    main()
