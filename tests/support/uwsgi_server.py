"""A real uWSGI in a subprocess: the example app under the project's ``uwsgi.ini``.

The counterpart of :class:`~support.gunicorn_server.GunicornServer` (same
methods, so a reliability stack can run on either). uWSGI loads the app once in
its master and forks the workers from it, and replaces a dead worker by forking
the master again, without running Python's at-fork hooks unless told to
(``py-call-osafterfork``, which the ini does not set): what the extension must
survive without those hooks.

The ``uwsgi`` command is pyuwsgi's (the dev extra), next to the interpreter that
runs the tests, so its embedded Python is the tests' own.
"""

from __future__ import annotations

import functools
import http.client
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from ._files import make_workdir
from ._procs import at_exit, free_port, spawn, tcp_answers
from .gunicorn_server import REPO_ROOT, TESTS_DIR, PreforkServer, child_pids
from .http_client import http_request
from .waiting import wait_until

#: The deployment file under test (docs/deployment.md shows it).
UWSGI_INI = REPO_ROOT / "uwsgi.ini"

# Inherited settings that would silently change what we start (uWSGI reads any
# UWSGI_<OPTION> variable as an option).
_STRIPPED_PREFIX = "UWSGI_"


def uwsgi_command() -> str | None:
    """The ``uwsgi`` installed beside this interpreter (pyuwsgi), else on PATH."""
    beside = Path(sys.executable).with_name("uwsgi")
    if beside.exists():
        return str(beside)
    return shutil.which("uwsgi")


class UwsgiServer(PreforkServer):
    """``uwsgi --ini uwsgi.ini`` serving HTTP on 127.0.0.1:<free port>, with
    ``workers`` processes of ``threads`` threads and its master."""

    name = "uwsgi"

    def __init__(
        self,
        *,
        env: Mapping[str, str] | None = None,
        workers: int = 2,
        threads: int = 4,
        ini: Path = UWSGI_INI,
        health_path: str = "/healthz",
        startup_timeout: float = 60.0,
        stop_timeout: float = 10.0,
        extra_args: Sequence[str] = (),
    ) -> None:
        command = uwsgi_command()
        if command is None:
            raise RuntimeError("no uwsgi command: pip install pyuwsgi (the dev extra has it)")
        self.command = command
        self.env = dict(env or {})
        self.workers = workers
        self.threads = threads
        self.ini = ini
        self.health_path = health_path
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self.extra_args = list(extra_args)
        self.port = free_port()
        self._root = make_workdir("uwsgi")
        self.log_path = self._root / "uwsgi.log"
        self._proc: subprocess.Popen[bytes] | None = None
        at_exit.add(self, self.close)

    def argv(self) -> list[str]:
        return [
            self.command,
            "--ini", str(self.ini),
            "--processes", str(self.workers),
            "--threads", str(self.threads),
            *self.extra_args,
        ]  # fmt: skip

    def _environ(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(_STRIPPED_PREFIX)}
        path = [str(REPO_ROOT), str(TESTS_DIR), env.get("PYTHONPATH", "")]
        env["PYTHONPATH"] = os.pathsep.join(p for p in path if p)
        env["PYTHONUNBUFFERED"] = "1"
        # The ini's own address gives way to this one (uWSGI's variable for the option).
        env["UWSGI_HTTP_SOCKET"] = f"{self.host}:{self.port}"
        env["PROMETHEUS_MULTIPROC_DIR"] = str(self._root / "metrics")
        return env | self.env

    def start(self) -> UwsgiServer:
        """Start uWSGI; return once every worker runs and ``health_path`` says 200."""
        if self.running:
            return self
        log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        # SIGINT is uWSGI's "stop now"; SIGTERM stops it gracefully (die-on-term).
        self._proc = spawn(
            self.argv(),
            log_path=self.log_path,
            env=self._environ(),
            cwd=REPO_ROOT,
            death_signal=signal.SIGINT,
        )
        try:
            wait_until(
                self._ready,
                self.startup_timeout,
                "uwsgi to answer",
                describe=functools.partial(self._tail, log_start),
            )
        except TimeoutError:
            self.stop()
            raise
        if self._proc.poll() is not None:
            code = self._proc.returncode
            self.stop()
            raise RuntimeError(f"uwsgi exited with {code}:\n{self._tail(log_start)}")
        return self

    def _ready(self) -> bool:
        if self._proc is None or self._proc.poll() is not None:
            return True
        if not tcp_answers(self.host, self.port):
            return False
        if len(child_pids(self._proc.pid)) < self.workers:
            return False
        try:
            return http_request("GET", self.url + self.health_path, timeout=2).status == 200
        except (OSError, http.client.HTTPException):
            return False

    def __repr__(self) -> str:
        return f"<UwsgiServer {self.ini.name} at {self.url}>"
