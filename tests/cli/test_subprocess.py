"""``flask --app example_app idempotency purge`` as an operator runs it: a real
process against the real PostgreSQL, from cron (pipes), at a terminal (a
pseudo-terminal) and stopped with Ctrl-C."""

from __future__ import annotations

import os
import pty
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from .conftest import count, seed_expired

REPO_ROOT = Path(__file__).resolve().parents[2]
PURGE = [sys.executable, "-m", "flask", "--app", "example_app", "idempotency", "purge"]
#: A process start (app import, pool, migrations) is a second or two on a busy machine.
TIMEOUT = 120.0


def environment(database_url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLASK_", "REDIS_"))}
    return env | {"DATABASE_URL": database_url, "PYTHONPATH": str(REPO_ROOT)}


def test_from_cron_purge_logs_progress_lines_and_totals(clean_db: str) -> None:
    seed_expired(clean_db, 5000)
    done = subprocess.run(
        [*PURGE, "--batch-size", "1000", "--progress-interval", "0"],
        env=environment(clean_db),
        cwd=REPO_ROOT,
        stdin=subprocess.DEVNULL,  # as cron: nobody to ask, no --yes needed
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert done.returncode == 0, done.stderr
    lines = [ln for ln in done.stderr.splitlines() if ln.startswith("deleting expired records")]
    assert [ln.split(",")[0] for ln in lines] == [
        f"deleting expired records: {n}/5000 ({n // 50}%)" for n in range(1000, 5001, 1000)
    ]
    assert "\r" not in done.stderr  # no bar in a log
    assert done.stdout == "5000 expired record(s) deleted\n"
    assert count(clean_db) == 0


def test_ctrl_c_stops_purge_between_batches_and_says_what_was_deleted(clean_db: str) -> None:
    seed_expired(clean_db, 30000)
    child = subprocess.Popen(
        [*PURGE, "--batch-size", "10", "--progress-interval", "0"],
        env=environment(clean_db),
        cwd=REPO_ROOT,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert child.stderr is not None
    try:
        for line in child.stderr:  # wait until it is deleting
            if line.startswith("deleting expired records"):
                break
        child.send_signal(signal.SIGINT)
        stdout, stderr = child.communicate(timeout=TIMEOUT)
    finally:
        child.kill()
        child.wait()
    assert child.returncode == 130, stderr
    deleted = int(stdout.split()[0])
    assert stdout == f"{deleted} expired record(s) deleted\n"
    assert 0 < deleted < 30000 and deleted % 10 == 0  # whole batches only
    assert f"interrupted by SIGINT: stopped between batches after {deleted} record(s)" in stderr
    assert "Traceback" not in stderr
    assert count(clean_db) == 30000 - deleted


def run_on_a_terminal(args: list[str], database_url: str, answer: str) -> tuple[int, str]:
    """Run ``args`` on a pseudo-terminal; type ``answer`` at the first question."""
    master, slave = pty.openpty()
    child = subprocess.Popen(
        args,
        env=environment(database_url) | {"COLUMNS": "120"},
        cwd=REPO_ROOT,
        stdin=slave,
        stdout=slave,
        stderr=slave,
        close_fds=True,
    )
    os.close(slave)
    seen = b""
    answered = False
    deadline = time.monotonic() + TIMEOUT
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if not ready:
                if child.poll() is not None:
                    break
                continue
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            seen += chunk
            if not answered and b"[y/N]" in seen:
                os.write(master, answer.encode() + b"\n")
                answered = True
        returncode = child.wait(timeout=TIMEOUT)
    finally:
        child.kill()
        child.wait()
        os.close(master)
    return returncode, seen.decode("utf-8", "replace")


def test_on_a_terminal_purge_says_what_it_will_do_asks_and_shows_a_bar(clean_db: str) -> None:
    seed_expired(clean_db, 3000)
    declined, shown = run_on_a_terminal([*PURGE, "--batch-size", "100"], clean_db, "n")
    assert declined == 1, shown
    assert "3000 expired record(s) and 0 published event(s) will be deleted" in shown
    assert "Delete them? [y/N]" in shown and "Aborted" in shown
    assert count(clean_db) == 3000

    accepted, shown = run_on_a_terminal([*PURGE, "--batch-size", "100"], clean_db, "y")
    assert accepted == 0, shown
    assert "deleting expired records" in shown and "3000/3000" in shown and "\r" in shown
    assert "/s" in shown and "elapsed" in shown
    assert "3000 expired record(s) deleted" in shown
    assert count(clean_db) == 0
