"""flask-idempotency as a user gets it: built, installed into a fresh virtualenv, run.

Everything else in the suite imports the checkout through the dev install,
which has every extra; a dependency the package forgot to declare (say,
``typing_extensions``) is invisible there. Here:

1. the sdist and the wheel are built from a copy of the checkout, the way a
   release builds them (``python -m build``: the wheel comes from the sdist),
   and the wheel must hold the library only (no ``example_app``, no tests),
   with its schema SQL and ``py.typed``; ``twine check --strict`` must pass;
2. a fresh virtualenv (no system site-packages) gets the wheel without extras,
   and ``tests/support/smoke_app.py``, a user's app copied into a project
   folder of its own, creates its tables with ``flask idempotency migrate`` and
   runs against the run's PostgreSQL: first answer, replay, 422, 409;
3. the same virtualenv gets ``[redis]``, and the smoke app runs again with
   Redis: the replay comes back and the answers are in Redis;
4. then ``[example]``: the example app, run from the checkout (it is not in
   the wheel), imports every module and creates one charge through ``wsgi:app``
   with the installed library;
5. then ``[sqlalchemy,client]``: a user's Flask-SQLAlchemy app (``sa_user_app.py``)
   under the virtualenv's gunicorn, two workers of sixteen threads on a pool of
   two connections each, takes a storm of duplicate requests from the wheel's own
   retrying client (``wheel_client_storm.py``) while its workers are SIGKILLed,
   and keeps exactly one row per key; every call ends in its ``201``.

The tests share one virtualenv and run in file order (each later step adds an
extra). Installing needs PyPI (flask, psycopg2-binary...); pip's cache makes
reruns quicker. The timings of each step are printed at the end of the module.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tarfile
import time
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from email.parser import HeaderParser
from importlib import metadata, util
from pathlib import Path
from typing import Any

import pytest
import redis
from packaging.utils import canonicalize_name

from support._procs import free_port, tcp_answers
from support.gunicorn_server import child_pids
from support.http_client import http_request
from support.pg_query import query
from support.waiting import wait_until

from .test_makefile import DEV_TOOLS

REPO_ROOT = Path(__file__).resolve().parents[2]
SMOKE_APP = REPO_ROOT / "tests" / "support" / "smoke_app.py"
SA_USER_APP = REPO_ROOT / "tests" / "support" / "sa_user_app.py"
DIST_NAME = "flask_idempotency"

#: Not copied into the build's source tree: VCS, virtualenvs, build and tool
#: leftovers. A stale ``*.egg-info`` in particular would leak its old file list
#: (``SOURCES.txt``) into the sdist.
COPY_IGNORED = (
    ".git",
    ".venv",
    "venv",
    ".tox",
    ".nox",
    "build",
    "dist",
    "instance",
    "*.egg-info",
    "__pycache__",
    ".mypy_cache",
    ".ruff_cache",
    ".pytest_cache",
    ".hypothesis",
    "node_modules",
)

#: Enough of the environment for the apps under test; nothing that could point
#: them (or their imports) elsewhere: no PYTHON*, no DATABASE_URL, REDIS_URL...
APP_ENV_KEPT = ("PATH", "HOME", "LANG", "LC_ALL", "LC_CTYPE", "TMPDIR", "TZ", "SYSTEMROOT")

#: The example app's check, run by the virtualenv's python in the checkout.
EXAMPLE_CHECK = """
import importlib, json, os, pkgutil, sys, uuid
# After site-packages: example_app comes from the checkout, the library from the wheel.
sys.path.append(os.getcwd())
import example_app
modules = sorted(m.name for m in pkgutil.walk_packages(example_app.__path__, "example_app."))
for name in modules:
    importlib.import_module(name)
