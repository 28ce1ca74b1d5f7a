"""What pytest-postgresql's process fixture needs from us to run the run-wide server.

``factories.postgresql_proc(executable=pg_ctl_executable())`` starts the
session's PostgreSQL from pgserver's binaries (see postgres_install.py).
pytest-postgresql drives ``pg_ctl`` (initdb, start, status, stop) itself; two
things it cannot do stay here:

* **root.** ``pg_ctl`` refuses to run as root, and pytest-postgresql keeps the
  cluster in pytest's temporary directory, which only its owner may enter
  (pytest resets ``/tmp/pytest-of-<user>`` to 0700 at every start). As root,
  ``executable`` is therefore the wrapper the library's pytest plugin uses
  (``flask_idempotency.testing.unprivileged``): it runs the real ``pg_ctl`` as
  an unprivileged account and moves the data directory and the log it is given
  to a directory that account owns. pytest-postgresql still sees its own paths
  (the wrapper leaves an empty directory where it expects the data).
* **a killed run.** ``pg_ctl`` detaches the server, so a run killed with
  SIGKILL would leave it running. :func:`watchdog` starts a small process tied
  to ours by the death signal (``_procs.spawn``) that stops the server when
  we die without tearing down.

Servers a test stops and starts, and the ones outage tests crash, are still
ThrowawayPostgres (postgres_server.py): pytest-postgresql has one server per
process fixture for the whole session, stopped only at its end.
"""

from __future__ import annotations

import functools
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from flask_idempotency.testing import unprivileged

from ._files import make_workdir, remove_tree, unprivileged_user
from ._procs import at_exit, log_tail, spawn, stop_process
from .postgres_install import find_bindir, usable_bindir
from .waiting import wait_until

#: Options of the run-wide server, passed through pg_ctl's ``-o``: TCP on loopback
#: only and no Unix socket, as for ThrowawayPostgres. (pytest-postgresql adds ``-F``,
#: no fsync: nothing ever crashes this server on purpose.)
SERVER_OPTIONS = "-c listen_addresses=127.0.0.1 -c unix_socket_directories=''"

#: Added to what pytest-postgresql passes initdb, as root: the C locale every
#: machine has, but UTF-8 (C alone would mean SQL_ASCII), and no fsync of a cluster
#: that is thrown away.
INITDB_OPTIONS = "--encoding=UTF8 --locale=C --no-sync"

# Waits for the death signal (or any TERM/INT), then stops the server at once.
_WATCHDOG = """\
import signal, subprocess, sys
wanted = {signal.SIGTERM, signal.SIGINT}
signal.pthread_sigmask(signal.SIG_BLOCK, wanted)
print("watching", flush=True)
signal.sigwait(wanted)
signal.pthread_sigmask(signal.SIG_UNBLOCK, wanted)
subprocess.run([sys.argv[1], "stop", "-D", sys.argv[2], "-m", "immediate"], timeout=60)
"""

_executable: str | None = None


def pg_ctl_executable() -> str:
    """The ``executable`` for ``factories.postgresql_proc``: pgserver's pg_ctl, or as
    root a wrapper that runs it unprivileged. Raises ``RuntimeError`` without binaries."""
    global _executable
    if _executable is None:
        run_as = unprivileged_user()
        bindir = find_bindir()
        if run_as is None:
            _executable = str(bindir / "pg_ctl")
        else:
            _executable = _unprivileged_wrapper(usable_bindir(bindir, run_as))
    return _executable


def _unprivileged_wrapper(bindir: Path) -> str:
    """The plugin's wrapper around ``bindir``'s pg_ctl, in a directory of this run's
    (root's own, holding the account's data directory), removed at exit."""
    workdir = make_workdir("pg-ctl")
    at_exit.add(workdir, functools.partial(remove_tree, workdir))
    return unprivileged.wrapper_for(
        str(bindir / "pg_ctl"), workdir, initdb_options=INITDB_OPTIONS, clean_environment=True
    )


@contextmanager
def watchdog(server: Any) -> Iterator[None]:
    """While the block runs, a SIGKILL of this process still stops ``server``
    (a pytest-postgresql ``PostgreSQLExecutor``)."""
    workdir = make_workdir("pg-watchdog")
    log_path = workdir / "watchdog.log"
    proc = spawn(
        [sys.executable, "-I", "-S", "-c", _WATCHDOG, str(server.executable), str(server.datadir)],
        log_path=log_path,
        death_signal=signal.SIGTERM,
    )
    try:
        # Until it blocks the signal, a death signal would kill it before it acts.
        wait_until(
            lambda: proc.poll() is not None or "watching" in log_path.read_text(),
            30,
            "the server's watchdog to start",
            describe=lambda: log_tail(log_path),
        )
        if proc.poll() is not None:
            raise RuntimeError(f"the server's watchdog exited: {log_tail(log_path)}")
        yield
    finally:
        # Killed before it acts: pytest-postgresql stops the server itself next.
        stop_process(proc, [])
        remove_tree(workdir)


def pg_ctl_status(server: Any) -> int:
    """``pg_ctl status``'s exit code (0: running, 3: not running)."""
    return subprocess.run(
        [str(server.executable), "status", "-D", str(server.datadir)],
        capture_output=True,
        timeout=60,
        check=False,
    ).returncode
