"""``IDEMPOTENCY_DATABASE_URL = "memory://"``: what only the in-memory store has to
prove (the contract tests themselves run on it through ``each_store``): real
threads, a real TTL, no database to hand out, one process only."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from flask import Flask, jsonify
from flask_sqlalchemy import SQLAlchemy

from flask_idempotency import Idempotency, global_scope
from flask_idempotency.cache import ResponseCache
from flask_idempotency.store.base import Claimed, StoredResponse
from flask_idempotency.store.memory import SWEEP_EVERY, MemoryStore
from flask_idempotency.store.one_process import MultiProcessError
from flask_idempotency.testing.live_server import LiveServer
from support import core_app
from support.core_app import CLIENT_AUTHORIZATION, MEMORY_URL
from support.forking import in_forked_child
from support.gunicorn_server import GunicornServer
from support.http_client import HttpResponse, http_request

MakeApp = Callable[..., Flask]
GunicornFactory = Callable[..., GunicornServer]

#: The core app on the memory store, as gunicorn loads it.
CORE_APP_IN_MEMORY = f"support.core_app:create_app({MEMORY_URL!r})"


@pytest.fixture
def make_app() -> Iterator[MakeApp]:
    """Factory: the core test app (support/core_app.py) on memory://."""
    apps: list[Flask] = []

    def make(**config: Any) -> Flask:
        apps.append(core_app.create_app(MEMORY_URL, config))
        return apps[-1]

    yield make
    for app in apps:
        app.extensions["idempotency"].close()


@pytest.fixture
def memory_app() -> Iterator[Callable[..., Flask]]:
    """Factory: a small app on memory:// with one counting route."""
    apps: list[Flask] = []

    def make(**config: Any) -> Flask:
        app = Flask("memory_app")
        app.config.update(
            IDEMPOTENCY_DATABASE_URL=MEMORY_URL, IDEMPOTENCY_SCOPE_FUNC=global_scope, **config
        )
        idempotency = Idempotency(app)
        app.extensions["runs"] = runs = []

        @app.post("/charges")
        @idempotency.required
        def charges() -> Any:
            runs.append(1)
            return jsonify(run=len(runs)), 201

        @app.post("/writes")
        @idempotency.required
        def writes() -> Any:
            idempotency.connection()
            return jsonify(ok=True), 201

        apps.append(app)
        return app

    yield make
    for app in apps:
        app.extensions["idempotency"].close()


def storm(url: str, key: str, body: dict[str, Any], clients: int) -> list[HttpResponse]:
    """``clients`` threads released at once by a barrier, all with the same key."""
    barrier = threading.Barrier(clients)
    results: list[HttpResponse] = []
    lock = threading.Lock()

    def client() -> None:
        barrier.wait()
        response = http_request(
            "POST",
            url + "/charges",
            {"Idempotency-Key": key, "Authorization": CLIENT_AUTHORIZATION},
            json=body,
            timeout=30,
        )
        with lock:
            results.append(response)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return results


def assert_ran_once(first: list[HttpResponse], second: list[HttpResponse], url: str) -> None:
    """The storms' answers say the view ran once; so does the core app's row counter
    (one row per execution), read through the next new key's answer."""
    statuses = Counter(r.status for r in first)
    assert set(statuses) <= {201, 409}, statuses
    assert statuses[201] >= 1
    assert all(b'"in_progress"' in r.body for r in first if r.status == 409)
    assert all(r.status == 201 for r in second)
    assert all(r.headers["Idempotent-Replayed"] == "true" for r in second)
    assert len({r.body for r in first + second if r.status == 201}) == 1
    after = http_request(
        "POST",
        url + "/charges",
        {"Idempotency-Key": "after", "Authorization": CLIENT_AUTHORIZATION},
        json={},
        timeout=30,
    )
    assert json.loads(after.body)["row"] == 2, "the storms' view ran more than once"


