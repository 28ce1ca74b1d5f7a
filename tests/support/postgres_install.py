"""Finding PostgreSQL binaries and preparing clusters for ThrowawayPostgres.

The binaries come from the ``pgserver`` wheel (a dev dependency, so every
machine that ran ``make venv`` has the same PostgreSQL), else from
``initdb``/``postgres`` on PATH.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import threading
from pathlib import Path

from ._files import RunAs, chown_tree, make_workdir, remove_tree, world_accessible
from ._procs import at_exit, log_tail, spawn, stop_process


def server_env() -> dict[str, str]:
    """Our environment minus what could confuse a throwaway server.

    No locale the machine may not have (initdb fails on those), and no PG*
    variables that point the tools at some other cluster.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    return env | {"LC_ALL": "C", "LANG": "C"}


def find_bindir() -> Path:
    """Where ``initdb`` and ``postgres`` live: pgserver's wheel, else PATH."""
    spec = importlib.util.find_spec("pgserver")  # no import: it has side effects
    if spec is not None and spec.submodule_search_locations:
        bindir = Path(list(spec.submodule_search_locations)[0]) / "pginstall" / "bin"
        if (bindir / "postgres").exists() and (bindir / "initdb").exists():
            return bindir
    initdb = shutil.which("initdb")
    if initdb is not None:
        bindir = Path(initdb).resolve().parent
        if (bindir / "postgres").exists():
            return bindir
    raise RuntimeError(
        "no PostgreSQL binaries: install the dev extras (pgserver) or put initdb on PATH, "
        "or set DATABASE_URL to a running server"
    )


_shared_lock = threading.Lock()
_bindirs: dict[tuple[Path, int], Path] = {}
_templates: dict[tuple[Path, int], Path] = {}


def usable_bindir(bindir: Path, run_as: RunAs | None) -> Path:
    """``bindir``, or a world-readable copy when ``run_as`` cannot reach it.

    As root we run PostgreSQL as ``nobody``, who cannot enter a virtualenv
    under ``/root``.  Rather than loosening permissions up the tree (what
    pgserver does), copy pgserver's self-contained install once per run.
    """
    if run_as is None or world_accessible(bindir / "postgres"):
        return bindir
    key = (bindir, run_as.uid)
    with _shared_lock:
        if key not in _bindirs:
            # pgserver/pginstall/{bin,lib,share}, with the libraries auditwheel
            # vendored into site-packages/pgserver.libs, found through the
            # RPATH $ORIGIN/../../../pgserver.libs: keep those relative places.
            prefix = bindir.parent
            package = prefix.parent
            if not (prefix / "lib").is_dir() or not (prefix / "share").is_dir():
                raise RuntimeError(f"user {run_as.name} cannot read {bindir}")
            copy = make_workdir("pg-bin")
            mirror = copy / package.name / prefix.name
            for part in ("bin", "lib", "share"):
                shutil.copytree(prefix / part, mirror / part, symlinks=True)
            for libs in package.parent.glob(f"{package.name}.libs"):
                shutil.copytree(libs, copy / libs.name, symlinks=True)
            chown_tree(copy, run_as)  # whatever the modes were, they can read it now
            at_exit.add(copy, lambda: remove_tree(copy))
            _bindirs[key] = mirror / "bin"
        return _bindirs[key]


def template_cluster(bindir: Path, run_as: RunAs | None) -> Path:
    """A data directory initialised once per run, copied for each server.

    initdb takes most of a second; copying its result takes a tenth of that,
    which matters for the per-test servers of outage tests.
    """
    key = (bindir, run_as.uid if run_as else os.getuid())
    with _shared_lock:
        if key in _templates:
            return _templates[key]
        root = make_workdir("pg-template")
        at_exit.add(root, lambda: remove_tree(root))
        chown_tree(root, run_as)
        log_path = root / "initdb.log"
        # --no-sync: a crash of the machine would lose this template anyway;
        # the servers made from it run with fsync on.
        proc = spawn(
            [str(bindir / "initdb"), "-D", str(root / "data"), "-U", "postgres",
             "--auth=trust", "--encoding=UTF8", "--locale=C", "--no-sync"],
            log_path=log_path, env=server_env(), cwd=root, run_as=run_as,
        )  # fmt: skip
        try:
            returncode = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            stop_process(proc, [])
            returncode = -1
        if returncode != 0:
            raise RuntimeError(f"initdb failed ({returncode}):\n{log_tail(log_path)}")
        _templates[key] = root / "data"
        return _templates[key]