import gunicorn, marshmallow
import flask_idempotency
from wsgi import app  # what `gunicorn -c gunicorn.conf.py wsgi:app` serves
client = app.test_client()
headers = {"Authorization": "Bearer sk_install_check", "Idempotency-Key": uuid.uuid4().hex}
body = {"amount": 1500, "currency": "usd", "customer": "cus_install", "source": "tok_visa"}
answers = [client.post("/v1/charges", json=body, headers=headers) for _ in range(2)]
app.extensions["idempotency"].close()
print(json.dumps({
    "modules": modules,
    "example_app": example_app.__file__,
    "library": flask_idempotency.__file__,
    "answers": [
        {"status": a.status_code, "replayed": a.headers.get("Idempotent-Replayed"),
         "body": a.get_data(as_text=True)}
        for a in answers
    ],
}))
"""

#: Every distribution in the virtualenv, as one JSON line.
LIST_DISTRIBUTIONS = """
import json
from importlib import metadata
print(json.dumps({"names": sorted(d.metadata["Name"] for d in metadata.distributions())}))
"""


# -- helpers ---------------------------------------------------------------------------


@dataclass
class Timings:
    steps: list[tuple[str, float]] = field(default_factory=list)

    def add(self, name: str, seconds: float) -> None:
        self.steps.append((name, seconds))

    def summary(self) -> str:
        total = sum(seconds for _, seconds in self.steps)
        shown = ", ".join(f"{name} {seconds:.1f}s" for name, seconds in self.steps)
        return f"test_install timings: {shown}; total {total:.1f}s"


def run(
    argv: Sequence[str | Path],
    timings: Timings,
    step: str,
    *,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 600,
) -> subprocess.CompletedProcess[str]:
    """Run a command to completion; a failure fails the test with its output."""
    started = time.monotonic()
    proc = subprocess.run(
        [str(arg) for arg in argv],
        cwd=cwd,
        env=env if env is not None else tool_env(),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    timings.add(step, time.monotonic() - started)
    if proc.returncode != 0:
        pytest.fail(
            f"{step}: `{' '.join(str(a) for a in argv)}` exited {proc.returncode}\n"
            f"--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}",
            pytrace=False,
        )
    return proc


def tool_env() -> dict[str, str]:
    """The caller's environment (pip's configuration, proxies) less PYTHON*."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.pop("VIRTUAL_ENV", None)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def app_env(**variables: str) -> dict[str, str]:
    """A small environment for the apps: only the virtualenv's packages are seen."""
    env = {k: os.environ[k] for k in APP_ENV_KEPT if k in os.environ}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["PYTHONNOUSERSITE"] = "1"  # `flask` runs without -I: no ~/.local packages either
    env.update(variables)
    return env


def checkout_version(source: Path) -> str:
    """``__version__`` as written in the package's ``__init__.py``."""
    tree = ast.parse((source / DIST_NAME / "__init__.py").read_text("utf-8"))
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            return node.value.value
    raise AssertionError(f"no __version__ = '...' in {DIST_NAME}/__init__.py")


def _copy_ignored(directory: str, names: list[str]) -> set[str]:
    """shutil.copytree's ``ignore``: the patterns above, and sockets, fifos and devices."""
    ignored = set(shutil.ignore_patterns(*COPY_IGNORED)(directory, names))
    for name in names:
        try:
            mode = os.lstat(os.path.join(directory, name)).st_mode
        except FileNotFoundError:  # an editor's temporary file, gone already
            ignored.add(name)
            continue
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode)):
            ignored.add(name)
    return ignored


def last_json_line(output: str) -> dict[str, Any]:
    lines = [line for line in output.splitlines() if line.startswith("{")]
    assert lines, f"no JSON report in the output:\n{output}"
    report: dict[str, Any] = json.loads(lines[-1])
    return report


def is_within(path: str | Path, root: Path) -> bool:
    return Path(path).resolve().is_relative_to(root.resolve())


# -- fixtures --------------------------------------------------------------------------


@dataclass
class Dists:
    source: Path  # the copy of the checkout the dists were built from
    version: str
    wheel: Path
    sdist: Path | None  # None when `build` is missing and pip built the wheel alone


@dataclass
class Venv:
    root: Path
    python: Path
    wheel: Path
    timings: Timings
    extras: list[str] = field(default_factory=list)
    #: How to run pip for this virtualenv (it may have no pip of its own).
    pip: list[str] = field(default_factory=list)

    @property
    def bin(self) -> Path:
        return self.python.parent

    def install(self, extra: str | None = None) -> None:
        spec = f"{self.wheel}[{extra}]" if extra else str(self.wheel)
        argv = [*self.pip, "install", "--no-input", "--progress-bar", "off", spec]
        run(argv, self.timings, f"pip install wheel{f'[{extra}]' if extra else ''}")
        if extra:
            self.extras.append(extra)

    def smoke(self, project: Path, **variables: str) -> dict[str, Any]:
        """``flask idempotency migrate``, then the smoke app; its JSON report."""
        env = app_env(**variables)
        run(
            [self.bin / "flask", "--app", "smoke_app", "idempotency", "migrate"],
            self.timings,
            "flask idempotency migrate",
            cwd=project,
            env=env,
        )
        proc = run(
            [self.python, "-I", project / "smoke_app.py"],
            self.timings,
            "smoke app",
            cwd=project,
            env=env,
            timeout=120,
        )
        return last_json_line(proc.stdout)