def test_concurrent_duplicates_on_a_threaded_server_run_the_view_once(
    make_app: MakeApp,
) -> None:
    app = make_app()
    with LiveServer(app) as server:
        first = storm(server.url, "storm", {"sleep": 0.5}, clients=40)
        second = storm(server.url, "storm", {"sleep": 0.5}, clients=20)
        assert_ran_once(first, second, server.url)
    assert app.extensions["runs"] == ["charges", "charges"]


def test_many_threads_many_keys_each_run_once(make_app: MakeApp) -> None:
    app = make_app()
    keys = [f"key-{i}" for i in range(25)]
    statuses: dict[str, list[int]] = {key: [] for key in keys}
    barrier = threading.Barrier(len(keys) * 4)

    def client(key: str) -> None:
        barrier.wait()
        response = app.test_client().post(
            "/charges", json={"k": key, "sleep": 0.05}, headers={"Idempotency-Key": key}
        )
        statuses[key].append(response.status_code)

    threads = [threading.Thread(target=client, args=(key,)) for key in keys for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert sorted(app.extensions["runs"]) == ["charges"] * len(keys)
    assert all(201 in found and set(found) <= {201, 409} for found in statuses.values())


def test_a_record_expires_after_its_ttl(memory_app: Callable[..., Flask]) -> None:
    app = memory_app(IDEMPOTENCY_TTL=1, IDEMPOTENCY_LEASE=0.5)
    client = app.test_client()
    first = client.post("/charges", json={}, headers={"Idempotency-Key": "k"})
    assert client.post("/charges", json={}, headers={"Idempotency-Key": "k"}).data == first.data
    time.sleep(1.2)
    again = client.post("/charges", json={"other": 1}, headers={"Idempotency-Key": "k"})
    assert again.status_code == 201  # a different request: the old record is gone
    assert again.headers["Idempotent-Replayed"] == "false"
    assert app.extensions["runs"] == [1, 1]


def test_connection_says_memory_has_no_database(memory_app: Callable[..., Flask]) -> None:
    app = memory_app()
    app.testing = True  # the view's exception reaches the test
    with pytest.raises(RuntimeError, match="memory://: there is no database connection"):
        app.test_client().post("/writes", json={}, headers={"Idempotency-Key": "k"})
    # Nothing was stored: a retry runs the view again (and fails the same way).
    with pytest.raises(RuntimeError, match="memory://"):
        app.test_client().post("/writes", json={}, headers={"Idempotency-Key": "k"})
    with app.app_context(), pytest.raises(RuntimeError, match="memory://"):
        with app.extensions["idempotency"].store.transaction():
            pass  # pragma: no cover


def test_db_is_refused_with_memory() -> None:
    app = Flask("with_db")
    app.config.update(
        IDEMPOTENCY_DATABASE_URL=MEMORY_URL, SQLALCHEMY_DATABASE_URI="sqlite:///:memory:"
    )
    db = SQLAlchemy(app)
    with pytest.raises(ValueError, match="remove IDEMPOTENCY_DATABASE_URL"):
        Idempotency(app, db=db)


def test_redis_settings_are_unused_with_memory(
    memory_app: Callable[..., Flask], redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    app = memory_app(IDEMPOTENCY_REDIS_URL=redis_url)
    assert type(app.extensions["idempotency"].cache) is ResponseCache  # no cache: no Redis
    assert "memory:// keeps no Redis cache" in caplog.text


def test_a_forked_child_refuses_the_parents_store(memory_app: Callable[..., Flask]) -> None:
    app = memory_app()
    store = app.extensions["idempotency"].store
    assert isinstance(store, MemoryStore)
    store.ping()

    def refused() -> bool:
        try:
            store.begin()
        except MultiProcessError as exc:
            return "is used in process" in str(exc) and "\n" not in str(exc)
        return False

    assert in_forked_child(refused)
    store.begin()  # the parent's own store still works


def test_the_cli_has_nothing_to_maintain(memory_app: Callable[..., Flask]) -> None:
    app = memory_app()
    for command in ("purge", "stats", "doctor", "migrate"):
        result = app.test_cli_runner().invoke(args=["idempotency", command])
        assert result.exit_code == 0, result.output
        assert result.output.strip().splitlines() == [
            "IDEMPOTENCY_DATABASE_URL is memory://: the records live in the serving "
            f"process's memory and go with it; `flask idempotency {command}` has nothing "
            "to maintain"
        ]


@pytest.mark.parametrize("preload", [False, True], ids=["per-worker", "preload"])
def test_gunicorn_with_two_workers_refuses_in_one_line(
    gunicorn_server: GunicornFactory, preload: bool
) -> None:
    """Each worker refuses as it loads the app (or, with --preload, the master does):
    gunicorn stops with the reason in one line of its log."""
    with pytest.raises(RuntimeError, match="gunicorn exited") as failed:
        gunicorn_server(
            CORE_APP_IN_MEMORY,
            workers=2,
            worker_class="gthread",
            threads=4,
            extra_args=["--preload"] if preload else [],
        )
    message = (
        "IDEMPOTENCY_DATABASE_URL = memory:// keeps the records in one process, but gunicorn "
        "runs 2 worker processes (a retry reaching another one would run again): run one "
        "worker process (gunicorn --workers 1 --threads N) or use a PostgreSQL URL"
    )
    lines = str(failed.value).splitlines()
    assert any(line.strip().endswith(message) for line in lines), lines


@pytest.mark.parametrize("preload", [False, True], ids=["per-worker", "preload"])
def test_gunicorn_with_one_threaded_worker_serves(
    gunicorn_server: GunicornFactory, preload: bool
) -> None:
    server = gunicorn_server(
        CORE_APP_IN_MEMORY,
        workers=1,
        worker_class="gthread",
        threads=16,
        extra_args=["--preload"] if preload else [],
    )
    first = storm(server.url, "storm", {"sleep": 0.5}, clients=30)
    second = storm(server.url, "storm", {"sleep": 0.5}, clients=10)
    assert_ran_once(first, second, server.url)


def test_expired_records_are_swept_without_any_command() -> None:
    """A development server runs for days and no command reaches its memory: claims
    forget expired records now and then, so the store does not grow for ever."""
    store = MemoryStore()
    for n in range(SWEEP_EVERY - 1):
        store.begin().claim(b"old-%d" % n, b"fp", lease=1, ttl=1)
    store.advance(2)
    assert store.stats()["expired"] == SWEEP_EVERY - 1
    store.begin().claim(b"new", b"fp", lease=1, ttl=1)  # the claim that sweeps
    assert store.stats() == {"processing": 1, "completed": 0, "expired": 0}


def test_a_records_ttl_counts_from_its_claim_unless_the_view_was_slow() -> None:
    """As PostgreSQL's completion (migration 0009): a fast view keeps the claim's
    expiry; one slower than a tenth of the TTL stores an answer that lives nine
    tenths of the TTL from its completion."""
    answer = StoredResponse(201, (), b"{}")
    for view_seconds, lives in ((1.0, 3600 - 1.0), (50 * 60.0, 0.9 * 3600)):
        store = MemoryStore()
        handle = store.begin()
        claimed = handle.claim(b"k", b"fp", lease=30, ttl=3600)
        assert isinstance(claimed, Claimed)
        store.advance(view_seconds)
        handle.complete(b"k", claimed.token, answer)
        store.advance(lives - 0.5)
        assert store.stats() == {"processing": 0, "completed": 1, "expired": 0}, view_seconds
        store.advance(1.0)
        assert store.stats() == {"processing": 0, "completed": 0, "expired": 1}, view_seconds


def test_a_second_init_app_on_one_app_is_refused_before_anything_is_built() -> None:
    app = Flask(__name__)
    app.config["IDEMPOTENCY_DATABASE_URL"] = MEMORY_URL
    Idempotency(app)
    state = app.extensions["idempotency"]
    try:
        with pytest.raises(RuntimeError, match="already initialised"):
            Idempotency(app)
        assert app.extensions["idempotency"] is state
    finally:
        state.close()
