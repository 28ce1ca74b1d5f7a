"""An embedded PostgreSQL in the instance folder, for when ``DATABASE_URL`` is unset.

So that ``gunicorn wsgi:app`` works on a laptop with nothing else installed.
Under gunicorn.conf.py the master starts it before forking any worker, hands
its URL to the workers as ``DATABASE_URL`` and stops it when it exits, if it
started it (see ``on_starting`` and ``on_exit`` there). Elsewhere (``flask``
commands, an app created in-process) the app starts or joins it itself.
pgserver serialises start-up with an inter-process lock, so processes starting
together share one server. It is never stopped by a process merely exiting
(``cleanup_mode=None``): a worker that is killed or recycled must not take the
database away from the others. Stop it with :func:`stop_embedded_postgres` (or
``pg_ctl -D <instance>/pgdata stop``).

This module imports nothing of the app, so gunicorn's master can load it alone.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import warnings
from pathlib import Path

log = logging.getLogger(__name__)

PGDATA_DIR = "pgdata"


def embedded_database_url(instance_path: str) -> str:
    """Start (or join) the instance folder's PostgreSQL and return its URL."""
    os.makedirs(instance_path, exist_ok=True)
    pgdata = Path(instance_path) / PGDATA_DIR
    with warnings.catch_warnings():
        # pgserver keeps its start-up lock in the user's runtime directory; without
        # XDG_RUNTIME_DIR (root in a container) platformdirs warns and uses /tmp,
        # which is fine for a lock. Imported late: only this mode needs the extra.
        warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR")
        from pgserver.postgres_server import get_server

        server = get_server(pgdata, cleanup_mode=None)
    url: str = server.get_uri()
    log.info("DATABASE_URL is unset: using the embedded PostgreSQL in %s", pgdata)
    return url


def embedded_postgres_pid(instance_path: str) -> int | None:
    """The pid of the instance folder's PostgreSQL while it runs, else ``None``."""
    pid_file = Path(instance_path) / PGDATA_DIR / "postmaster.pid"
    try:
        pid = int(pid_file.read_text().split("\n", 1)[0])
    except (OSError, ValueError):
        return None
    return pid if _alive(pid) else None


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs: exists and is not a zombie (the postmaster is not our
    child, and a container's init may be slow to reap it, or never do)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # no /proc (macOS): trust kill(); with /proc, it exited meanwhile
        return not Path("/proc/self").exists()
    return stat.rpartition(")")[2].split()[0] != "Z"


def stop_embedded_postgres(instance_path: str, wait: float = 0.0) -> bool:
    """Ask the instance folder's PostgreSQL to shut down (fast mode); True if one ran.

    With ``wait``, return once it has exited, or after ``wait`` seconds.
    """
    pid = embedded_postgres_pid(instance_path)
    if pid is None:
        return False
    try:
        os.kill(pid, signal.SIGINT)  # PostgreSQL's "fast shutdown"
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + wait
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return True
