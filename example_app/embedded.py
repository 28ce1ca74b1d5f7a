"""An embedded PostgreSQL in the instance folder, for when ``DATABASE_URL`` is unset.

So that ``gunicorn wsgi:app`` works on a laptop with nothing else installed.
pgserver serialises start-up with an inter-process lock, so several gunicorn
workers booting together start one server and share it. It is left running
when they exit (``cleanup_mode=None``): a worker that is killed or recycled must
not take the database away from the others, and the next start reuses it.
Stop it with :func:`stop_embedded_postgres` (or ``pg_ctl -D <instance>/pgdata stop``).
"""

from __future__ import annotations

import logging
import os
import signal
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


def stop_embedded_postgres(instance_path: str) -> bool:
    """Ask the instance folder's PostgreSQL to shut down (fast mode); True if one ran."""
    pid_file = Path(instance_path) / PGDATA_DIR / "postmaster.pid"
    try:
        pid = int(pid_file.read_text().split("\n", 1)[0])
    except (OSError, ValueError):
        return False
    try:
        os.kill(pid, signal.SIGINT)  # PostgreSQL's "fast shutdown"
    except ProcessLookupError:
        return False
    return True
