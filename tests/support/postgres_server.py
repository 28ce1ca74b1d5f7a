"""A throwaway PostgreSQL server for a machine that has none.

The binaries come from pgserver's wheel (see postgres_install.py), but we
start ``postgres`` ourselves instead of through pgserver's
``PostgresServer``: that class listens on a Unix socket only, creates a
system account when run as root, and stops its server from an atexit hook,
while outage tests need a TCP port they can rely on and a stop/start they
control.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import Literal

from ._files import chown_tree, make_workdir, remove_tree, unprivileged_user, world_accessible
from ._procs import LOOPBACK, at_exit, free_port, log_tail, spawn, stop_process
from .lifecycle import StartsOnEnter
from .postgres_install import find_bindir, server_env, template_cluster, usable_bindir
from .waiting import wait_until

# Settings for every throwaway server.  Only what a throwaway server needs to
# differ from a production one: TCP on loopback only, no Unix socket (its path
# would be one more thing that can be too long or unwritable).  fsync and
# synchronous_commit keep their durable defaults, so that a test killing the
# server sees the same crash recovery a production database would.
BASE_SETTINGS = {
    "listen_addresses": LOOPBACK,
    "unix_socket_directories": "",
    "logging_collector": "off",
}

StopMode = Literal["fast", "immediate"]


class ThrowawayPostgres(StartsOnEnter):
    """A private PostgreSQL server on 127.0.0.1, trust auth, user ``postgres``.

    ``start()`` creates the cluster on first use; ``stop()`` and ``start()``
    keep the data and the port, so an outage test can take the database away
    and bring the same one back.  ``close()`` (or leaving the ``with`` block)
    stops it and deletes its files.
    """

    host = LOOPBACK
    #: postmaster.pid states in which the server takes connections (a hot
    #: standby says "standby").
    ready_states: tuple[str, ...] = ("ready",)

    def __init__(
        self,
        *,
        settings: dict[str, str] | None = None,
        bindir: str | Path | None = None,
        startup_timeout: float = 30.0,
    ) -> None:
        self.settings = BASE_SETTINGS | (settings or {})
        self._bindir = Path(bindir) if bindir is not None else None
        self.startup_timeout = startup_timeout
        self.port = free_port()
        self._run_as = unprivileged_user()
        self._root: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._ever_started = False

    @property
    def dsn(self) -> str:
        """``postgresql://postgres@127.0.0.1:PORT/postgres``."""
        return self.dsn_for("postgres")

    def dsn_for(self, dbname: str) -> str:
        """The URL of another database on this server."""
        return f"postgresql://postgres@{self.host}:{self.port}/{dbname}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        """The postmaster's pid while running."""
        return self._proc.pid if self._proc is not None and self.running else None

    @property
    def bindir(self) -> Path:
        """The PostgreSQL binaries this server runs (known once it has started)."""
        if self._bindir is None:
            raise RuntimeError("the server has not been started yet")
        return self._bindir

    @property
    def datadir(self) -> Path:
        return self._workdir() / "data"

    @property
    def log_path(self) -> Path:
        return self._workdir() / "postgres.log"

    def _workdir(self) -> Path:
        if self._root is None:
            raise RuntimeError("the server has not been started yet")
        return self._root

    def start(self) -> ThrowawayPostgres:
        """Start the server and wait until it accepts connections."""
        if self.running:
            return self
        if self._root is None:
            self._create_cluster()
        # A port taken between free_port() and postgres binding it: retry with
        # another, but only before anyone has been given our DSN.
        for attempt in range(1 if self._ever_started else 3):
            log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
            try:
                self._launch(log_start)
                break
            except _PortTaken as taken:
                if self._ever_started:
                    message = f"port {self.port} was taken while stopped: {taken}"
                    raise RuntimeError(message) from None
                if attempt == 2:
                    raise
                self.port = free_port()
        self._ever_started = True
        return self

    def _create_cluster(self) -> None:
        if self._run_as is not None and not world_accessible(Path(tempfile.gettempdir())):
            raise RuntimeError(
                f"{tempfile.gettempdir()} is not reachable for user {self._run_as.name}; "
                "point TMPDIR at a directory others may traverse"
            )
        bindir = self._bindir or find_bindir()
        self._bindir = bindir = usable_bindir(bindir, self._run_as)
        root = make_workdir("pg")
        self._root = root
        at_exit.add(self, self.close)
        self._make_data_dir(bindir, root / "data")
        chown_tree(root, self._run_as)

    def _make_data_dir(self, bindir: Path, data: Path) -> None:
        """Fill the new server's data directory: a copy of the run's template cluster.

        A subclass may make it another way (a standby from a base backup of its
        primary, see pg_topology.py); ``_create_cluster`` hands it to the server's
        account afterwards.
        """
        shutil.copytree(template_cluster(bindir, self._run_as), data, symlinks=True)

    def _launch(self, log_start: int) -> None:
        assert self._bindir is not None
        argv = [str(self._bindir / "postgres"), "-D", str(self.datadir), "-p", str(self.port)]
        for name, value in self.settings.items():
            argv += ["-c", f"{name}={value}"]
        proc = self._proc = spawn(
            argv,
            log_path=self.log_path,
            env=server_env(),
            cwd=self._root,
            death_signal=signal.SIGQUIT,  # immediate shutdown: cleans up shared memory
            run_as=self._run_as,
        )

        def ready() -> bool:
            if proc.poll() is not None:
                return True
            return self._postmaster_status(proc.pid) in self.ready_states

        try:
            wait_until(
                ready,
                self.startup_timeout,
                "PostgreSQL to accept connections",
                describe=lambda: self._tail(log_start),
            )
        except TimeoutError:
            self.stop("immediate")
            raise
        if proc.poll() is not None:
            self._proc = None
            proc.wait()
            log = self._tail(log_start)
            if "could not create any TCP/IP sockets" in log or "already in use" in log:
                raise _PortTaken(log)
            raise RuntimeError(f"postgres exited with {proc.returncode}:\n{log}")

    def _postmaster_status(self, pid: int) -> str | None:
        """The status line of postmaster.pid, if it belongs to ``pid``.

        A stale file from an immediate stop can still say "ready", hence the
        pid check.
        """
        try:
            lines = (self.datadir / "postmaster.pid").read_text().splitlines()
        except OSError:
            return None
        if len(lines) < 8 or lines[0].strip() != str(pid):
            return None
        return lines[7].strip()

    def _tail(self, start: int = 0) -> str:
        return f"postgres log {self.log_path}:\n{log_tail(self.log_path, start=start)}"

    def stop(self, mode: StopMode = "fast") -> None:
        """Stop the server; the data stays for the next ``start()``.

        ``fast`` (SIGINT) rolls back open transactions, disconnects clients
        and checkpoints, like ``pg_ctl stop``.  ``immediate`` (SIGQUIT) is
        the closest to a crash that still releases shared memory: the next
        start runs crash recovery.
        """
        proc, self._proc = self._proc, None
        if proc is None:
            return
        steps = [(signal.SIGINT, 30.0)] if mode == "fast" else []
        stop_process(proc, [*steps, (signal.SIGQUIT, 10.0)])

    def restart(self, mode: StopMode = "fast") -> ThrowawayPostgres:
        self.stop(mode)
        return self.start()

    def close(self) -> None:
        """Stop the server and delete its files."""
        self.stop("immediate")
        at_exit.discard(self)
        if self._root is not None:
            remove_tree(self._root)
            self._root = None

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<ThrowawayPostgres {self.dsn} {state}>"


class _PortTaken(RuntimeError):
    """postgres could not bind its port."""
