"""A rolling upgrade staged as an operator runs one: the previous release's code from
git, one PostgreSQL database (and Redis) shared by workers of both releases.

:func:`extract_previous_release` takes the package as it was released (0.2.0,
commit ``f045207``) out of this repository's history. A :class:`Stack` then
follows the rollout: the previous release's ``flask idempotency migrate``, its
workers serving, this checkout's migrate while they keep serving (what they
answer meanwhile is kept in :attr:`Stack.rollout`), and workers of this
checkout joining. Each release runs in its own gunicorn, whose workers import
the package of that release only (``PYTHONPATH`` and working directory).
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import io
import os
import subprocess
import sys
import tarfile
import threading
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import psycopg2
from psycopg2 import sql

from support.gunicorn_server import REPO_ROOT, TESTS_DIR, GunicornServer
from support.http_client import HttpResponse, http_request
from support.pg_query import query
from support.waiting import wait_until

from .app import RUNS_TABLE, SCOPE_HEADER

#: The previous release: 0.2.0, as tagged in this repository's history.
PREVIOUS_COMMIT = "f045207f981e02d2bb17a592954ae8b2b1556e3d"
PREVIOUS_VERSION = "0.2.0"

#: What both releases serve (``tests/upgrade/app.py``), as gunicorn and flask name it.
WSGI_APP = "upgrade.app:create_app()"
FLASK_APP = "upgrade.app:create_app"

#: A process start (imports, pool, schema check) takes a second or two on a busy machine.
CLI_TIMEOUT = 120.0

#: The scope used when a test does not care which principal it is.
DEFAULT_SCOPE = "tenant-1"


class ReleaseUnavailable(RuntimeError):
    """The previous release cannot be taken from git (no git, or no such commit)."""


def extract_previous_release(dest: Path) -> Path:
    """``git archive PREVIOUS_COMMIT flask_idempotency`` unpacked into ``dest``;
    ``dest`` (the directory to put first on the old workers' path)."""
    try:
        archive = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "archive", "--format=tar", PREVIOUS_COMMIT,
             "flask_idempotency"],
            capture_output=True,
            timeout=60,
            check=False,
        )  # fmt: skip
    except FileNotFoundError as exc:
        raise ReleaseUnavailable(f"git is not installed: {exc}") from exc
    if archive.returncode != 0:
        raise ReleaseUnavailable(
            f"`git archive {PREVIOUS_COMMIT}` failed in {REPO_ROOT}: "
            f"{archive.stderr.decode(errors='replace').strip()} (a shallow clone? "
            "`git fetch --unshallow` brings the history back)"
        )
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, filter="data")
        else:  # Python releases before the extraction filters (PEP 706)
            tar.extractall(dest)  # our own repository's archive
    init = (dest / "flask_idempotency" / "__init__.py").read_text("utf-8")
    if f'__version__ = "{PREVIOUS_VERSION}"' not in init:
        raise ReleaseUnavailable(f"{PREVIOUS_COMMIT} is not flask-idempotency {PREVIOUS_VERSION}")
    return dest


@dataclasses.dataclass(frozen=True)
class Release:
    """One release's code: where its package comes from, how its processes start."""

    name: str  # "previous" or "current" (tests/upgrade/app.py's CONFIG)
    #: Put first on PYTHONPATH, and the working directory (``python -m`` puts the
    #: working directory first on ``sys.path``).
    root: Path

    @property
    def package(self) -> Path:
        return (self.root / "flask_idempotency").resolve()

    def environ(self, env: Mapping[str, str]) -> dict[str, str]:
        base = {k: v for k, v in os.environ.items() if not k.startswith(("FLASK_", "UPGRADE_"))}
        path = os.pathsep.join([str(self.root), str(TESTS_DIR)])
        return base | dict(env) | {"UPGRADE_RELEASE": self.name, "PYTHONPATH": path}

    def flask(self, env: Mapping[str, str], *args: str) -> str:
        """``flask --app upgrade.app:create_app ARGS`` run with this release; its output."""
        done = self._run([sys.executable, "-m", "flask", "--app", FLASK_APP, *args], env, "")
        return done.stdout + done.stderr

    def python(self, code: str, stdin: str) -> str:
        """Run ``code`` in a Python of this release (for the previous one's own
        functions, frozen in git); its standard output."""
        return self._run([sys.executable, "-c", code], {}, stdin).stdout

    def _run(
        self, command: list[str], env: Mapping[str, str], stdin: str
    ) -> subprocess.CompletedProcess[str]:
        """``command`` in this release's tree and environment; ``RuntimeError`` with
        its output if it fails."""
        done = subprocess.run(
            command,
            env=self.environ(env),
            cwd=self.root,
            input=stdin,
            capture_output=True,
            text=True,
            timeout=CLI_TIMEOUT,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"{self.name} release: {' '.join(command[1:3])} exited {done.returncode}:\n"
                f"{done.stdout}\n{done.stderr}"
            )
        return done


