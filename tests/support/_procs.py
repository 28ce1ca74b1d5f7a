"""Process plumbing shared by every throwaway server the tests start.

All servers go through :func:`spawn` so that they share the same guarantees:

* the server's output goes to a log file that a failing test can show;
* it runs in its own session, so a Ctrl-C aimed at pytest does not also hit
  the server half-way through a test, and a stop can sweep its whole process
  group (gunicorn workers, PostgreSQL backends);
* on Linux it is tied to the test process with ``PR_SET_PDEATHSIG``, so a
  test run killed with SIGKILL (a CI timeout, a second Ctrl-C) does not leave
  orphaned servers behind;
* it can be started as an unprivileged user, which PostgreSQL insists on
  when the tests run as root (containers, CI images).
"""

from __future__ import annotations

import atexit
import os
import random
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from ._files import RunAs

LOOPBACK = "127.0.0.1"

# Runs between fork and the server's exec.  Credentials are dropped here rather
# than with Popen(user=...) for two reasons: the kernel clears the death signal
# whenever credentials change, so prctl must come after the change; and the
# interpreter is already loaded when we drop root, so it does not matter that
# the unprivileged user may be unable to read the interpreter's files
# (a pyenv Python under /root, for instance).
_EXEC_SHIM = """\
import ctypes, os, sys
parent, death_signal, uid, gid = (int(arg) for arg in sys.argv[1:5])
if uid >= 0:
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
ctypes.CDLL(None, use_errno=True).prctl(1, death_signal, 0, 0, 0)  # PR_SET_PDEATHSIG
if os.getppid() != parent:
    sys.exit(0)  # the test process died before prctl took effect
os.execv(sys.argv[5], sys.argv[5:])
"""


def _ephemeral_range_start() -> int:
    try:
        text = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text()
        return int(text.split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_port_random = random.Random(os.urandom(16))  # private: hypothesis reseeds the global one


def free_port(host: str = LOOPBACK, *, also_free_at: int = 0) -> int:
    """A TCP port that is free now, preferably below the ephemeral range.

    The kernel hands out ephemeral ports to outgoing connections and to
    ``bind(0)``.  A server that outage tests stop and start again must get
    its port back, so we avoid that range: while PostgreSQL is stopped no
    client socket can be given its port.  ``also_free_at``: an offset whose
    port must be free too, and below that range as well (a Redis Cluster
    node also listens on its port + 10000, its cluster bus).  Falls back to
    ``bind(0)``.
    """
    high = _ephemeral_range_start() - also_free_at
    low = 10000
    for _ in range(50 if high - low > 1000 else 0):
        port = _port_random.randrange(low, high)
        if all(_bindable(host, p) for p in {port, port + also_free_at}):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        any_port: int = probe.getsockname()[1]
        return any_port


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
        return True


def spawn(
    argv: Sequence[str],
    *,
    log_path: Path,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
    death_signal: int = signal.SIGTERM,
    run_as: RunAs | None = None,
) -> subprocess.Popen[bytes]:
    """Start a server process with its output appended to ``log_path``.

    ``death_signal`` is what the server gets if the thread that called us
    dies first; pick the server's own "shut down now" signal.  Start servers
    from the main thread (fixtures do), not from a short-lived helper thread.
    """
    command = list(argv)
    user: int | None = None
    group: int | None = None
    extra_groups: list[int] | None = None
    if sys.platform.startswith("linux"):
        uid, gid = (run_as.uid, run_as.gid) if run_as else (-1, -1)
        command = [
            sys.executable, "-I", "-S", "-c", _EXEC_SHIM,
            str(os.getpid()), str(int(death_signal)), str(uid), str(gid), *command,
        ]  # fmt: skip
    elif run_as is not None:
        user, group, extra_groups = run_as.uid, run_as.gid, []
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            start_new_session=True,
            user=user,
            group=group,
            extra_groups=extra_groups,
        )


def stop_process(proc: subprocess.Popen[bytes], steps: Sequence[tuple[int, float]]) -> int | None:
    """Send each (signal, grace seconds) in turn until the process exits.

    Ends with SIGKILL to the whole process group, which also sweeps up any
    child left behind, and always reaps the process so no ResourceWarning
    ("subprocess is still running") reaches the test.
    """
    for sig, grace in steps:
        if proc.poll() is not None:
            break
        try:
            proc.send_signal(sig)
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            continue
        except ProcessLookupError:
            break
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    return proc.wait()


def log_tail(path: Path, max_lines: int = 60, start: int = 0) -> str:
    """The end of a server log (from byte ``start``), for error messages."""
    try:
        with open(path, "rb") as log:
            log.seek(start)
            text = log.read().decode("utf-8", "replace")
    except OSError as exc:
        return f"<no log: {exc}>"
    return "\n".join(text.splitlines()[-max_lines:])


def tcp_answers(host: str, port: int, timeout: float = 0.5) -> bool:
    """Whether something accepts TCP connections at host:port."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


class ExitCleanup:
    """Runs registered cleanups at interpreter exit, newest first.

    Fixtures close their servers themselves; this is the safety net for a
    server started outside a fixture, or a session that ends on an error.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._callbacks: dict[int, Callable[[], None]] = {}
        atexit.register(self.run)

    def add(self, owner: object, callback: Callable[[], None]) -> None:
        with self._lock:
            self._callbacks[id(owner)] = callback

    def discard(self, owner: object) -> None:
        with self._lock:
            self._callbacks.pop(id(owner), None)

    def run(self) -> None:
        with self._lock:
            callbacks = list(self._callbacks.values())[::-1]
            self._callbacks.clear()
        for callback in callbacks:
            try:
                callback()
            except Exception as exc:  # best effort: the interpreter is exiting
                print(f"cleanup at exit failed: {exc!r}", file=sys.stderr)


at_exit = ExitCleanup()
