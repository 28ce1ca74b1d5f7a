"""The real stack the reliability tests run against, started the way it is deployed.

* the card processor as its own service (``example_app.processor:app`` under
  gunicorn, one worker: its ledger lives in that process's memory);
* the payments API under gunicorn with ``gunicorn.conf.py`` and ``wsgi:app``,
  several gthread workers, configured only through the environment variables
  of CONTRACT §2;
* PostgreSQL: a database of the stack's own on the run's server (so another
  test's TRUNCATE cannot touch it), or a throwaway server for outage tests;
  optionally behind a ``TcpProxy`` so a test can cut it for the app alone;
* Redis, when given: the run's server or a throwaway one.

Tests read the outcome from the sources of truth themselves: charge rows and
idempotency records straight from PostgreSQL, and the processor's ledger.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

import psycopg2
import psycopg2.extensions
from psycopg2 import sql

from support.gunicorn_server import GunicornServer
from support.http_client import http_request
from support.tcp_proxy import TcpProxy
from support.uwsgi_server import UwsgiServer

from .load import Connections

REPO_ROOT = Path(__file__).resolve().parents[2]

#: Names of the databases stacks create on the run's server; the pid lets a
#: later run drop the leftovers of a run that was killed, and only those.
DATABASE_PREFIX = "reliability_"


@dataclasses.dataclass(frozen=True)
class StackOptions:
    """What a test may change about the stack; the rest is the project's defaults."""

    workers: int = 4
    #: gthread threads per worker; ``None`` keeps gunicorn.conf.py's value.
    threads: int | None = None
    lease_seconds: float = 30.0
    processor_timeout: float = 10.0
    #: Small, so the hostile-input tests can cross it cheaply (the app's default is 1 MiB).
    max_content_length: int = 64 * 1024
    #: Put a TcpProxy between the app and PostgreSQL (``Stack.pg_proxy``).
    pg_proxy: bool = False
    #: The payments API under gunicorn (gunicorn.conf.py) or uWSGI (uwsgi.ini).
    server: Literal["gunicorn", "uwsgi"] = "gunicorn"
    extra_env: Mapping[str, str] = dataclasses.field(default_factory=dict)