@pytest.fixture(scope="module")
def timings(request: pytest.FixtureRequest) -> Iterator[Timings]:
    recorded = Timings()
    yield recorded
    # Shown in every run, not only with -s: the steps need PyPI, so their cost varies.
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if capture is None or reporter is None:
        print(recorded.summary())
        return
    with capture.global_and_fixture_disabled():
        reporter.write("\n")
        reporter.write_line(recorded.summary())


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory, timings: Timings) -> Dists:
    """The sdist and wheel, built from a copy of the checkout as a release builds them."""
    root = tmp_path_factory.mktemp("dists")
    source = root / "source"
    started = time.monotonic()
    shutil.copytree(REPO_ROOT, source, ignore=_copy_ignored, symlinks=True)
    timings.add("copy checkout", time.monotonic() - started)
    out = root / "out"
    if util.find_spec("build") is not None:
        argv = [sys.executable, "-m", "build", "--outdir", str(out), str(source)]
        run(argv, timings, "python -m build (sdist, then wheel from it)")
    else:  # a dev virtualenv from before `build` joined the dev extras
        argv = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(out), str(source)]
        run(argv, timings, "pip wheel")
    version = checkout_version(source)
    wheels = sorted(out.glob(f"{DIST_NAME}-*.whl"))
    assert [w.name for w in wheels] == [f"{DIST_NAME}-{version}-py3-none-any.whl"]
    sdists = sorted(out.glob(f"{DIST_NAME}-*.tar.gz"))
    return Dists(source, version, wheels[0], sdists[0] if sdists else None)


@pytest.fixture(scope="module")
def venv(dists: Dists, tmp_path_factory: pytest.TempPathFactory, timings: Timings) -> Venv:
    """A fresh virtualenv (no system site-packages) holding the wheel without extras."""
    root = tmp_path_factory.mktemp("venv")
    # This process's pip can install into a virtualenv without pip of its own
    # (`pip --python`, pip >= 22.3), which saves the ~7 s of ensurepip.
    pip_version = tuple(int(p) for p in metadata.version("pip").split(".")[:2] if p.isdigit())
    own_pip = pip_version < (22, 3)
    argv = [sys.executable, "-m", "venv", *([] if own_pip else ["--without-pip"]), str(root)]
    run(argv, timings, "python -m venv")
    bindir = root / ("Scripts" if os.name == "nt" else "bin")
    python = bindir / ("python.exe" if os.name == "nt" else "python")
    pip = [str(python), "-m", "pip"] if own_pip else [sys.executable, "-m", "pip", "--python"]
    if not own_pip:
        pip.append(str(python))
    env = Venv(root=root, python=python, wheel=dists.wheel, timings=timings, pip=pip)
    env.install()
    return env


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A user's project folder: the smoke app and nothing else."""
    shutil.copy(SMOKE_APP, tmp_path / "smoke_app.py")
    return tmp_path


# -- the distributions -----------------------------------------------------------------


def test_wheel_holds_the_library_only(dists: Dists) -> None:
    with zipfile.ZipFile(dists.wheel) as wheel:
        names = set(wheel.namelist())
        dist_info = f"{DIST_NAME}-{dists.version}.dist-info/"
        fields = HeaderParser().parsestr(wheel.read(dist_info + "METADATA").decode("utf-8"))

    stray = sorted(n for n in names if not n.startswith((f"{DIST_NAME}/", dist_info)))
    assert stray == [], "the wheel must hold flask_idempotency only"

    package = dists.source / DIST_NAME
    shipped = {
        f"{DIST_NAME}/{path.relative_to(package).as_posix()}"
        for path in package.rglob("*")
        if "__pycache__" not in path.parts
        and (
            path.suffix == ".py"
            or (path.parent.name == "schema" and path.suffix == ".sql")
            or path.parent.name == "rules"  # observability/rules: Prometheus rules, dashboard
        )
    }
    assert any(name.endswith(".sql") for name in shipped)
    assert any(name.endswith(".rules.yml") for name in shipped)
    assert sorted(shipped - names) == [], "modules, schema or rules files missing from the wheel"
    assert f"{DIST_NAME}/py.typed" in names
    assert f"{dist_info}licenses/LICENSE" in names

    assert fields["Name"] == "flask-idempotency"
    assert fields["Version"] == dists.version
    assert fields["Requires-Python"] == ">=3.10"
    assert fields["License-Expression"] == "MIT"
    assert fields["Description-Content-Type"] == "text/markdown"
    classifiers = fields.get_all("Classifier") or []
    for wanted in (
        "Framework :: Flask",
        "Typing :: Typed",
        "Programming Language :: Python :: 3.10",
    ):
        assert wanted in classifiers
    if util.find_spec("trove_classifiers") is not None:
        from trove_classifiers import classifiers as known  # PyPI refuses unknown ones

        assert sorted(set(classifiers) - known) == []
    assert any(url.startswith("Homepage, https://") for url in fields.get_all("Project-URL") or [])


