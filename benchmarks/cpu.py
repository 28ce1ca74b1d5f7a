"""CPU time per request, by process: the app's workers, PostgreSQL, Redis.

Throughput on a shared two-core machine drifts with whatever else runs, but
the CPU a request costs each process barely does: it is counted from
``/proc/<pid>/stat`` for the processes serving this subject only, so another
job's burst changes how long a cell takes, not how many microseconds each
request burned. On two cores, saturation throughput is roughly 2 s divided by
the sum of these figures (plus the load generator's), which makes them the
clearest account of where a subject's extra cost goes.

PostgreSQL backends are attributed by ``application_name`` (each subject
labels its sessions, see ``benchmarks.app.application_name``), or, when two
servers run the same subject (``benchmarks.ab``), by which process holds the
client end of each backend's socket. Linux only; on other systems every
figure is ``None``.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import psycopg2
import redis

_PROC = Path("/proc")
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclasses.dataclass(frozen=True)
class CpuSample:
    """Cumulative CPU seconds of each group of processes at one instant."""

    app: float
    postgres: float
    redis: float


def available() -> bool:
    return (_PROC / "self" / "stat").exists()


def _cpu_seconds(pid: int) -> float:
    """utime + stime of one process; 0 for a process that has gone."""
    try:
        stat = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return 0.0
    # "pid (comm) state ppid ... utime stime ..." - comm may hold spaces and parentheses.
    fields = stat.rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def _tree(root: int) -> list[int]:
    """``root`` and its live children (gunicorn's master and workers)."""
    pids = [root]
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[1]) == root:
            pids.append(int(entry.name))
    return pids


def _socket_inodes(pids: list[int]) -> set[int]:
    """Inodes of the sockets the processes hold open."""
    inodes: set[int] = set()
    for pid in pids:
        try:
            fds = list((_PROC / str(pid) / "fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    return inodes


def client_ports(pids: list[int]) -> set[int]:
    """Local TCP ports of the sockets the processes hold: a PostgreSQL backend
    serves one of them when its ``client_port`` is among these."""
    inodes = _socket_inodes(pids)
    ports: set[int] = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = (_PROC / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and int(fields[9]) in inodes:
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


class CpuMeter:
    """Samples the CPU of one subject's gunicorn, its PostgreSQL backends and Redis."""

    def __init__(self, dsn: str, redis_url: str | None) -> None:
        self._monitor = psycopg2.connect(dsn, application_name="bench-monitor")
        self._monitor.autocommit = True
        self._redis_pid: int | None = None
        if redis_url is not None:
            client: redis.Redis[bytes] = redis.Redis.from_url(redis_url, socket_timeout=3)
            try:
                self._redis_pid = int(client.info("server")["process_id"])
            finally:
                client.close()

    def _backends(self, application_name: str) -> list[int]:
        with self._monitor.cursor() as cur:
            cur.execute(
                "SELECT pid FROM pg_stat_activity WHERE application_name = %s",
                (application_name,),
            )
            return [int(row[0]) for row in cur.fetchall()]

    def _backends_of(self, pids: list[int]) -> list[int]:
        """Backends whose client socket one of ``pids`` holds."""
        ports = client_ports(pids)
        with self._monitor.cursor() as cur:
            cur.execute("SELECT pid, client_port FROM pg_stat_activity WHERE client_port > 0")
            return [int(pid) for pid, port in cur.fetchall() if port in ports]

    def start(self, gunicorn_pid: int, application_name: str | None) -> dict[str, dict[int, float]]:
        """Per-process CPU now, by group and pid: a backend that appears mid-cell
        is then counted from zero, and one that has gone is not subtracted.
        Without ``application_name`` the backends are found by socket."""
        return self._read(gunicorn_pid, application_name)

    def _read(self, gunicorn_pid: int, application_name: str | None) -> dict[str, dict[int, float]]:
        app = _tree(gunicorn_pid)
        groups = {
            "app": app,
            "postgres": (
                self._backends(application_name)
                if application_name is not None
                else self._backends_of(app)
            ),
            "redis": [self._redis_pid] if self._redis_pid is not None else [],
        }
        return {name: {pid: _cpu_seconds(pid) for pid in pids} for name, pids in groups.items()}

    def delta(
        self,
        before: dict[str, dict[int, float]],
        gunicorn_pid: int,
        application_name: str | None,
    ) -> CpuSample:
        """CPU seconds used since ``before`` by each group."""
        after = self._read(gunicorn_pid, application_name)
        used = {
            name: sum(max(0.0, now - before[name].get(pid, 0.0)) for pid, now in pids.items())
            for name, pids in after.items()
        }
        return CpuSample(app=used["app"], postgres=used["postgres"], redis=used["redis"])

    def close(self) -> None:
        self._monitor.close()