class Stack:
    """A running processor and payments API, plus the handles to inspect them."""

    def __init__(
        self,
        *,
        database_url: str,
        redis_url: str | None,
        options: StackOptions,
    ) -> None:
        self.options = options
        #: What the tests query directly (never through the proxy).
        self.database_url = database_url
        self.redis_url = redis_url
        self.pg_proxy: TcpProxy | None = (
            TcpProxy.for_url(database_url) if options.pg_proxy else None
        )
        app_database_url = self.pg_proxy.url if self.pg_proxy is not None else database_url
        self.processor = GunicornServer(
            "example_app.processor:app",
            workers=1,
            worker_class="gthread",
            threads=32,
            health_path="/healthz",
        )
        env = {
            "DATABASE_URL": app_database_url,
            # Set even when empty: the run's own REDIS_URL must not leak into the app.
            "REDIS_URL": redis_url or "",
            "PROCESSOR_TIMEOUT_SECONDS": f"{options.processor_timeout:g}",
            "IDEMPOTENCY_LEASE_SECONDS": f"{options.lease_seconds:g}",
            "MAX_CONTENT_LENGTH": str(options.max_content_length),
            **options.extra_env,
        }
        self._app_env = env
        self.app: GunicornServer | UwsgiServer
        if options.server == "uwsgi":
            self.app = UwsgiServer(env=env, workers=options.workers, threads=options.threads or 4)
        else:
            self.app = GunicornServer(
                "wsgi:app",
                config=REPO_ROOT / "gunicorn.conf.py",
                workers=options.workers,
                worker_class="gthread",
                threads=options.threads,
                env=env,
                health_path="/healthz",
                startup_timeout=60.0,
            )

    # -- life cycle -------------------------------------------------------------

    def start(self) -> Stack:
        self.processor.start()
        self.app.env["PROCESSOR_URL"] = self.processor.url
        self.app.start()
        return self

    def close(self) -> None:
        """Stop both servers; print the end of the app's log (shown if a test failed)."""
        try:
            self.app.stop()
            self.processor.stop()
            print(f"--- payments API log (tail) ---\n{_tail(self.app.log_text(), 60)}")
        finally:
            self.app.close()
            self.processor.close()
            if self.pg_proxy is not None:
                self.pg_proxy.close()

    @property
    def url(self) -> str:
        return self.app.url

    def connections(self, *, timeout: float = 30.0, keep_alive: bool = True) -> Connections:
        return Connections(self.app.url, timeout=timeout, keep_alive=keep_alive)

    def healthy(self) -> bool:
        try:
            return http_request("GET", self.url + "/healthz", timeout=5).status == 200
        except OSError:
            return False

    # -- the processor ------------------------------------------------------------

    def control(self, **switches: Any) -> None:
        """``POST /v1/_control`` (latency_seconds, fail_next, fail_mode, hang_seconds)."""
        answer = http_request("POST", self.processor.url + "/v1/_control", json=switches)
        assert answer.status == 200, answer.body

    def ledger(self) -> list[dict[str, Any]]:
        answer = http_request("GET", self.processor.url + "/v1/_ledger", timeout=30)
        assert answer.status == 200, answer.body
        calls: list[dict[str, Any]] = answer.json()["calls"]
        return calls

    def processor_counts(self, customer_prefix: str) -> tuple[Counter[str], Counter[str]]:
        """(calls, effective charges) per customer, for customers with this prefix.

        Each test gives each of its keys its own customer, so a customer stands
        for a key even though the processor only sees the derived key.
        """
        calls: Counter[str] = Counter()
        charges: Counter[str] = Counter()
        for entry in self.ledger():
            params = entry.get("params") or {}
            customer = params.get("customer", "")
            if not customer.startswith(customer_prefix):
                continue
            calls[customer] += 1
            charges[customer] += int(bool(entry["charged"]))
        return calls, charges

    def processor_outcomes(self, customer_prefix: str) -> Counter[str]:
        """Processor calls by outcome (charged, replayed, in_progress...) for these customers."""
        return Counter(
            str(entry["outcome"])
            for entry in self.ledger()
            if str((entry.get("params") or {}).get("customer", "")).startswith(customer_prefix)
        )

    # -- PostgreSQL -----------------------------------------------------------------

    def query(self, statement: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        conn = psycopg2.connect(self.database_url, connect_timeout=5)
        try:
            with conn, conn.cursor() as cur:
                cur.execute(statement, params)
                return list(cur.fetchall())
        finally:
            conn.close()

    def end_leases(self) -> int:
        """End every processing record's lease now, as time would for holders that are
        dead: all leases move back by one amount, so their order (the completer takes
        the oldest first) stays, and the latest ended a second ago. How many moved."""
        rows = self.query(
            "UPDATE idempotency_records SET lease_expires_at = lease_expires_at - greatest("
            "  interval '0', (SELECT max(lease_expires_at) - now() + interval '1 second'"
            "                   FROM idempotency_records WHERE state = 'processing'))"
            " WHERE state = 'processing' RETURNING 1"
        )
        return len(rows)

    def charge_rows(self, customer_prefix: str) -> Counter[str]:
        rows = self.query(
            "SELECT customer, count(*) FROM charges WHERE customer LIKE %s GROUP BY customer",
            (customer_prefix.replace("_", r"\_") + "%",),
        )
        return Counter({customer: int(n) for customer, n in rows})

    def charge_ids(self, customer_prefix: str) -> dict[str, list[str]]:
        rows = self.query(
            "SELECT customer, id FROM charges WHERE customer LIKE %s ORDER BY seq",
            (customer_prefix.replace("_", r"\_") + "%",),
        )
        found: dict[str, list[str]] = {}
        for customer, charge_id in rows:
            found.setdefault(customer, []).append(charge_id)
        return found

    def app_warnings(self, limit: int = 20) -> list[str]:
        """The extension's own warnings in the app's log so far (a refused request
        says why), the first ``limit``: for a failing test's message."""
        lines = self.app.log_text().splitlines()
        wanted = ("idempotency: store_unavailable", "flask_idempotency", "breaker", "Traceback")
        return [line for line in lines if any(w in line for w in wanted)][:limit]

    def record_states(self) -> Counter[str]:
        """Idempotency records by state, over the whole database."""
        rows = self.query("SELECT state, count(*) FROM idempotency_records GROUP BY state")
        return Counter({state: int(n) for state, n in rows})

    def takeovers(self) -> int:
        rows = self.query("SELECT coalesce(sum(takeovers), 0) FROM idempotency_records")
        return int(rows[0][0])


#: gunicorn's line for each malformed request the hostile-input tests send: hundreds
#: of them would push what the app itself said out of the tail.
_HOSTILE_NOISE = "Invalid request from ip="


def _tail(text: str, lines: int) -> str:
    """The last ``lines`` lines of a log, gunicorn's malformed-request lines counted
    rather than shown."""
    kept = [line for line in text.splitlines() if _HOSTILE_NOISE not in line]
    noise = text.count(_HOSTILE_NOISE)
    counted = [f"({noise} lines of gunicorn's 'Invalid request' left out)"] if noise else []
    return "\n".join(counted + kept[-lines:])


# -- databases of our own on the run's server -------------------------------------------


def _with_dbname(url: str, dbname: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path="/" + dbname))


def _admin(server_url: str) -> psycopg2.extensions.connection:
    conn = psycopg2.connect(server_url, connect_timeout=5)
    conn.autocommit = True  # CREATE/DROP DATABASE cannot run in a transaction
    return conn


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def drop_stale_databases(server_url: str) -> list[str]:
    """Drop databases left by runs of this suite that were killed (their pid is gone)."""
    dropped = []
    conn = _admin(server_url)
    try:
        with conn.cursor() as cur:
            cur.execute(
                "SELECT datname FROM pg_database WHERE datname LIKE %s",
                (DATABASE_PREFIX.replace("_", r"\_") + "%",),
            )
            for (name,) in cur.fetchall():
                pid_part = name.removeprefix(DATABASE_PREFIX).split("_", 1)[0]
                if pid_part.isdigit() and not _pid_alive(int(pid_part)):
                    cur.execute(
                        sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                            sql.Identifier(name)
                        )
                    )
                    dropped.append(name)
    finally:
        conn.close()
    return dropped


@contextlib.contextmanager
def own_database(server_url: str) -> Iterator[str]:
    """A new, empty database on the server ``server_url`` names; dropped afterwards."""
    name = f"{DATABASE_PREFIX}{os.getpid()}_{secrets.token_hex(4)}"
    conn = _admin(server_url)
    try:
        with conn.cursor() as cur:
            cur.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    finally:
        conn.close()
    try:
        yield _with_dbname(server_url, name)
    finally:
        conn = _admin(server_url)
        try:
            with conn.cursor() as cur:
                cur.execute(
                    sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
                )
        finally:
            conn.close()


@contextlib.contextmanager
def running_stack(
    database_url: str, redis_url: str | None, options: StackOptions | None = None
) -> Iterator[Stack]:
    """Start a stack on ``database_url`` (used as it is) and stop it afterwards."""
    stack = Stack(database_url=database_url, redis_url=redis_url, options=options or StackOptions())
    try:
        yield stack.start()
    finally:
        stack.close()