def test_sdist_builds_the_same_library(dists: Dists) -> None:
    if dists.sdist is None:
        pytest.skip("`build` is not installed (pip install -e '.[dev]'): no sdist was built")
    top = f"{DIST_NAME}-{dists.version}"
    with tarfile.open(dists.sdist) as sdist:
        names = set(sdist.getnames())
    for wanted in ("PKG-INFO", "pyproject.toml", "README.md", "LICENSE", f"{DIST_NAME}/py.typed"):
        assert f"{top}/{wanted}" in names
    assert any(n.startswith(f"{top}/{DIST_NAME}/schema/") and n.endswith(".sql") for n in names)


def test_twine_check_strict(dists: Dists, timings: Timings) -> None:
    if util.find_spec("twine") is None:
        pytest.skip("twine is not installed (pip install -e '.[dev]')")
    built = [dists.wheel] + ([dists.sdist] if dists.sdist else [])
    run([sys.executable, "-m", "twine", "check", "--strict", *built], timings, "twine check")


# -- installed, without extras, then with [redis], then [example] -----------------------


def check_smoke(report: dict[str, Any], venv: Venv, version: str) -> None:
    first, retry, other = report["first"], report["retry"], report["other_body"]
    assert (first["status"], first["replayed"]) == (201, "false"), first
    assert (retry["status"], retry["replayed"]) == (201, "true"), retry
    assert retry["body"] == first["body"] and retry["content_type"] == first["content_type"]
    assert (other["status"], other["code"], other["replayed"]) == (422, "key_reused", None), other

    duplicate = report["duplicate_in_flight"]
    held, held_retry = report["held"], report["held_retry"]
    assert (duplicate["status"], duplicate["code"]) == (409, "in_progress"), duplicate
    assert duplicate["retry_after"] is not None and duplicate["retry_after"].isdigit(), duplicate
    assert (held["status"], held["replayed"]) == (201, "false"), held
    assert (held_retry["status"], held_retry["replayed"]) == (201, "true"), held_retry
    assert held_retry["body"] == held["body"]
    assert report["views_run"] == 2, "the view ran on a replay, a 422 or a 409"

    installed = report["installed"]
    assert is_within(installed["module"], venv.root), "the library did not come from the wheel"
    assert installed["version"] == installed["__version__"] == version


def test_wheel_without_extras_serves_an_app(
    venv: Venv, dists: Dists, project: Path, clean_db: str
) -> None:
    assert venv.extras == [], "runs first, before any extra is installed (file order)"
    report = venv.smoke(project, IDEMPOTENCY_DATABASE_URL=clean_db)
    check_smoke(report, venv, dists.version)
    assert report["installed"]["redis"] is False, "redis-py came without the [redis] extra"


def test_wheel_with_redis_extra_caches_answers(
    venv: Venv, dists: Dists, project: Path, clean_db: str, clean_redis: str
) -> None:
    venv.install("redis")
    report = venv.smoke(
        project, IDEMPOTENCY_DATABASE_URL=clean_db, IDEMPOTENCY_REDIS_URL=clean_redis
    )
    check_smoke(report, venv, dists.version)
    client = redis.Redis.from_url(clean_redis)
    try:
        cached = client.keys("idempotency:*")
    finally:
        client.close()
    assert len(cached) == 2, f"the two stored answers should be in Redis, found {cached!r}"


def test_example_app_runs_from_the_checkout_with_example_extra(
    venv: Venv, clean_db: str, timings: Timings
) -> None:
    venv.install("example")
    # What `make run` installs: the example's dependencies, no development tool.
    listed = run([venv.python, "-I", "-c", LIST_DISTRIBUTIONS], timings, "list distributions")
    installed = {canonicalize_name(name) for name in last_json_line(listed.stdout)["names"]}
    assert "gunicorn" in installed and "pgserver" in installed, installed
    assert installed & DEV_TOOLS == set(), "the example extra brought development tools"
    proc = run(
        [venv.python, "-I", "-c", EXAMPLE_CHECK],
        timings,
        "example app",
        cwd=REPO_ROOT,
        env=app_env(DATABASE_URL=clean_db),
        timeout=120,
    )
    report = last_json_line(proc.stdout)
    assert "example_app.charges" in report["modules"]
    assert is_within(report["example_app"], REPO_ROOT)
    assert is_within(report["library"], venv.root)
    first, retry = report["answers"]
    assert (first["status"], first["replayed"]) == (201, "false"), first
    assert (retry["status"], retry["replayed"]) == (201, "true"), retry
    assert retry["body"] == first["body"]


