"""A real gunicorn in a subprocess, for tests about processes and crashes.

The Flask test client runs everything in one process and one thread; the
idempotency guarantees that matter most (two workers racing for one key, a
worker dying mid-request) only show up with real worker processes.
"""

from __future__ import annotations

import functools
import http.client
import os
import signal
import subprocess
import sys
import time
from collections.abc import Collection, Mapping, Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from ._files import make_workdir, remove_tree
from ._procs import (
    LOOPBACK,
    at_exit,
    free_port,
    log_tail,
    spawn,
    stop_process,
    tcp_answers,
)
from .http_client import http_request
from .lifecycle import StartsOnEnter
from .waiting import wait_until

TESTS_DIR = Path(__file__).resolve().parents[1]
REPO_ROOT = TESTS_DIR.parent

# Requested while waiting for a server without a health path: any answer shows
# that a worker has loaded the app.
PROBE_PATH = "/__gunicorn_server_probe__"

# Inherited settings that would silently change what we start.
_STRIPPED_ENV = ("GUNICORN_CMD_ARGS", "GUNICORN_BIND", "PORT", "WEB_CONCURRENCY")


def _has_control_socket() -> bool:
    """Whether this gunicorn (25.1+) opens a control socket by default.

    Its default path ($HOME/.gunicorn/gunicorn.ctl) is one per user, so
    servers running side by side would take it from each other.
    """
    try:
        major, minor = (int(part) for part in version("gunicorn").split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return False
    return (major, minor) >= (25, 1)


def child_pids(pid: int) -> list[int]:
    """Live (non-zombie) children of ``pid``, from /proc, else ``pgrep -P``."""
    proc = Path("/proc")
    if not (proc / "self" / "stat").exists():
        result = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
        return sorted(int(line) for line in result.stdout.split())
    children = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # exited while we looked
        # "pid (comm) state ppid ..."; comm may contain spaces and parentheses.
        state, ppid = stat.rpartition(")")[2].split()[:2]
        if int(ppid) == pid and state != "Z":
            children.append(int(entry.name))
    return sorted(children)


class PreforkServer(StartsOnEnter):
    """What a prefork server under test offers whatever it is (gunicorn, uWSGI):
    its URL and master, its log, its workers to kill and wait for, a stop. A
    subclass starts it and sets ``_proc``, ``port``, ``log_path``, ``_root``,
    ``workers`` and ``stop_timeout``."""

    name = "server"
    host = LOOPBACK
    port: int
    workers: int
    stop_timeout: float
    log_path: Path
    _root: Path
    _proc: subprocess.Popen[bytes] | None

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT`` (no trailing slash)."""
        return f"http://{self.host}:{self.port}"

    @property
    def master_pid(self) -> int:
        if self._proc is None or self._proc.poll() is not None:
            raise RuntimeError(f"{self.name} is not running")
        return self._proc.pid

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def log_text(self) -> str:
        """Everything the server and the app wrote so far."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def _tail(self, start: int = 0) -> str:
        return f"{self.name} log {self.log_path}:\n{log_tail(self.log_path, 80, start)}"

    def worker_pids(self) -> list[int]:
        """The master's current worker processes, sorted."""
        return child_pids(self.master_pid)

    def kill_worker(self, pid: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to one worker; the master then replaces it."""
        if pid not in self.worker_pids():
            raise ValueError(f"{pid} is not a worker of {self.name} {self.master_pid}")
        os.kill(pid, sig)

    def wait_for_workers(
        self, count: int | None = None, *, exclude: Collection[int] = (), timeout: float = 30.0
    ) -> list[int]:
        """Wait until ``count`` (default: all) workers run, none of them in ``exclude``.

        After ``kill_worker(pid)``, ``wait_for_workers(exclude=[pid])`` returns
        once the replacement is forked (it may still be loading the app).
        """
        wanted = self.workers if count is None else count
        deadline = time.monotonic() + timeout
        while True:
            pids = [pid for pid in self.worker_pids() if pid not in exclude]
            if len(pids) == wanted:
                return pids
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers {pids}, wanted {wanted}:\n{self._tail()}")
            time.sleep(0.02)

    def stop(self) -> None:
        """Graceful stop (TERM: workers finish their requests; uWSGI needs
        ``die-on-term``), then KILL."""
        proc, self._proc = self._proc, None
        if proc is not None:
            stop_process(proc, [(signal.SIGTERM, self.stop_timeout)])

    def close(self) -> None:
        """Stop the server and delete its log."""
        self.stop()
        at_exit.discard(self)
        remove_tree(self._root)


class GunicornServer(PreforkServer):
    """``python -m gunicorn`` serving ``wsgi_app`` on 127.0.0.1:<free port>.

    ``wsgi_app`` is anything gunicorn accepts: ``"wsgi:app"`` or a factory
    call such as ``"support.tiny_app:create_app()"``.  The process runs in
    the repository root with the repository and ``tests/`` on PYTHONPATH, so
    an app factory in a test module imports its helpers as the tests do.
    Without ``config`` no gunicorn.conf.py is read, not even the project's.
    """

    name = "gunicorn"

    def __init__(
        self,
        wsgi_app: str,
        *,
        env: Mapping[str, str] | None = None,
        workers: int = 1,
        worker_class: str = "sync",
        threads: int | None = None,
        config: str | Path | None = None,
        health_path: str | None = None,
        startup_timeout: float = 30.0,
        stop_timeout: float = 10.0,
        access_log: bool = False,
        extra_args: Sequence[str] = (),
        cwd: str | Path | None = None,
    ) -> None:
        self.wsgi_app = wsgi_app
        self.env = dict(env or {})
        self.workers = workers
        self.worker_class = worker_class
        self.threads = threads
        self.config = Path(config).resolve() if config is not None else None
        self.health_path = health_path
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self.access_log = access_log
        self.extra_args = list(extra_args)
        self.cwd = Path(cwd) if cwd is not None else REPO_ROOT
        self.port = free_port()
        self._root = make_workdir("gunicorn")
        self.log_path = self._root / "gunicorn.log"
        self._proc: subprocess.Popen[bytes] | None = None
        at_exit.add(self, self.close)

    def _argv(self) -> list[str]:
        config = self.config or self._root / "empty.gunicorn.conf.py"
        config.touch()
        argv = [
            sys.executable, "-m", "gunicorn",
            "--config", str(config),
            "--bind", f"{self.host}:{self.port}",
            "--workers", str(self.workers),
            "--worker-class", self.worker_class,
            "--error-logfile", "-",
        ]  # fmt: skip
        if _has_control_socket():
            argv.append("--no-control-socket")
        if self.threads is not None:
            argv += ["--threads", str(self.threads)]
        if self.access_log:
            argv += ["--access-logfile", "-"]
        return [*argv, *self.extra_args, self.wsgi_app]

    def _environ(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in _STRIPPED_ENV}
        path = [str(REPO_ROOT), str(TESTS_DIR), env.get("PYTHONPATH", "")]
        env["PYTHONPATH"] = os.pathsep.join(p for p in path if p)
        env["PYTHONUNBUFFERED"] = "1"  # app prints reach the log before a crash
        env["GUNICORN_BIND"] = f"{self.host}:{self.port}"  # for a config that reads it
        return env | self.env

    def start(self) -> GunicornServer:
        """Start gunicorn; return once it serves (and ``health_path`` says 200)."""
        if self.running:
            return self
        for attempt in range(3):
            log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
            proc = self._proc = spawn(
                self._argv(), log_path=self.log_path, env=self._environ(), cwd=self.cwd
            )
            try:
                wait_until(
                    self._ready,
                    self.startup_timeout,
                    "gunicorn to answer",
                    describe=functools.partial(self._tail, log_start),
                )
            except TimeoutError:
                self.stop()
                raise
            if proc.poll() is None:
                return self
            self.stop()
            log = self._tail(log_start)
            if "Connection in use" in log and attempt < 2:
                self.port = free_port()
                continue
            raise RuntimeError(f"gunicorn exited with {proc.returncode}:\n{log}")
        raise AssertionError("unreachable")

    def _ready(self) -> bool:
        """True once a worker answers HTTP, or once the master died (the caller checks).

        The master listens before any worker has imported the app, so an open
        port proves little; an HTTP answer means a worker loaded the app.
        Without ``health_path`` any status will do (a 404 for the probe path).
        """
        if self._proc is None or self._proc.poll() is not None:
            return True
        if not tcp_answers(self.host, self.port):
            return False
        if len(child_pids(self._proc.pid)) < self.workers:
            return False
        path = self.health_path or PROBE_PATH
        try:
            status = http_request("GET", self.url + path, timeout=2).status
        except (OSError, http.client.HTTPException):
            return False
        return status == 200 or self.health_path is None

    def __repr__(self) -> str:
        return f"<GunicornServer {self.wsgi_app} at {self.url}>"
