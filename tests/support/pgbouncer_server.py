"""A throwaway PgBouncer in transaction-pooling mode, in front of a PostgreSQL we name.

The binary is Debian's ``pgbouncer`` package (``.ci/run`` installs it when it
can); :func:`find_pgbouncer` says why it is missing otherwise, and the tests
skip with that reason. PgBouncer refuses to run as root, so as root it runs as
the same unprivileged account as the throwaway PostgreSQL servers.

The configuration is the one the deployment guide's PgBouncer section asks
for: ``pool_mode = transaction``, and nothing that depends on session state
(the extension sends ``SET LOCAL`` only, inside the round trip it concerns,
and prepares nothing).
"""

from __future__ import annotations

import shutil
import signal
import subprocess
from pathlib import Path
from urllib.parse import unquote, urlsplit

import psycopg2

from ._files import chown_tree, make_workdir, remove_tree, unprivileged_user
from ._procs import LOOPBACK, at_exit, free_port, log_tail, spawn, stop_process
from .lifecycle import StartsOnEnter
from .waiting import wait_until

#: Where Debian puts the binary, outside a non-root user's PATH.
_SBIN = (Path("/usr/sbin/pgbouncer"), Path("/usr/local/sbin/pgbouncer"))


def find_pgbouncer() -> Path | None:
    """The ``pgbouncer`` binary, or None (``apt-get install pgbouncer`` provides it)."""
    found = shutil.which("pgbouncer")
    if found is not None:
        return Path(found)
    for path in _SBIN:
        if path.exists():
            return path
    return None


class ThrowawayPgBouncer(StartsOnEnter):
    """PgBouncer on 127.0.0.1:<free port> forwarding every database name to the
    PostgreSQL server that ``server_url`` names, with that URL's user and password.

    ``url_for(dbname)`` is what the application connects to. ``pool_size`` is the
    number of server connections per database and user (``default_pool_size``):
    clients beyond it wait for a server connection to come free.
    """

    host = LOOPBACK

    def __init__(
        self,
        server_url: str,
        *,
        pool_mode: str = "transaction",
        pool_size: int = 20,
        max_client_conn: int = 500,
        extra_settings: dict[str, str] | None = None,
        startup_timeout: float = 15.0,
    ) -> None:
        binary = find_pgbouncer()
        if binary is None:
            raise RuntimeError("no pgbouncer binary (apt-get install pgbouncer)")
        self._binary = binary
        parts = urlsplit(server_url)
        self.user = unquote(parts.username or "postgres")
        self._password = unquote(parts.password) if parts.password else None
        self._target = (parts.hostname or LOOPBACK, parts.port or 5432)
        self.pool_mode = pool_mode
        self.pool_size = pool_size
        self.max_client_conn = max_client_conn
        self.extra_settings = dict(extra_settings or {})
        self.startup_timeout = startup_timeout
        self.port = free_port()
        self._run_as = unprivileged_user()
        self._root: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    def url_for(self, dbname: str) -> str:
        """``postgresql://user[:password]@127.0.0.1:PORT/dbname``: through the bouncer."""
        secret = f":{self._password}" if self._password else ""
        return f"postgresql://{self.user}{secret}@{self.host}:{self.port}/{dbname}"

    @property
    def admin_url(self) -> str:
        """The admin console (``SHOW POOLS``, ``SHOW STATS``); needs autocommit."""
        return self.url_for("pgbouncer")

    @property
    def log_path(self) -> Path:
        if self._root is None:
            raise RuntimeError("pgbouncer has not been started yet")
        return self._root / "pgbouncer.log"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def config_text(self) -> str:
        host, port = self._target
        password = f" password={self._password}" if self._password else ""
        settings = {
            "listen_addr": self.host,
            "listen_port": str(self.port),
            "unix_socket_dir": "",
            "auth_type": "trust",
            "auth_file": str(self._workdir() / "userlist.txt"),
            "admin_users": self.user,
            "stats_users": self.user,
            "pool_mode": self.pool_mode,
            "default_pool_size": str(self.pool_size),
            "max_client_conn": str(self.max_client_conn),
            # A client waiting longer than this for a server connection gets an error;
            # the extension's own deadline (statement timeout + 1 s) is shorter anyway.
            "query_wait_timeout": "30",
            "logfile": "",
            "pidfile": "",
            "log_connections": "0",
            "log_disconnections": "0",
            **self.extra_settings,
        }
        lines = ["[databases]", f"* = host={host} port={port} user={self.user}{password}", ""]
        lines += ["[pgbouncer]", *(f"{name} = {value}" for name, value in settings.items())]
        return "\n".join(lines) + "\n"

    def _workdir(self) -> Path:
        if self._root is None:
            raise RuntimeError("pgbouncer has not been started yet")
        return self._root

    def start(self) -> ThrowawayPgBouncer:
        if self.running:
            return self
        if self._root is None:
            self._root = make_workdir("pgbouncer")
            at_exit.add(self, self.close)
        root = self._root
        (root / "userlist.txt").write_text(f'"{self.user}" "{self._password or ""}"\n')
        (root / "pgbouncer.ini").write_text(self.config_text())
        (root / "pgbouncer.ini").chmod(0o600)
        chown_tree(root, self._run_as)
        log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        proc = self._proc = spawn(
            [str(self._binary), str(root / "pgbouncer.ini")],
            log_path=self.log_path,
            cwd=root,
            death_signal=signal.SIGINT,
            run_as=self._run_as,
        )
        try:
            wait_until(
                lambda: proc.poll() is not None or self._answers(),
                self.startup_timeout,
                "PgBouncer to answer",
                describe=lambda: log_tail(self.log_path, start=log_start),
            )
        except TimeoutError:
            self.stop()
            raise
        if proc.poll() is not None:
            self._proc = None
            raise RuntimeError(
                f"pgbouncer exited with {proc.returncode}:\n{log_tail(self.log_path)}"
            )
        return self

    def _answers(self) -> bool:
        try:
            conn = psycopg2.connect(self.admin_url, connect_timeout=2)
        except psycopg2.Error:
            return False
        conn.close()
        return True

    def show(self, what: str) -> list[dict[str, object]]:
        """``SHOW <what>`` on the admin console, as dicts (``show("STATS")``)."""
        conn = psycopg2.connect(self.admin_url, connect_timeout=5)
        conn.autocommit = True
        try:
            with conn.cursor() as cur:
                cur.execute(f"SHOW {what}")
                names = [column.name for column in cur.description or ()]
                return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]
        finally:
            conn.close()

    def stop(self) -> None:
        """SIGINT: PgBouncer's "safe shutdown" (waits for transactions), then KILL."""
        proc, self._proc = self._proc, None
        if proc is not None:
            stop_process(proc, [(signal.SIGINT, 5.0)])

    def close(self) -> None:
        self.stop()
        at_exit.discard(self)
        if self._root is not None:
            remove_tree(self._root)
            self._root = None

    def __repr__(self) -> str:
        return f"<ThrowawayPgBouncer {self.host}:{self.port} {self.pool_mode}>"