# -- [sqlalchemy]: a user's Flask-SQLAlchemy app under gunicorn, workers killed -------

#: Keys, requests per key and client threads of the storm.
STORM_KEYS, STORM_COPIES, STORM_THREADS = 120, 4, 32
#: The storm's client, a user's script on the wheel's ``[client]`` extra.
CLIENT_STORM = REPO_ROOT / "tests" / "support" / "wheel_client_storm.py"


def test_wheel_with_sqlalchemy_extra_keeps_one_row_per_key_under_gunicorn_kills(
    venv: Venv, tmp_path: Path, clean_db: str, timings: Timings
) -> None:
    venv.install("sqlalchemy,client")
    # The user's server, theirs to install (the [example] extra has it already in
    # a whole run; this test also runs alone).
    run([*venv.pip, "install", "--no-input", "gunicorn"], timings, "pip install gunicorn")
    shutil.copy(SA_USER_APP, tmp_path / "sa_user_app.py")
    env = app_env(APP_DATABASE_URI=clean_db.replace("postgresql://", "postgresql+psycopg2://", 1))
    migrate: list[str | Path] = [venv.bin / "flask", "--app", "sa_user_app"]
    migrate += ["idempotency", "migrate"]
    run(migrate, timings, "flask idempotency migrate", cwd=tmp_path, env=env)
    run([venv.python, "sa_user_app.py"], timings, "db.create_all()", cwd=tmp_path, env=env)

    port = free_port()
    help_text = run([venv.bin / "gunicorn", "--help"], timings, "gunicorn --help", env=env).stdout
    argv = [
        str(venv.bin / "gunicorn"), "--workers", "2", "--threads", "16",
        "--bind", f"127.0.0.1:{port}", "--graceful-timeout", "1", "--error-logfile", "-",
        *(["--no-control-socket"] if "--no-control-socket" in help_text else []),
        "sa_user_app:app",
    ]  # fmt: skip
    log_path = tmp_path / "gunicorn.log"
    with log_path.open("wb") as log:
        server = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    client: subprocess.Popen[bytes] | None = None
    try:
        wait_until(
            lambda: tcp_answers("127.0.0.1", port) and http_request("GET", f"{url}/health"),
            30,
            "gunicorn to serve the app",
            describe=lambda: log_path.read_text(errors="replace")[-3000:],
        )
        started = time.monotonic()
        # The client is the wheel's own (flask_idempotency.client), in the virtualenv:
        # each call keeps its key through the kills, as a user's client would.
        shutil.copy(CLIENT_STORM, tmp_path / "wheel_client_storm.py")
        client_argv: list[str | Path] = [venv.python, "wheel_client_storm.py", url]
        client_argv += [str(STORM_KEYS), str(STORM_COPIES), str(STORM_THREADS)]
        client = subprocess.Popen(
            client_argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        killed = []
        wait_until(
            lambda: query(clean_db, "SELECT count(*) FROM wheel_transfers")[0][0] > 0,
            60,
            "the client's first transfers",
        )
        for _ in range(3):  # mid-storm: some workers die after their view's commit()
            time.sleep(0.7)
            workers = child_pids(server.pid)
            if workers:
                os.kill(workers[0], signal.SIGKILL)
                killed.append(workers[0])
        out, err = client.communicate(timeout=150)
        assert client.returncode == 0, err.decode(errors="replace")[-3000:]
        report = last_json_line(out.decode())
        timings.add("storm through gunicorn, workers killed", time.monotonic() - started)
    finally:
        if client is not None and client.poll() is None:
            client.kill()
            client.wait(10)
        server.terminate()
        server.wait(20)
    rows = query(
        clean_db, "SELECT key, count(*) FROM wheel_transfers GROUP BY key HAVING count(*) > 1"
    )
    total = query(clean_db, "SELECT count(*), count(DISTINCT key) FROM wheel_transfers")[0]
    print(f"client={report} killed={len(killed)} rows={total}")
    assert len(killed) == 3, "the storm ended before the workers could be killed"
    assert report["statuses"] == {"201": STORM_KEYS * STORM_COPIES}, report
    assert report["retried_calls"] > 0, "no call met a kill or a duplicate: nothing was tested"
    assert rows == [], f"keys with more than one row: {rows}"
    assert total == (STORM_KEYS, STORM_KEYS)
    assert "Traceback" not in log_path.read_text(errors="replace")
