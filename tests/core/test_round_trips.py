"""Round trips per request, counted and asserted: the extension's cost model.

The benchmarks show what the extension costs; this file pins down why, in the
unit that decides it on a loopback network - round trips. Each path's exact
sequence of PostgreSQL statements and Redis commands is asserted, so that a
change adding a trip (a separate COMMIT, a SELECT before the claim, a cache
lookup that also touches PostgreSQL) fails here before it shows up as a
slower benchmark:

- first request: one claim statement; the view's BEGIN and INSERT (the same
  business round trips a bare app makes); the completion sent together with
  the COMMIT - no separate commit of the claim's, no extra COMMIT;
- PostgreSQL replay, and a duplicate that finds the key in progress: the
  claim statement alone;
- with Redis: a replay is one GET and no PostgreSQL at all; a first request
  adds a GET (the miss) before the claim and a SET after the commit;
- in the transaction claim mode, a first request is two round trips of the
  extension's in all: the claim opens the business transaction (no BEGIN of
  its own, no commit of the claim's) and the completed record rides on the
  COMMIT; a replay from PostgreSQL or a 409 adds the ROLLBACK of the
  transaction the claim opened.

Statements are counted by a psycopg2 connection subclass given to the pool
through ``IDEMPOTENCY_DATABASE_OPTIONS``, Redis commands by a redis-py client
subclass given through ``IDEMPOTENCY_REDIS`` (and, underneath it, every write
to the socket, so a command issued around ``execute_command`` - a health-check
PING, a retry - is caught too). The app is the benchmarks' own, so the counts
are those of the code the benchmark measures.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from importlib.util import find_spec
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import psycopg2
import psycopg2.extensions
import pytest
import redis
import redis.connection
from flask import Flask
from werkzeug.test import TestResponse

from flask_idempotency import digests
from flask_idempotency.fingerprint import fingerprint
from flask_idempotency.store.base import Claimed

# The benchmarks package is not installed (it is not part of the
# distribution); `python -m pytest` from the root finds it, plain `pytest` needs this.
if str(Path(__file__).resolve().parents[2]) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.app import (  # noqa: E402
    CHARGES_PATH,
    REQUEST_BODY,
    create_app,
    prepare_database,
    subject_config,
)

#: One event per round trip, in order: ("pg", sql) or ("redis", command name),
#: plus ("redis-wire", "") for every write to a Redis socket.
Trace = list[tuple[str, str]]

if TYPE_CHECKING:
    _RedisBase = redis.Redis[bytes]
else:
    _RedisBase = redis.Redis

REDIS_CACHE_MISSING = find_spec("flask_idempotency.cache.redis") is None


class CountingCursor(psycopg2.extensions.cursor):
    """Records each statement before sending it (each ``execute`` is one round trip)."""

    def execute(self, query: Any, vars: Any = None) -> None:
        _trace_of(self.connection).append(("pg", _text(query)))
        super().execute(query, vars)

    def executemany(self, query: Any, vars_list: Any) -> None:
        _trace_of(self.connection).append(("pg", "executemany: " + _text(query)))
        super().executemany(query, vars_list)


class CountingConnection(psycopg2.extensions.connection):
    """Hands out counting cursors and counts ``commit()``/``rollback()`` that reach
    the server, which psycopg2 sends without a cursor. ``trace`` is set on a per-test subclass."""

    trace: ClassVar[Trace]

    def cursor(self, *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("cursor_factory", CountingCursor)
        return super().cursor(*args, **kwargs)

    def commit(self) -> None:
        if self._sends_end():
            self.trace.append(("pg", "connection.commit()"))
        super().commit()

    def rollback(self) -> None:
        if self._sends_end():
            self.trace.append(("pg", "connection.rollback()"))
        super().rollback()

    def _sends_end(self) -> bool:
        """psycopg2 sends COMMIT/ROLLBACK only inside a transaction it began (a pool's
        reset of an idle connection costs no round trip)."""
        return self.status == psycopg2.extensions.STATUS_BEGIN


class CountingRedisConnection(redis.connection.Connection):
    """Counts every write to the socket: one per command, one per pipeline."""

    trace: ClassVar[Trace]

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        self.trace.append(("redis-wire", ""))
        super().send_packed_command(command, check_health)


class CountingRedis(_RedisBase):
    """Records the name of every command the cache issues."""

    trace: Trace

    def execute_command(self, *args: Any, **options: Any) -> Any:
        self.trace.append(("redis", str(args[0]).upper()))
        return super().execute_command(*args, **options)


def _trace_of(conn: psycopg2.extensions.connection) -> Trace:
    assert isinstance(conn, CountingConnection), "a counting cursor on a plain connection"
    return conn.trace


def _text(query: Any) -> str:
    return query.decode() if isinstance(query, bytes) else str(query)


def pg(trace: Trace) -> list[str]:
    return [sql for kind, sql in trace if kind == "pg"]


def redis_commands(trace: Trace) -> list[str]:
    return [name for kind, name in trace if kind == "redis"]


def redis_writes(trace: Trace) -> int:
    return sum(1 for kind, _ in trace if kind == "redis-wire")


def kinds(trace: Trace) -> list[str]:
    """The trace in words: ``claim``, ``BEGIN``, ``business INSERT``, ``complete+COMMIT``,
    ``GET``... so a failing assertion reads as the sequence it got."""
    named = []
    for kind, text in trace:
        if kind == "redis":
            named.append(text)
        elif kind == "pg":
            named.append(_statement_kind(text))
    return named


def _statement_kind(sql: str) -> str:
    flat = " ".join(sql.split())
    if "idempotency_claim_in_transaction" in flat:  # IDEMPOTENCY_CLAIM_MODE = "transaction"
        return "BEGIN+claim" if flat.startswith("BEGIN;") else flat
    if "idempotency_insert_completed" in flat:
        return "insert completed+COMMIT" if flat.rstrip().endswith("COMMIT") else flat
    # The claim: one call of its schema function, which sets its own timeouts.
    if "idempotency_claim_v2(" in flat:
        # Asynchronous claim commit (its last argument) is the default; a durable one is named.
        return "claim" if flat.endswith(", true)") else "claim (durable commit)"
    if "idempotency_complete" in flat:
        return "complete+COMMIT" if flat.rstrip().endswith("COMMIT") else "complete"
    if "INSERT INTO bench_charges" in flat:
        # (Nothing rides on the view's statements: the attempt's BEGIN and the
        # session's savepoint are statements of their own.)
        for opening in ("BEGIN", "SAVEPOINT"):
            if flat.startswith(opening + " ") or flat.startswith(opening + ";"):
                return f"{opening}+business INSERT"
        return "business INSERT"
    return flat


class Subject:
    """One benchmark app with counting connections, and its trace."""

    def __init__(self, app: Flask, trace: Trace) -> None:
        self.app = app
        self.trace = trace
        self.client = app.test_client()

    def post(self, key: str) -> TestResponse:
        return self.client.post(
            CHARGES_PATH,
            data=REQUEST_BODY,
            headers={"Content-Type": "application/json", "Idempotency-Key": key},
        )

    def counted(self, key: str) -> tuple[TestResponse, Trace]:
        """One request, and exactly the round trips it made."""
        self.trace.clear()
        response = self.post(key)
        return response, list(self.trace)


MakeSubject = Callable[..., Subject]


@pytest.fixture
def make_subject(clean_db: str) -> Iterator[MakeSubject]:
    """Factory: ``make_subject("pg")`` or ``make_subject("pg+redis", redis_url=...)``.

    Each app gets its own counting classes (their ``trace`` is per test), one
    warm-up request (so connecting - libpq's start-up, Redis's ``SELECT`` - is
    not counted as a request's work), and is closed at teardown.
    """
    prepare_database(clean_db)
    apps: list[Flask] = []

    def make(subject: str, redis_url: str | None = None, **config: Any) -> Subject:
        trace: Trace = []
        connection_class = type("Counting", (CountingConnection,), {"trace": trace})
        # The subject's own database options (its claim commit, its pool), plus
        # the counting connections.
        options = subject_config(subject, clean_db, "")["IDEMPOTENCY_DATABASE_OPTIONS"]
        settings: dict[str, Any] = {
            "IDEMPOTENCY_DATABASE_URL": clean_db,
            "IDEMPOTENCY_DATABASE_OPTIONS": {**options, "connection_factory": connection_class},
            # The lease keeper's renewals run on their own thread every lease / 3;
            # with renewal off no statement but the request's can appear.
            "IDEMPOTENCY_LEASE_RENEW_INTERVAL": 0,
            **config,
        }
        if redis_url is not None:
            wire_class = type("CountingWire", (CountingRedisConnection,), {"trace": trace})
            pool = redis.ConnectionPool.from_url(redis_url, connection_class=wire_class)
            client = CountingRedis(connection_pool=pool)
            client.trace = trace
            settings["IDEMPOTENCY_REDIS"] = client
            settings["IDEMPOTENCY_REDIS_URL"] = None
        app = create_app(subject, settings)
        apps.append(app)
        made = Subject(app, trace)
        assert made.post("warm-up").status_code == 201
        return made

    yield make
    for app in apps:
        app.extensions["idempotency"].close()
        client = app.config.get("IDEMPOTENCY_REDIS")
        if client is not None:
            client.close()


def test_first_request_is_one_claim_and_a_completion_inside_the_business_commit(
    make_subject: MakeSubject,
) -> None:
    subject = make_subject("pg")
    response, trace = subject.counted("first-1")
    assert response.status_code == 201
    assert response.headers["Idempotent-Replayed"] == "false"
    assert kinds(trace) == [
        "claim",  # one statement (prepared on the connection's first claim)
        "BEGIN",  # the business transaction, as in a bare app
        "business INSERT",
        "complete+COMMIT",  # the completion rides on the COMMIT: no extra round trip
    ]
    assert not any(s.strip().upper() == "COMMIT" for s in pg(trace)), "a separate COMMIT"


def test_durable_claim_commit_is_still_one_statement(make_subject: MakeSubject) -> None:
    subject = make_subject("pg-synccommit")
    response, trace = subject.counted("first-sync")
    assert response.status_code == 201
    assert kinds(trace) == [
        "claim (durable commit)",
        "BEGIN",
        "business INSERT",
        "complete+COMMIT",
    ]


def test_postgres_replay_is_the_claim_statement_alone(make_subject: MakeSubject) -> None:
    subject = make_subject("pg")
    first = subject.post("replay-1")
    response, trace = subject.counted("replay-1")
    assert response.status_code == 201
    assert response.headers["Idempotent-Replayed"] == "true"
    assert response.get_data() == first.get_data()
    assert kinds(trace) == ["claim"]


def test_duplicate_of_an_in_progress_key_is_the_claim_statement_alone(
    make_subject: MakeSubject,
) -> None:
    """The hot-key path: while one request holds the key, a duplicate's 409
    costs one statement (the claim that finds the live lease)."""
    subject = make_subject("pg")
    state = subject.app.extensions["idempotency"]
    record_key = digests.record_key("", "hot-1")
    request_fp = fingerprint("POST", CHARGES_PATH, b"", "application/json", REQUEST_BODY)
    holder = state.store.begin()
    try:
        assert isinstance(holder.claim(record_key, request_fp, lease=30, ttl=60), Claimed)
        subject.trace.clear()
        response, trace = subject.counted("hot-1")
    finally:
        holder.close()
    assert response.status_code == 409
    assert kinds(trace) == ["claim"]


@pytest.mark.skipif(
    REDIS_CACHE_MISSING,
    reason="flask_idempotency/cache/redis.py is not in this checkout yet: "
    "the Redis round trips are asserted once the cache lands",
)
class TestWithRedis:
    def test_replay_is_one_redis_command_and_no_postgres(
        self, make_subject: MakeSubject, clean_redis: str
    ) -> None:
        subject = make_subject("pg+redis", redis_url=clean_redis)
        first = subject.post("cached-1")
        subject.post("cached-1")  # the first replay, from PostgreSQL, puts it in Redis
        response, trace = subject.counted("cached-1")
        assert response.status_code == 201
        assert response.headers["Idempotent-Replayed"] == "true"
        assert response.get_data() == first.get_data()
        assert redis_commands(trace) == ["GET"]
        assert redis_writes(trace) == 1
        assert pg(trace) == [], "a Redis replay must not touch PostgreSQL"

    def test_first_request_adds_one_get_over_postgres_and_the_first_replay_fills(
        self, make_subject: MakeSubject, clean_redis: str
    ) -> None:
        """IDEMPOTENCY_REDIS_OPTIONS["fill"] = "replay", the default: no SET on a first request."""
        subject = make_subject("pg+redis", redis_url=clean_redis)
        response, trace = subject.counted("fill-later-1")
        assert response.status_code == 201
        assert kinds(trace) == ["GET", "claim", "BEGIN", "business INSERT", "complete+COMMIT"]
        assert redis_writes(trace) == 1
        _replayed, trace = subject.counted("fill-later-1")
        assert kinds(trace) == ["GET", "claim", "SET"]  # the first replay makes the copy
        _again, trace = subject.counted("fill-later-1")
        assert kinds(trace) == ["GET"]

    def test_filling_on_completion_adds_a_set_after_the_commit(
        self, make_subject: MakeSubject, clean_redis: str
    ) -> None:
        subject = make_subject("pg+redis-fill-on-completion", redis_url=clean_redis)
        response, trace = subject.counted("cached-first")
        assert response.status_code == 201
        assert kinds(trace) == [
            "GET",  # the miss
            "claim",
            "BEGIN",
            "business INSERT",
            "complete+COMMIT",
            "SET",  # only after the commit: Redis never holds an uncommitted answer
        ]
        assert redis_writes(trace) == 2
        _replayed, trace = subject.counted("cached-first")
        assert kinds(trace) == ["GET"]

    def test_replay_missing_from_redis_is_one_statement_then_cached(
        self, make_subject: MakeSubject, clean_redis: str
    ) -> None:
        subject = make_subject("pg+redis", redis_url=clean_redis)
        subject.post("evicted-1")
        client = subject.app.config["IDEMPOTENCY_REDIS"]
        client.flushdb()  # as after a Redis restart
        response, trace = subject.counted("evicted-1")
        assert response.status_code == 201
        assert response.headers["Idempotent-Replayed"] == "true"
        assert kinds(trace) == ["GET", "claim", "SET"]
        _again, trace = subject.counted("evicted-1")
        assert kinds(trace) == ["GET"]


TRANSACTION_MODE = {"IDEMPOTENCY_CLAIM_MODE": "transaction"}


class TestTransactionClaimMode:
    def test_first_request_is_the_claim_opening_the_transaction_and_the_commit(
        self, make_subject: MakeSubject, clean_db: str
    ) -> None:
        subject = make_subject("pg", **TRANSACTION_MODE)
        response, trace = subject.counted("tx-first-1")
        assert response.status_code == 201
        assert response.headers["Idempotent-Replayed"] == "false"
        assert kinds(trace) == [
            "BEGIN+claim",  # the claim opens the business transaction: no BEGIN of its own
            "business INSERT",
            "insert completed+COMMIT",  # one commit per request, as in a bare app
        ]
        with psycopg2.connect(clean_db) as conn, conn.cursor() as cur:
            cur.execute("SELECT state FROM idempotency_records")
            assert cur.fetchall() == [("completed",), ("completed",)]  # and the warm-up's
        conn.close()

    def test_postgres_replay_is_the_claim_and_its_rollback(self, make_subject: MakeSubject) -> None:
        subject = make_subject("pg", **TRANSACTION_MODE)
        first = subject.post("tx-replay-1")
        response, trace = subject.counted("tx-replay-1")
        assert response.headers["Idempotent-Replayed"] == "true"
        assert response.get_data() == first.get_data()
        assert kinds(trace) == ["BEGIN+claim", "ROLLBACK"]

    def test_duplicate_of_an_in_progress_key_is_the_claim_and_its_rollback(
        self, make_subject: MakeSubject
    ) -> None:
        subject = make_subject("pg", **TRANSACTION_MODE)
        state = subject.app.extensions["idempotency"]
        record_key = digests.record_key("", "tx-hot-1")
        request_fp = fingerprint("POST", CHARGES_PATH, b"", "application/json", REQUEST_BODY)
        holder = state.store.begin()
        try:
            assert isinstance(holder.claim(record_key, request_fp, lease=30, ttl=60), Claimed)
            subject.trace.clear()
            response, trace = subject.counted("tx-hot-1")
            other = subject.client.post(
                CHARGES_PATH,
                data=b'{"amount": 1}',
                headers={"Content-Type": "application/json", "Idempotency-Key": "tx-hot-1"},
            )
        finally:
            holder.close()
        assert response.status_code == 409
        assert other.status_code == 422  # a different request under a running key
        assert kinds(trace) == ["BEGIN+claim", "ROLLBACK"]

    @pytest.mark.skipif(REDIS_CACHE_MISSING, reason="no Redis cache in this checkout")
    def test_with_redis_the_first_request_adds_one_get(
        self, make_subject: MakeSubject, clean_redis: str
    ) -> None:
        subject = make_subject("pg+redis", redis_url=clean_redis, **TRANSACTION_MODE)
        response, trace = subject.counted("tx-cached-1")
        assert response.status_code == 201
        assert kinds(trace) == ["GET", "BEGIN+claim", "business INSERT", "insert completed+COMMIT"]
        _replayed, trace = subject.counted("tx-cached-1")
        assert kinds(trace) == ["GET", "BEGIN+claim", "ROLLBACK", "SET"]
        _again, trace = subject.counted("tx-cached-1")
        assert kinds(trace) == ["GET"]

    def test_with_redis_filled_on_completion_the_first_request_adds_a_get_and_a_set(
        self, make_subject: MakeSubject, clean_redis: str
    ) -> None:
        subject = make_subject(
            "pg+redis-fill-on-completion", redis_url=clean_redis, **TRANSACTION_MODE
        )
        response, trace = subject.counted("tx-cached-2")
        assert response.status_code == 201
        assert kinds(trace) == [
            "GET",
            "BEGIN+claim",
            "business INSERT",
            "insert completed+COMMIT",
            "SET",
        ]
        _again, trace = subject.counted("tx-cached-2")
        assert kinds(trace) == ["GET"]


@pytest.mark.skipif(find_spec("flask_sqlalchemy") is None, reason="needs Flask-SQLAlchemy")
@pytest.mark.parametrize(
    ("claim_mode", "first", "replay"),
    [
        (
            "row",
            [
                "claim",
                "BEGIN",
                "SAVEPOINT sa_savepoint_1",
                "business INSERT",
                "RELEASE SAVEPOINT sa_savepoint_1",
                "complete+COMMIT",
            ],
            ["claim"],
        ),
        (
            "transaction",
            [
                "BEGIN+claim",
                "SAVEPOINT sa_savepoint_1",
                "business INSERT",
                "RELEASE SAVEPOINT sa_savepoint_1",
                "insert completed+COMMIT",
            ],
            ["BEGIN+claim", "ROLLBACK"],
        ),
    ],
)
def test_on_db_session_a_first_request_adds_only_the_join_s_savepoint(
    clean_db: str,
    monkeypatch: pytest.MonkeyPatch,
    claim_mode: str,
    first: list[str],
    replay: list[str],
) -> None:
    """``Idempotency(app, db=db)``: the claim, the attempt's BEGIN (in transaction
    mode, the claim's), then SQLAlchemy's documented join: the session's transaction
    is a savepoint in the attempt's, its ``commit()`` releases it; the completion
    carries the COMMIT. Beyond the raw path's round trips, only the savepoint and
    its release; a replay is the claim alone (row mode)."""
    monkeypatch.setenv("BENCH_DATABASE_URL", clean_db)  # the engine's DSN
    prepare_database(clean_db, ["sqla-pg"])
    trace: Trace = []
    connection_class = type("Counting", (CountingConnection,), {"trace": trace})
    app = create_app(
        "sqla-pg",
        {
            "BENCH_CONNECT_ARGS": {"connection_factory": connection_class},
            "IDEMPOTENCY_LEASE_RENEW_INTERVAL": 0,
            "IDEMPOTENCY_CLAIM_MODE": claim_mode,
        },
    )
    subject = Subject(app, trace)
    try:
        assert subject.post("warm-up").status_code == 201
        response, counted = subject.counted("sqla-first-1")
        assert response.status_code == 201
        assert kinds(counted) == first
        replayed, counted = subject.counted("sqla-first-1")
        assert replayed.headers["Idempotent-Replayed"] == "true"
        assert kinds(counted) == replay
    finally:
        app.extensions["idempotency"].close()
        with app.app_context():
            app.extensions["sqlalchemy"].engine.dispose()