class Server:
    """One release's gunicorn (two workers) serving the shared database."""

    def __init__(self, release: Release, env: Mapping[str, str]) -> None:
        self.release = release
        self.gunicorn = GunicornServer(
            WSGI_APP,
            env=release.environ(env),
            workers=2,
            cwd=release.root,
            health_path="/release",
        )

    def start(self) -> Server:
        self.gunicorn.start()
        served = http_request("GET", self.gunicorn.url + "/release").json()
        # Both releases call themselves 0.2.0 until the version is raised: the
        # package's path is what tells them apart.
        if Path(served["package"]) != self.release.package:
            raise AssertionError(
                f"the {self.release.name} release's workers imported {served['package']}, "
                f"not {self.release.package}"
            )
        return self

    def charge(
        self, key: str, body: Mapping[str, Any] | None = None, *, scope: str = DEFAULT_SCOPE
    ) -> HttpResponse:
        """``POST /charges`` with ``key`` for ``scope`` (any Unicode)."""
        headers = {"Idempotency-Key": key, SCOPE_HEADER: quote(scope, safe="")}
        return http_request(
            "POST", self.gunicorn.url + "/charges", headers, json=dict(body or {"amount": 100})
        )

    def note(self, key: str, text: bytes, content_type: str = "text/plain") -> HttpResponse:
        """``POST /notes``: a body that is not JSON."""
        headers = {
            "Idempotency-Key": key,
            SCOPE_HEADER: DEFAULT_SCOPE,
            "Content-Type": content_type,
        }
        return http_request("POST", self.gunicorn.url + "/notes", headers, body=text)

    def close(self) -> None:
        try:
            self.gunicorn.stop()
            print(f"--- {self.release.name} release {self.gunicorn!r} ---")
            print(self.gunicorn.log_text())
        finally:
            self.gunicorn.close()


@dataclasses.dataclass
class Rollout:
    """What the previous release's workers answered around this checkout's migrate."""

    #: ``flask idempotency migrate`` output, from each release.
    previous_migrate: str = ""
    current_migrate: str = ""
    #: A key completed before the migrate, and its first answer.
    before_key: str = ""
    before: HttpResponse | None = None
    #: (key, answer) of requests sent to the old workers while the migrate ran.
    during: list[tuple[str, HttpResponse]] = dataclasses.field(default_factory=list)
    #: After it: a replay of ``before_key``, and a key first sent after it.
    after_replay: HttpResponse | None = None
    after_first: HttpResponse | None = None


def new_key() -> str:
    return f"upg-{uuid.uuid4().hex}"


def _database_url(base_url: str, name: str) -> str:
    parts = urlsplit(base_url)
    return urlunsplit(parts._replace(path=f"/{name}"))


def _recreate_database(base_url: str, name: str, *, drop_only: bool = False) -> None:
    conn = psycopg2.connect(base_url, connect_timeout=5)
    conn.autocommit = True  # CREATE / DROP DATABASE refuse a transaction block
    try:
        with conn.cursor() as cur:
            # Sessions a killed earlier run left behind would block the DROP.
            cur.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s",
                (name,),
            )
            cur.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(name)))
            if not drop_only:
                cur.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    finally:
        conn.close()


