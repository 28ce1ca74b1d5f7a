"""``python -m benchmarks.pg_instructions``: PostgreSQL's instructions per first request.

CPU time of a PostgreSQL backend moves by a tenth or more between runs on a
shared machine, which is the size of the differences a change of statement
shape makes. Instructions do not: this probe starts a throwaway PostgreSQL
under ``valgrind --tool=callgrind`` (every backend is counted, from its fork
to its exit) and runs ``benchmarks.statements``' sequences, each on fresh
backends twice, ``--warm`` requests and ``--warm`` + ``--requests``. The
difference, per request, is the backend's instructions for one request of that
sequence, its start-up and plan caching subtracted out. Repeated runs agree to
within a few tenths of a percent.

    python -m benchmarks.pg_instructions                  # bare, row, transaction, hand-written
    python -m benchmarks.pg_instructions --sequences bare,row --requests 200

It needs ``valgrind`` and PostgreSQL's server binaries (``initdb``,
``postgres``: ``pg_config --bindir``, or ``--bindir``); as root the server runs
as ``nobody`` (or ``postgres``). Instructions are not time: syscalls, cache
misses and waiting are not in them. Use it to compare statement shapes, and
``benchmarks.sqla_criteria`` for what a request costs.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg2

from flask_idempotency.testing.unprivileged import account, running_as_root

from .app import prepare_database
from .servers import free_port
from .statements import Probe, sequences

DEFAULT_SEQUENCES = ("bare", "row", "transaction", "hand-written")


def server_bindir(given: str | None) -> Path:
    """Where ``initdb`` and ``postgres`` are: ``given``, ``pg_config --bindir``, or the
    newest Debian-style ``/usr/lib/postgresql/N/bin``."""
    candidates = [given] if given else []
    if not given:
        pg_config = shutil.which("pg_config")
        if pg_config:
            out = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True)
            candidates.append(out.stdout.strip())
        candidates += sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)
    for candidate in candidates:
        if candidate and (Path(candidate) / "postgres").is_file():
            return Path(candidate)
    raise FileNotFoundError("no PostgreSQL server binaries (initdb, postgres): pass --bindir")


@contextmanager
def counted_postgres(bindir: Path) -> Iterator[tuple[str, Path]]:
    """A throwaway PostgreSQL whose every process runs under callgrind: its DSN, and
    the directory of the counts (``cg.<pid>``, written as each backend exits)."""
    if shutil.which("valgrind") is None:
        raise FileNotFoundError("valgrind is not installed")
    workdir = Path(tempfile.mkdtemp(prefix="pg-instructions-"))
    prefix: list[str] = []
    if running_as_root():
        runs_as = account()
        os.chown(workdir, runs_as.pw_uid, runs_as.pw_gid)
        prefix = ["runuser", "-u", runs_as.pw_name, "--"]
    data, counts, port = workdir / "data", workdir / "counts", free_port()
    subprocess.run([*prefix, "mkdir", str(counts)], check=True)  # (owned by the server's account)
    subprocess.run(
        [*prefix, str(bindir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres",
         "--no-sync", "--encoding=UTF8", "--locale=C"],
        check=True, capture_output=True,
    )  # fmt: skip
    server = subprocess.Popen(
        [*prefix, "valgrind", "--tool=callgrind", "--trace-children=yes",
         f"--callgrind-out-file={counts}/cg.%p", str(bindir / "postgres"), "-D", str(data),
         "-p", str(port), "-c", "listen_addresses=127.0.0.1", "-c", "unix_socket_directories=",
         "-c", "autovacuum=off", "-c", "fsync=off"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    dsn = f"postgresql://postgres@127.0.0.1:{port}/postgres"
    try:
        deadline = time.monotonic() + 120  # (valgrind starts slowly)
        while True:
            try:
                psycopg2.connect(dsn).close()
                break
            except psycopg2.OperationalError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("PostgreSQL under valgrind did not start") from None
                time.sleep(0.5)
        yield dsn, counts
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        shutil.rmtree(workdir, ignore_errors=True)


def instructions_of(counts: Path, pid: int, timeout: float = 300.0) -> int:
    """The instructions backend ``pid`` ran, once it has exited and its count is written."""
    path = counts / f"cg.{pid}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.is_file():
            for line in path.read_text().splitlines():
                if line.startswith(("totals:", "summary:")):
                    return int(line.split()[1])
        time.sleep(0.2)
    raise TimeoutError(f"no callgrind count for backend {pid}")


def backend_instructions(dsn: str, counts: Path, name: str, requests: int) -> int:
    """Instructions of the backend that ran ``requests`` of sequence ``name``, on
    fresh connections from its first statement to its exit."""
    probe = Probe(dsn)
    try:
        connection, run = sequences(probe)[name]
        pid = probe.backend_pid(connection)
        for _ in range(requests):
            run()
    finally:
        probe.close()
    return instructions_of(counts, pid)


def measure(dsn: str, counts: Path, names: list[str], warm: int, requests: int) -> dict[str, float]:
    """Per sequence, PostgreSQL's instructions per request (thousands)."""
    prepare_database(dsn, ["sqla-handwritten"])  # (the extension's schema too)
    found = {}
    for name in names:
        short = backend_instructions(dsn, counts, name, warm)
        long = backend_instructions(dsn, counts, name, warm + requests)
        found[name] = (long - short) / requests / 1000
    return found


def report(found: dict[str, float]) -> None:
    base = found.get("bare", 0.0)
    hand = found.get("hand-written")
    print("PostgreSQL instructions per request, thousands (callgrind)")
    for name, figure in found.items():
        line = f"{name:<26}{figure:9.1f}k  {figure - base:+9.1f}k over bare"
        if hand is not None and name != "hand-written" and hand > base and "bare" in found:
            line += f"  x{(figure - base) / (hand - base):.2f} of hand-written's"
        print(line)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.pg_instructions", description=__doc__
    )
    parser.add_argument("--sequences", default=",".join(DEFAULT_SEQUENCES))
    parser.add_argument("--warm", type=int, default=100, help="requests counted out")
    parser.add_argument("--requests", type=int, default=500, help="requests counted in")
    parser.add_argument("--bindir", default=None)
    args = parser.parse_args(argv)
    with counted_postgres(server_bindir(args.bindir)) as (dsn, counts):
        found = measure(dsn, counts, args.sequences.split(","), args.warm, args.requests)
    report(found)


if __name__ == "__main__":
    main()
