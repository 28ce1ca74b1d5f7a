"""``python -m benchmarks.inprocess``: one subject's requests called in-process.

No gunicorn, no load generator, no sockets but the databases': the WSGI app is
called directly with the same body the benchmark sends, so the figure is what
Flask plus the extension cost per request, without the server's ~300 us floor
that compresses every ratio in the full run. Use it to see whether a change to
the hot path helps before spending ten minutes on ``make bench``.

CPU time per request still drifts on a shared machine. For a deterministic
figure, count instructions under callgrind at two request counts and divide
the difference (start-up and warm-up cancel out)::

    valgrind --tool=callgrind python -m benchmarks.inprocess pg+redis replay -n 100
    valgrind --tool=callgrind python -m benchmarks.inprocess pg+redis replay -n 300
    # (collected_300 - collected_100) / 200 = instructions per request
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import os
import secrets
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from flask import Flask

from flask_idempotency.profiles import STRIPE

from . import app as bench_app
from . import cpu
from .app import CHARGES_PATH, HEALTH_PATH, REQUEST_BODY, SUBJECTS

PATHS = ("first", "replay", "noop")


#: What one request answered: its status line and its ``Idempotent-Replayed``
#: header (``None`` without the extension or on the no-op route).
Answer = tuple[str, str | None]


@dataclasses.dataclass(frozen=True)
class Probe:
    #: This process's CPU per request: Flask, the extension, the driver (all threads).
    cpu_us: float
    wall_us: float
    answers: Counter[Answer]
    #: The subject's PostgreSQL backends' CPU per request, when a meter counted it.
    postgres_us: float | None = None


def make_environ(key: str | None, method: str = "POST", path: str = CHARGES_PATH) -> dict[str, Any]:
    """The benchmark's request as a WSGI environ like gunicorn's, with its own body
    stream. Built by hand rather than with Werkzeug's ``EnvironBuilder``, which
    costs about a third of a replay: the callgrind recipe counts every
    instruction that grows with the request count, environ building included."""
    body = REQUEST_BODY if method == "POST" else b""
    environ: dict[str, Any] = {
        "REQUEST_METHOD": method,
        "SCRIPT_NAME": "",
        "PATH_INFO": path,
        "QUERY_STRING": "",
        "SERVER_NAME": "127.0.0.1",
        "SERVER_PORT": "80",
        "SERVER_PROTOCOL": "HTTP/1.1",
        "HTTP_HOST": "127.0.0.1",
        "wsgi.version": (1, 0),
        "wsgi.url_scheme": "http",
        "wsgi.input": io.BytesIO(body),
        "wsgi.errors": sys.stderr,
        "wsgi.multithread": True,
        "wsgi.multiprocess": True,
        "wsgi.run_once": False,
        "wsgi.input_terminated": True,
    }
    if method == "POST":
        environ["CONTENT_TYPE"] = "application/json"
        environ["CONTENT_LENGTH"] = str(len(body))
    if key is not None:
        environ["HTTP_IDEMPOTENCY_KEY"] = key
    return environ


def caller(wsgi: Flask) -> Callable[[dict[str, Any]], Answer]:
    """A function that runs one request through ``wsgi``, reads the whole body
    (as a server would), and returns what it answered."""

    def call(environ: dict[str, Any]) -> Answer:
        answer: list[Answer] = []

        def start_response(status: str, headers: Any, exc_info: Any = None) -> Any:
            answer.append((status, dict(headers).get(STRIPE.replayed_header)))
            return None

        for _chunk in wsgi(environ, start_response):
            pass
        return answer[0]

    return call


def environs(path: str, n: int, replay_key: str) -> list[dict[str, Any]]:
    if path == "noop":
        return [make_environ(None, "GET", HEALTH_PATH) for _ in range(n)]
    if path == "replay":
        return [make_environ(replay_key) for _ in range(n)]
    return [make_environ(f"inproc-{secrets.token_hex(8)}") for _ in range(n)]


class Subject:
    """One subject's app, built once, measured as often as asked.

    Used as a context manager: it prepares the database, builds the app,
    completes the key the replay path replays, and closes the extension's
    store and the app's SQLAlchemy engine on the way out. With ``meter`` each
    probe also counts the CPU of the subject's PostgreSQL backends (labelled
    by ``application_name``; ``benchmarks.cpu``)."""

    def __init__(self, subject: str, meter: cpu.CpuMeter | None = None) -> None:
        self.subject = subject
        self.meter = meter
        self.label = bench_app.application_name(subject)
        self.wsgi: Flask | None = None
        self.replay_key = f"inproc-replay-{secrets.token_hex(8)}"

    def __enter__(self) -> Subject:
        bench_app.prepare_database(bench_app.database_url(), [self.subject])
        self.wsgi = bench_app.create_app(self.subject)
        try:
            status, _ = caller(self.wsgi)(make_environ(self.replay_key))
            if not status.startswith("201"):
                raise RuntimeError(f"{self.subject}: the first request answered {status}")
        except BaseException:
            self.close()
            raise
        return self

    @property
    def app(self) -> Flask:
        assert self.wsgi is not None, "use Subject as a context manager"
        return self.wsgi

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        wsgi, self.wsgi = self.wsgi, None
        if wsgi is None:
            return
        state = wsgi.extensions.get("idempotency")
        if state is not None:
            state.close()
        db = wsgi.extensions.get("sqlalchemy")
        if db is not None:
            with wsgi.app_context():
                db.engine.dispose()

    def probe(self, path: str, n: int, warmup: int) -> Probe:
        """CPU and wall microseconds per request, after ``warmup`` discarded requests,
        and what the measured requests answered."""
        assert self.wsgi is not None, "use Subject as a context manager"
        call = caller(self.wsgi)
        for environ in environs(path, warmup, self.replay_key):
            call(environ)
        batch = environs(path, n, self.replay_key)
        before = self.meter.start(os.getpid(), self.label) if self.meter is not None else None
        cpu0, wall0 = time.process_time(), time.perf_counter()
        answers = Counter(call(environ) for environ in batch)
        cpu1, wall1 = time.process_time(), time.perf_counter()
        postgres_us = None
        if self.meter is not None and before is not None:
            postgres_us = self.meter.delta(before, os.getpid(), self.label).postgres / n * 1e6
        return Probe((cpu1 - cpu0) / n * 1e6, (wall1 - wall0) / n * 1e6, answers, postgres_us)


def measure(subject: str, path: str, n: int, warmup: int) -> Probe:
    """One subject's ``path``, ``n`` requests after ``warmup`` discarded ones."""
    with Subject(subject) as opened:
        return opened.probe(path, n, warmup)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.inprocess", description=__doc__)
    parser.add_argument("subject", choices=SUBJECTS)
    parser.add_argument("path", choices=PATHS)
    parser.add_argument("-n", type=int, default=2000, help="measured requests")
    parser.add_argument("--warmup", type=int, default=50)
    args = parser.parse_args(argv)
    probe = measure(args.subject, args.path, args.n, args.warmup)
    answers = ", ".join(
        f"{status} (replayed: {replayed}) x{count}"
        for (status, replayed), count in probe.answers.items()
    )
    print(
        f"{args.subject} {args.path}: {probe.cpu_us:.0f} us CPU, "
        f"{probe.wall_us:.0f} us wall per request; answers: {answers}"
    )


if __name__ == "__main__":
    main()