class Stack:
    """A database (and optionally Redis) shared by the previous release's workers
    (``old``) and this checkout's (``new``), set up the way a rollout goes."""

    def __init__(
        self,
        name: str,
        *,
        base_url: str,
        previous: Release,
        claim_mode: str,
        redis_url: str | None,
        gate_dir: Path,
    ) -> None:
        dbname = urlsplit(base_url).path.strip("/") or "postgres"
        self.dbname = f"{dbname}_upgrade_{name}"
        self.base_url = base_url
        self.database_url = _database_url(base_url, self.dbname)
        self.claim_mode = claim_mode
        self.redis_url = redis_url
        self.gate_dir = gate_dir
        self.previous = previous
        self.current = Release("current", REPO_ROOT)
        self.env = {
            "UPGRADE_DATABASE_URL": self.database_url,
            "UPGRADE_CLAIM_MODE": claim_mode,
            "UPGRADE_GATE_DIR": str(gate_dir),
            "UPGRADE_REDIS_URL": redis_url or "",
        }
        self.rollout = Rollout()
        self._servers: list[Server] = []
        self.old: Server
        self.new: Server

    def start(self) -> Stack:
        _recreate_database(self.base_url, self.dbname)
        query(self.database_url, RUNS_TABLE)
        # 1. The schema as the previous release creates it, and its workers serving.
        self.rollout.previous_migrate = self.previous.flask(self.env, "idempotency", "migrate")
        self.old = self._serve(self.previous)
        log = self.rollout
        log.before_key = new_key()
        log.before = self.old.charge(log.before_key)
        # 2. This checkout's migrations, applied while the old workers keep serving.
        with self._traffic_to_old():
            log.current_migrate = self.current.flask(self.env, "idempotency", "migrate")
        log.after_replay = self.old.charge(log.before_key)
        log.after_first = self.old.charge(new_key())
        # 3. This checkout's workers join.
        self.new = self._serve(self.current)
        return self

    def _serve(self, release: Release) -> Server:
        server = Server(release, self.env)
        self._servers.append(server)  # before start(): a failed start is cleaned up too
        return server.start()

    @contextlib.contextmanager
    def _traffic_to_old(self) -> Iterator[None]:
        """First requests and replays to the old workers, one after another, for as
        long as the block runs (and at least a few)."""
        done = threading.Event()
        during = self.rollout.during

        def send() -> None:
            while not done.is_set() or len(during) < 4:
                key = new_key()
                for _ in range(2):  # a first request, then its replay
                    try:
                        during.append((key, self.old.charge(key)))
                    except OSError as exc:  # kept, for the test to show
                        during.append(
                            (key, HttpResponse(0, http.client.HTTPMessage(), repr(exc).encode()))
                        )

        sender = threading.Thread(target=send, name="traffic-to-old-workers", daemon=True)
        sender.start()
        try:
            yield
        finally:
            done.set()
            sender.join(timeout=60)

    def runs(self, key: str) -> list[str]:
        """The releases whose view ran for ``key``, in order."""
        return [release for release, _ in self._runs(key)]

    def running_pid(self, key: str, timeout: float = 15.0) -> int:
        """The worker whose view started for ``key`` (waiting for it to start)."""
        wait_until(lambda: self._runs(key), timeout, f"a view to run for {key}")
        return self._runs(key)[-1][1]

    def _runs(self, key: str) -> list[tuple[str, int]]:
        rows = query(
            self.database_url,
            "SELECT release, pid FROM upgrade_runs WHERE key = %s ORDER BY id",
            (key,),
        )
        return [(str(release), int(pid)) for release, pid in rows]

    def open_gate(self, name: str) -> None:
        (self.gate_dir / name).touch()

    def close(self) -> None:
        try:
            for server in reversed(self._servers):
                server.close()
        finally:
            _recreate_database(self.base_url, self.dbname, drop_only=True)
