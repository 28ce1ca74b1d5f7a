"""Temporary directories and accounts for the throwaway servers.

PostgreSQL will not run as root, so when the tests do (containers, CI
images) its files must belong to an unprivileged account; and a run that is
killed must not leave its servers' directories to pile up in /tmp.
"""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import tempfile
from pathlib import Path
from typing import NamedTuple


class RunAs(NamedTuple):
    """An unprivileged account to run a server as."""

    name: str
    uid: int
    gid: int


def unprivileged_user() -> RunAs | None:
    """The account PostgreSQL should run as, or None to run as ourselves.

    PostgreSQL refuses to start as root.  ``nobody`` exists on practically
    every Linux system and owns nothing, so it needs no ``useradd`` (which
    pgserver does, and which leaves a new account behind on the machine).
    """
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return None
    for name in ("nobody", "postgres"):
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            continue
        return RunAs(name, entry.pw_uid, entry.pw_gid)
    raise RuntimeError("running as root and found neither a 'nobody' nor a 'postgres' account")


def world_accessible(path: Path) -> bool:
    """Whether any user can reach ``path``: every ancestor must be o+x."""
    path = path.resolve()
    for directory in (path, *path.parents):
        if directory.is_dir() and not directory.stat().st_mode & stat.S_IXOTH:
            return False
    return bool(path.stat().st_mode & stat.S_IROTH)


def chown_tree(root: Path, run_as: RunAs | None) -> None:
    """Hand a directory tree we created to the account that will use it."""
    if run_as is None:
        return
    os.chown(root, run_as.uid, run_as.gid)
    for parent, dirs, files in os.walk(root):
        for name in (*dirs, *files):
            os.chown(os.path.join(parent, name), run_as.uid, run_as.gid, follow_symlinks=False)


def remove_tree(path: Path) -> None:
    """Delete a temporary tree, tolerating a partially removed one."""
    shutil.rmtree(path, ignore_errors=True)


WORKDIR_PREFIX = "idem-tests-"
_OWNER_FILE = "owner.pid"
_swept = False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _sweep_stale_workdirs() -> None:
    """Delete work directories left by test runs that were killed.

    A SIGKILLed run takes its servers down with it (the death signal) but
    cannot delete their directories, some 40 MB per PostgreSQL.  A directory
    is stale when the process in its owner file is gone; one without that
    file may be in the middle of being created, and is left alone.
    """
    global _swept
    if _swept:
        return
    _swept = True
    for path in Path(tempfile.gettempdir()).glob(f"{WORKDIR_PREFIX}*"):
        try:
            owner = int((path / _OWNER_FILE).read_text())
        except (OSError, ValueError):
            continue
        if not _alive(owner):
            remove_tree(path)


def make_workdir(kind: str) -> Path:
    """A new temporary directory for a server, marked with our pid."""
    _sweep_stale_workdirs()
    path = Path(tempfile.mkdtemp(prefix=f"{WORKDIR_PREFIX}{kind}-"))
    (path / _OWNER_FILE).write_text(str(os.getpid()))
    return path
