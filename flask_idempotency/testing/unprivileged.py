"""The plugin's throwaway PostgreSQL when pytest runs as root (CI containers).

``pg_ctl`` refuses to run as root ("cannot be run as root"), and
pytest-postgresql keeps the cluster under pytest's temporary directory, which
only its owner may enter. As root, the plugin therefore hands
pytest-postgresql a small wrapper instead of ``pg_ctl``: it runs the real one
as an unprivileged account (``nobody``, else ``postgres``) and moves the data
directory and log it is given to a directory that account owns (leaving an
empty directory where pytest-postgresql expects its data). When that cannot
work (no such account, or the account cannot reach the binaries) the plugin
says so in one line, with the option that avoids starting a server at all.

flask-idempotency's own test suite starts its run-wide server through the same
wrapper (tests/support/postgres_proc.py), with the two options of
:func:`wrapper_for` that the plugin leaves off.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

#: What to do instead, at the end of every failure this module reports.
USE_A_SERVER = (
    "pass --idempotency-dsn=postgresql://USER@HOST:PORT/postgres (ini idempotency_dsn, "
    "or $IDEMPOTENCY_TEST_DSN) to use a server you run instead"
)

# Runs as root, becomes the account and execs the real pg_ctl, with the data
# directory and log (under pytest's 0700 temporary directory) replaced by the
# same names in a directory of the account's own, one per original parent;
# INITDB_OPTIONS and CLEAN_ENV are wrapper_for's initdb_options and clean_environment.
_SHIM = """\
import hashlib, os, sys

REAL, UID, GID, HOMES, INITDB_OPTIONS, CLEAN_ENV = {settings!r}


def relocate(path, create_marker):
    parent, name = os.path.split(os.path.abspath(path))
    home = os.path.join(HOMES, hashlib.sha256(parent.encode()).hexdigest()[:16])
    if not os.path.isdir(home):
        os.mkdir(home, 0o700)
        os.chown(home, UID, GID)
    if create_marker:  # pytest-postgresql checks that its data directory exists
        os.makedirs(path, exist_ok=True)
    return os.path.join(home, name)


args = sys.argv[1:]
initdb = args[:1] == ["initdb"]
out = []
rest = iter(args)  # an option's value is taken from here too, so it is not read as an option
for arg in rest:
    out.append(arg)
    if arg in ("-D", "--pgdata", "-l", "--log") and (value := next(rest, None)) is not None:
        out.append(relocate(value, create_marker=initdb and arg in ("-D", "--pgdata")))
    elif INITDB_OPTIONS and initdb and arg == "-o" and (value := next(rest, None)) is not None:
        out.append(value + " " + INITDB_OPTIONS)
env = dict(os.environ)
if CLEAN_ENV:
    env = dict((k, v) for k, v in env.items() if not k.startswith("PG"))
    env.update(LC_ALL="C", LC_CTYPE="C", LANG="C")
os.setgroups([])
os.setgid(GID)
os.setuid(UID)
os.chdir(HOMES)
os.execve(REAL, [REAL] + out, env)
"""


class CannotRunUnprivileged(RuntimeError):
    """Running as root, with no way to run PostgreSQL as someone else."""


def running_as_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def account() -> pwd.struct_passwd:
    """The account PostgreSQL runs as: ``nobody`` (owns nothing, exists everywhere),
    else ``postgres``."""
    for name in ("nobody", "postgres"):
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name)
    raise CannotRunUnprivileged(
        "pytest runs as root, which PostgreSQL refuses, and there is no 'nobody' or "
        f"'postgres' account to run it as: {USE_A_SERVER}"
    )


def find_pg_ctl(configured: str | None) -> str | None:
    """The ``pg_ctl`` pytest-postgresql would run: ``--postgresql-exec`` (or its ini
    key) when it names a file, else the one ``pg_config`` or ``PATH`` knows."""
    if configured and os.path.isfile(configured):
        return configured
    try:
        bindir = subprocess.run(
            ["pg_config", "--bindir"], capture_output=True, text=True, timeout=30, check=True
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        bindir = ""
    if bindir and os.path.isfile(os.path.join(bindir, "pg_ctl")):
        return os.path.join(bindir, "pg_ctl")
    return shutil.which("pg_ctl")


def is_script(path: str) -> bool:
    """Whether ``path`` is a script (``#!``): a wrapper of someone's own around the
    real ``pg_ctl``, which is a binary, and is left to do what it does as root."""
    try:
        with open(path, "rb") as file:
            return file.read(2) == b"#!"
    except OSError:
        return False


def can_run(path: Path, runs_as: pwd.struct_passwd) -> bool:
    """Whether ``runs_as`` (with no supplementary groups, as the wrapper runs it) may
    run ``path``: asked of the system itself, by running ``path --version`` as it."""
    try:
        done = subprocess.run(
            [str(path), "--version"],
            user=runs_as.pw_uid,
            group=runs_as.pw_gid,
            extra_groups=[],
            capture_output=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def wrapper_for(
    pg_ctl: str, workdir: Path, *, initdb_options: str = "", clean_environment: bool = False
) -> str:
    """An executable in ``workdir`` (made here) that runs ``pg_ctl`` as :func:`account`;
    ``CannotRunUnprivileged`` when it could not.

    The plugin passes neither option, so that pg_ctl runs as pytest-postgresql
    asked. ``initdb_options`` is added to the options ``pg_ctl initdb`` hands initdb
    (its ``-o``), e.g. ``"--encoding=UTF8 --locale=C"`` for a cluster that does not
    depend on the machine's locales. ``clean_environment`` runs pg_ctl (and so
    initdb and the server) without the ``PG*`` variables, which point tools at some
    other cluster, and in the C locale, which every machine has, instead of the
    locale pytest-postgresql sets."""
    runs_as = account()
    real = Path(pg_ctl).resolve()
    if not can_run(real, runs_as):
        raise CannotRunUnprivileged(
            f"pytest runs as root, so PostgreSQL must run as '{runs_as.pw_name}', who cannot "
            f"reach {real} (give --postgresql-exec a pg_ctl every user can run), or "
            f"{USE_A_SERVER}"
        )
    workdir.chmod(0o711)  # the account passes through to its own directory, lists nothing
    homes = workdir / "data"
    homes.mkdir(mode=0o700)
    os.chown(homes, runs_as.pw_uid, runs_as.pw_gid)
    shim = workdir / "pg_ctl_as_user.py"
    where = (str(real), runs_as.pw_uid, runs_as.pw_gid, str(homes))  # REAL, UID, GID, HOMES
    shim.write_text(_SHIM.format(settings=(*where, initdb_options, clean_environment)))
    wrapper = workdir / "pg_ctl"
    python = shlex.quote(sys.executable)
    wrapper.write_text(f'#!/bin/sh\nexec {python} -I -S {shlex.quote(str(shim))} "$@"\n')
    wrapper.chmod(0o700)
    return str(wrapper)


def make_workdir() -> Path:
    """A directory for the wrapper and the data, removed with ``shutil.rmtree``."""
    return Path(tempfile.mkdtemp(prefix="flask-idempotency-pg-"))
