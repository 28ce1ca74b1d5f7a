"""A store that only holds in one process refuses to be shared between several.

The in-memory store (``memory.py``) is correct only while every request for a
key reaches the same process: under a server with several worker processes,
or in a child forked after the store was made, a duplicate would find no
record and run again. Rather than answer wrongly, it refuses, in one line.

Two checks: at creation, whether the process is a worker (or the master) of a
server that runs several worker processes (gunicorn's configuration is found
on the stack that is loading the app; uWSGI's in its ``uwsgi`` module); and on
every use, whether this is still the process that created the store.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Any

_ADVICE = "run one worker process (gunicorn --workers 1 --threads N) or use a PostgreSQL URL"


class MultiProcessError(RuntimeError):
    """A one-process store was started, or used, where several processes share it."""


def server_processes() -> tuple[str, int, bool] | None:
    """The multi-process server this process serves under, its number of worker
    processes and whether this process is one of them (not the master that forks
    them): ``("gunicorn", 4, True)``; ``None`` if none is known."""
    uwsgi: Any = sys.modules.get("uwsgi")
    if uwsgi is not None and hasattr(uwsgi, "numproc"):
        return "uWSGI", int(uwsgi.numproc), True
    if "gunicorn" not in sys.modules:
        return None
    # gunicorn loads the app from a method of its worker (or, with --preload, of its
    # arbiter), through its application object; each holds the configuration as .cfg.
    workers: int | None = None
    in_worker = False
    for frame, _ in traceback.walk_stack(None):
        owner = frame.f_locals.get("self")
        module = type(owner).__module__ if owner is not None else ""
        if module.startswith("gunicorn"):
            found = getattr(getattr(owner, "cfg", None), "workers", None)
            if workers is None and isinstance(found, int):
                workers = found
            in_worker = in_worker or module.startswith("gunicorn.workers")
    return None if workers is None else ("gunicorn", workers, in_worker)


class Guard:
    """Made with the store: refuses a multi-process server at once, and any use of
    the store from another process later (:meth:`check`)."""

    def __init__(self, what: str) -> None:
        self._what = what
        self._pid = os.getpid()
        server = server_processes()
        if server is not None and server[1] > 1:
            name, workers, _ = server
            raise MultiProcessError(
                f"{what} keeps the records in one process, but {name} runs {workers} worker "
                f"processes (a retry reaching another one would run again): {_ADVICE}"
            )
        #: Made in a one-worker server's master (gunicorn --preload --workers 1): its
        #: one worker, a child of this process, takes the store over.
        self._adoptable = server is not None and not server[2]

    def check(self) -> None:
        """Raise ``MultiProcessError`` in a process other than the store's."""
        pid = os.getpid()
        if pid == self._pid:
            return
        if self._adoptable and os.getppid() == self._pid:
            self._pid, self._adoptable = pid, False
            return
        raise MultiProcessError(
            f"{self._what} was created in process {self._pid} and is used in process {pid} "
            f"(forked from it: gunicorn --preload, multiprocessing): its records are not "
            f"shared between processes; create the app in the process that serves it, "
            f"{_ADVICE}"
        )
