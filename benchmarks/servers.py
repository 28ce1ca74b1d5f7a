"""The benchmark's servers: one gunicorn per subject, and the services they use.

Shared by the full run (``python -m benchmarks``) and the two-tree comparison
(``python -m benchmarks.ab``), so that both measure identically configured
servers.
"""

from __future__ import annotations

import http.client
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from types import TracebackType

import psycopg2
import redis

from . import app as bench_app
from .app import CHARGES_PATH, HEALTH_PATH, REQUEST_BODY

REPO_ROOT = Path(__file__).resolve().parents[1]

#: gunicorn shape, the same for every subject. gthread keeps client connections
#: alive (sync workers close each one, and a benchmark would then measure TCP
#: set-up); two processes use both cores, four threads per process overlap
#: each request's waits on PostgreSQL. Measured on this machine: 2 x 4 gave the
#: highest bare throughput of 2 x 2, 2 x 4, 2 x 8, 3 x 4 and 4 sync workers.
WORKERS = 2
THREADS = 4
WORKER_CLASS = "gthread"

#: Log lines worth reporting: the extension's warnings (a failing Redis call, a
#: PostgreSQL error) all start with "idempotency:" and reach the log through
#: logging's last-resort handler; gunicorn tags worker timeouts and crashes.
_LOG_FLAGS = ("idempotency:", "Traceback", "[WARNING]", "[ERROR]", "[CRITICAL]")


class Server:
    """One subject's gunicorn, on a free loopback port, in its own session.

    ``root`` is the code tree it runs (``benchmarks.ab`` runs a second one from
    a git worktree); it goes first on the server's ``PYTHONPATH``, ahead of the
    editable install of the working tree. ``label`` names its log when two
    servers run the same subject.
    """

    def __init__(
        self,
        subject: str,
        env: dict[str, str],
        workdir: Path,
        workers: int,
        threads: int,
        *,
        root: Path = REPO_ROOT,
        label: str | None = None,
    ) -> None:
        self.subject = subject
        self.env = {
            **env,
            "PYTHONPATH": os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH")) if p),
        }
        self.workers = workers
        self.threads = threads
        self.root = root
        self.log_path = workdir / f"gunicorn-{slug(label or subject)}.log"
        self.config_path = workdir / "empty.gunicorn.conf.py"
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise RuntimeError(f"gunicorn for {self.subject} is not running")
        return self._proc.pid

    def start(self, timeout: float = 30.0) -> None:
        # An empty config file: without --config gunicorn would read the
        # project's gunicorn.conf.py, and the subjects must differ in nothing else.
        self.config_path.touch()
        for _attempt in range(3):
            self.port = free_port()
            argv = [
                sys.executable, "-m", "gunicorn",
                "--config", str(self.config_path),
                "--bind", f"127.0.0.1:{self.port}",
                "--workers", str(self.workers),
                "--worker-class", WORKER_CLASS,
                "--threads", str(self.threads),
                "--log-level", "warning",
                "--error-logfile", "-",
            ]  # fmt: skip
            if _gunicorn_has_control_socket():
                argv.append("--no-control-socket")
            argv.append(f"benchmarks.app:create_app({self.subject!r})")
            with self.log_path.open("ab") as log_file:
                self._proc = subprocess.Popen(
                    argv,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    env=self.env,
                    cwd=self.root,
                    start_new_session=True,
                )
            if self._wait_ready(timeout):
                return
            self.stop()
            if "Connection in use" not in self.log_path.read_text(errors="replace"):
                break
        raise RuntimeError(f"gunicorn for {self.subject} did not start; see {self.log_path}")

    def _wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc is None or self._proc.poll() is not None:
                return False
            # Closed whatever happens: a probe that timed out while the server started
            # left its socket to the garbage collector (a ResourceWarning in the tests).
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
            try:
                conn.request("GET", HEALTH_PATH)
                if conn.getresponse().status == 200:
                    return True
            except OSError:
                pass
            finally:
                conn.close()
            time.sleep(0.1)
        return False

    def log_note(self) -> str | None:
        """A line for the report if the server logged warnings or errors (a Redis
        timeout, a 503) during the run: figures from such a run need a second look."""
        if not self.log_path.exists():
            return None
        lines = self.log_path.read_text(errors="replace").splitlines()
        flagged = [line for line in lines if any(w in line for w in _LOG_FLAGS)]
        if not flagged:
            return None
        return f"{self.subject}: {len(flagged)} warning/error log lines, first: {flagged[0][:200]}"

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


class Servers:
    """Servers started together and stopped together however the run ends."""

    def __init__(self, servers: Sequence[Server]) -> None:
        self.servers = list(servers)
        #: (The full run has one server per subject.)
        self.by_subject = {s.subject: s for s in servers}

    def __enter__(self) -> Servers:
        try:
            for server in self.servers:
                server.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def stop(self) -> None:
        for server in self.servers:
            server.stop()


def server_env(database_url: str, redis_url: str) -> dict[str, str]:
    """The servers' environment: this one's, without gunicorn settings (the
    subjects must differ in nothing), and the benchmark's servers."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GUNICORN")}
    env["BENCH_DATABASE_URL"] = database_url
    env["BENCH_REDIS_URL"] = redis_url
    return env


def free_port() -> int:
    """A loopback TCP port nobody listens on now (for a server about to start)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _gunicorn_has_control_socket() -> bool:
    """gunicorn 25.1+ opens a per-user control socket by default; several
    servers side by side would take it from each other."""
    try:
        major, minor = (int(part) for part in version("gunicorn").split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return False
    return (major, minor) >= (25, 1)


def slug(subject: str) -> str:
    return subject.replace("+", "-")


def check_services(dsn: str, redis_url: str | None) -> None:
    try:
        # Probes the server, and creates the bench database on a fresh machine.
        bench_app.create_database_if_missing(dsn, connect_timeout=3)
    except psycopg2.Error as exc:
        raise SystemExit(f"PostgreSQL at {dsn} is not usable: {exc}".strip()) from exc
    if redis_url is not None:
        client: redis.Redis[bytes] = redis.Redis.from_url(redis_url, socket_timeout=3)
        try:
            client.ping()
        except redis.RedisError as exc:
            raise SystemExit(f"Redis at {redis_url} is not usable: {exc}") from exc
        finally:
            client.close()


def flush_bench_redis(redis_url: str) -> None:
    """Drop the benchmark's cache entries (only those: the prefix is ours)."""
    client: redis.Redis[bytes] = redis.Redis.from_url(redis_url, socket_timeout=3)
    try:
        keys = list(client.scan_iter(match=f"{bench_app.REDIS_PREFIX}:*", count=1000))
        for start in range(0, len(keys), 1000):
            client.delete(*keys[start : start + 1000])
    finally:
        client.close()


def precomplete(url: str, keys: Sequence[str]) -> None:
    """Send each key once, so that the replay path finds it completed (and,
    with the Redis subject, cached: the completion puts it there)."""
    port = int(url.rsplit(":", 1)[1])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    headers = {"Content-Type": "application/json", "Idempotency-Key": ""}
    try:
        for key in keys:
            headers["Idempotency-Key"] = key
            conn.request("POST", CHARGES_PATH, REQUEST_BODY, headers)
            response = conn.getresponse()
            response.read()
            if response.status != 201:
                raise RuntimeError(f"pre-completing {key} at {url}: HTTP {response.status}")
            if response.will_close:
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    finally:
        conn.close()
