"""Running a check in a forked child, as a gunicorn worker is forked from its master."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable


def in_forked_child(check: Callable[[], bool]) -> bool:
    """Fork, run ``check`` in the child, and return its verdict to the parent.

    The child reports through its exit code and never returns into pytest (it
    ends with ``os._exit``); an exception in it counts as a failure.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # 3.12+: fork with threads
        pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through its exit code
        code = 3
        try:
            code = 0 if check() else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0
