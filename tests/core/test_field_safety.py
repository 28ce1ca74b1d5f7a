"""Holes a user's own app found outside the project's test configuration.

Each test builds the small app a payments team would write, and pins one
promise: a raise is never stored, nested decorated views never wedge a key,
an optional route without a key still gets a transaction, streamed answers
are stored whole or not at all, per-route TTLs and leases are checked, a slow
view is never taken over or purged, and a waiting duplicate holds no pool slot.
"""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg2
import pytest
from flask import Flask, Response, g, jsonify, request, send_file, stream_with_context
from werkzeug.test import TestResponse

from flask_idempotency import Idempotency
from flask_idempotency.route_options import RouteOptions
from support.waiting import wait_until

AUTH = {"Authorization": "Bearer field-user"}
TABLE = "CREATE TABLE IF NOT EXISTS field_rows (id bigserial PRIMARY KEY, label text NOT NULL)"


class Declined(Exception):
    """Raised by a view; an error handler renders it as a storable 402."""


def sql(dsn: str, query: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    conn = psycopg2.connect(dsn)
    try:
        with conn, conn.cursor() as cur:
            cur.execute(query, params)
            return cur.fetchall() if cur.description else []
    finally:
        conn.close()


def count(dsn: str, table: str) -> int:
    [(n,)] = sql(dsn, f"SELECT count(*) FROM {table}")
    return int(n)


MakeApp = Callable[..., tuple[Flask, Idempotency]]


@pytest.fixture
def make_field_app(clean_db: str) -> Iterator[MakeApp]:
    """``make_field_app(**IDEMPOTENCY_config)`` -> (app, idempotency), closed at teardown."""
    sql(clean_db, TABLE)
    sql(clean_db, "TRUNCATE field_rows")
    made: list[Flask] = []

    def make(**config: Any) -> tuple[Flask, Idempotency]:
        app = Flask("field_app")
        app.config.update(
            IDEMPOTENCY_DATABASE_URL=clean_db, IDEMPOTENCY_AUTO_MIGRATE=True, **config
        )
        idempotency = Idempotency(app)
        app.extensions["runs"] = []
        made.append(app)

        def write_row(label: str) -> None:
            app.extensions["runs"].append(label)
            with idempotency.connection().cursor() as cur:
                cur.execute("INSERT INTO field_rows (label) VALUES (%s)", (label,))

        @app.errorhandler(Declined)
        def declined(_: Declined) -> tuple[Response, int]:
            return jsonify(error="card_declined"), 402

        @app.post("/declines-by-raising")
        @idempotency.required
        def declines_by_raising() -> Response:
            write_row("raised")
            raise Declined()

        @idempotency.required
        def inner() -> Response:
            write_row("inner")
            return jsonify(inner=True)

        @app.post("/outer")
        @idempotency.required
        def outer() -> tuple[Response, int]:
            write_row("outer")
            inner_answer = inner()
            return jsonify(outer=True, inner=inner_answer.get_json()), 201

        @app.post("/optional")
        @idempotency.optional
        def optional() -> tuple[Response, int]:
            body = request.get_json()
            write_row("optional")
            return jsonify(ok=True), int(body.get("status", 201))

        @app.post("/optional-raises")
        @idempotency.optional
        def optional_raises() -> Response:
            write_row("optional-raises")
            raise RuntimeError("the view failed")

        @app.post("/stream/generator")
        @idempotency.required
        def stream_generator() -> Response:
            write_row("generator")
            size = int(request.get_json()["size"])
            return Response((b"x" * 100 for _ in range(size // 100)), 201)

        @app.post("/stream/with-context")
        @idempotency.required
        def stream_context() -> Response:
            write_row("with-context")
            g.label = "ctx"

            def body() -> Iterator[str]:
                yield f"label={g.label};"
                yield f"path={request.path}"

            return Response(stream_with_context(body()), 201, mimetype="text/plain")

        @app.post("/stream/fails")
        @idempotency.required
        def stream_fails() -> Response:
            write_row("fails")

            def body() -> Iterator[bytes]:
                yield b"start"
                raise RuntimeError("the stream broke")

            return Response(body(), 201)

        @app.post("/stream/file")
        @idempotency.required
        def stream_file() -> Response:
            write_row("file")
            size = int(request.get_json()["size"])
            return send_file(io.BytesIO(b"f" * size), mimetype="application/pdf")

        @app.post("/slow")
        @idempotency.required(ttl=1.5, lease=1.0)
        def slow() -> Response:
            write_row("slow")
            if request.get_json().get("gated"):
                app.extensions["gate"].wait(10)
            return jsonify(done=True)

        @app.post("/gated")
        @idempotency.required(wait=10)
        def gated() -> Response:
            write_row("gated")
            app.extensions["gate"].wait(10)
            return jsonify(done=True)

        return app, idempotency

    yield make
    for app in made:
        app.extensions["idempotency"].close()


def post(app: Flask, path: str, body: Any, key: str | None = "k") -> TestResponse:
    headers = dict(AUTH)
    if key is not None:
        headers["Idempotency-Key"] = key
    return app.test_client().post(path, json=body, headers=headers)


def test_a_raise_rendered_as_402_is_not_stored_and_keeps_no_writes(
    make_field_app: MakeApp, clean_db: str
) -> None:
    app, _ = make_field_app()
    first = post(app, "/declines-by-raising", {})
    assert first.status_code == 402
    assert count(clean_db, "field_rows") == 0
    assert count(clean_db, "idempotency_records") == 0
    again = post(app, "/declines-by-raising", {})
    assert again.status_code == 402
    assert again.headers["Idempotent-Replayed"] == "false"
    assert app.extensions["runs"] == ["raised", "raised"]


def test_a_decorated_view_called_from_another_runs_inside_the_outer_claim(
    make_field_app: MakeApp, clean_db: str
) -> None:
    app, _ = make_field_app(IDEMPOTENCY_DATABASE_OPTIONS={"pool_size": 2, "pool_timeout": 1})
    # More requests than pool slots: a wedged claim would hold its slot for ever.
    for n in range(5):
        response = post(app, "/outer", {}, key=f"outer-{n}")
        assert response.status_code == 201, response.data
        assert response.get_json() == {"outer": True, "inner": {"inner": True}}
    assert count(clean_db, "field_rows") == 10
    [(state, n)] = sql(clean_db, "SELECT state, count(*) FROM idempotency_records GROUP BY 1")
    assert (state, n) == ("completed", 5)
    replay = post(app, "/outer", {}, key="outer-0")
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert app.extensions["idempotency"].keeper.held() == []


def test_optional_route_without_a_key_gets_a_committed_transaction(
    make_field_app: MakeApp, clean_db: str
) -> None:
    app, _ = make_field_app()
    assert post(app, "/optional", {}, key=None).status_code == 201
    assert post(app, "/optional", {}, key=None).status_code == 201
    assert count(clean_db, "field_rows") == 2
    # An answer that would not have been stored keeps no writes, as with a key.
    assert post(app, "/optional", {"status": 400}, key=None).status_code == 400
    assert post(app, "/optional-raises", {}, key=None).status_code == 500
    assert count(clean_db, "field_rows") == 2
    assert count(clean_db, "idempotency_records") == 0


@pytest.mark.parametrize("size", [1000, 100_000])
def test_a_generator_answer_is_buffered_stored_and_replayed(
    make_field_app: MakeApp, size: int
) -> None:
    app, _ = make_field_app()
    first = post(app, "/stream/generator", {"size": size})
    assert first.status_code == 201
    assert first.data == b"x" * size
    assert first.headers["Content-Length"] == str(size)
    replay = post(app, "/stream/generator", {"size": size})
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert replay.data == first.data
    assert app.extensions["runs"] == ["generator"]


def test_stream_with_context_and_send_file_are_stored(make_field_app: MakeApp) -> None:
    app, _ = make_field_app()
    first = post(app, "/stream/with-context", {})
    assert first.data == b"label=ctx;path=/stream/with-context"
    assert post(app, "/stream/with-context", {}).data == first.data
    pdf = post(app, "/stream/file", {"size": 5000}, key="file")
    assert pdf.status_code == 200 and pdf.data == b"f" * 5000
    replay = post(app, "/stream/file", {"size": 5000}, key="file")
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert replay.data == pdf.data
    assert replay.headers["Content-Type"] == "application/pdf"


def test_streams_over_the_limit_or_broken_release_the_claim_and_the_slot(
    make_field_app: MakeApp, clean_db: str
) -> None:
    app, _ = make_field_app(
        IDEMPOTENCY_MAX_STORED_BODY=10_000,
        IDEMPOTENCY_OVERSIZE="reject",
        IDEMPOTENCY_DATABASE_OPTIONS={"pool_size": 1, "pool_timeout": 1},
    )
    for n in range(3):  # more than the pool's one slot: a leak would show as a 503
        too_big = post(app, "/stream/generator", {"size": 50_000}, key=f"big-{n}")
        assert too_big.status_code == 500
        assert too_big.get_json()["error"]["code"] == "response_too_large"
        big_file = post(app, "/stream/file", {"size": 50_000}, key=f"file-{n}")
        assert big_file.status_code == 500
        assert post(app, "/stream/fails", {}, key=f"fails-{n}").status_code == 500
    assert count(clean_db, "idempotency_records") == 0
    assert count(clean_db, "field_rows") == 0
    assert post(app, "/stream/generator", {"size": 500}, key="fits").status_code == 201


def test_an_oversized_stream_flows_whole_and_is_stored_without_its_body(
    make_field_app: MakeApp, clean_db: str
) -> None:
    app, _ = make_field_app(IDEMPOTENCY_MAX_STORED_BODY=10_000)
    first = post(app, "/stream/generator", {"size": 50_000})
    assert (first.status_code, first.data) == (201, b"x" * 50_000)
    pdf = post(app, "/stream/file", {"size": 50_000}, key="file")
    assert pdf.data == b"f" * 50_000
    retry = post(app, "/stream/generator", {"size": 50_000})
    assert (retry.status_code, retry.data) == (201, b"")
    assert retry.headers["Idempotency-Body-Omitted"] == "true"
    pdf_retry = post(app, "/stream/file", {"size": 50_000}, key="file")
    assert (pdf_retry.status_code, pdf_retry.data) == (200, b"")
    assert pdf_retry.headers["Content-Type"] == "application/pdf"
    assert app.extensions["runs"] == ["generator", "file"]
    assert count(clean_db, "field_rows") == 2


def test_route_options_are_checked_when_applied_and_against_the_app() -> None:
    idempotency = Idempotency()
    cases: list[tuple[dict[str, Any], str]] = [
        ({"ttl": 0}, "ttl= must be positive"),
        ({"lease": -1}, "lease= must be positive"),
        ({"wait": float("nan")}, "wait= must be 0 or more"),
        ({"ttl": 10, "lease": 20}, "must not exceed"),
        ({"ttl": "10"}, "number of seconds"),
        ({"oversize": "truncate"}, "oversize= must be one of"),
    ]
    for options, message in cases:
        with pytest.raises(ValueError, match=message):
            idempotency.required(**options)


def test_a_route_ttl_shorter_than_the_app_lease_fails_before_claiming(
    make_field_app: MakeApp, clean_db: str
) -> None:
    app, idempotency = make_field_app()  # the app's lease: 30 s

    @app.post("/short")
    @idempotency.required(ttl=10)
    def short() -> Response:
        return jsonify(ran=True)

    response = post(app, "/short", {})
    assert response.status_code == 500
    assert count(clean_db, "idempotency_records") == 0
    with pytest.raises(ValueError, match="must be at least its lease"):
        app.extensions["idempotency"].options_for(RouteOptions(True, ttl=10))
    with pytest.raises(ValueError, match="longer than the app's IDEMPOTENCY_LEASE_RENEW"):
        app.extensions["idempotency"].options_for(RouteOptions(True, ttl=10, lease=5))


def test_a_view_slower_than_its_ttl_is_neither_taken_over_nor_purged(
    make_field_app: MakeApp, clean_db: str
) -> None:
    app, _ = make_field_app(IDEMPOTENCY_LEASE_RENEW_INTERVAL=0.25)
    app.extensions["gate"] = threading.Event()
    result: list[TestResponse] = []
    slow = threading.Thread(target=lambda: result.append(post(app, "/slow", {"gated": 1})))
    slow.start()
    wait_until(lambda: app.extensions["runs"], 5, "the view to start")
    # Past the route's 1.5 s TTL while the view still runs: each renewal must carry
    # the record's expiry along with its lease.
    sql(clean_db, "UPDATE idempotency_records SET expires_at = now() - interval '1 second'")
    wait_until(
        lambda: sql(clean_db, "SELECT expires_at > now() FROM idempotency_records") == [(True,)],
        5,
        "a renewal to move the record's expiry past now",
    )
    other_body = post(app, "/slow", {})
    assert other_body.status_code == 422, other_body.data
    runner = app.test_cli_runner()
    purged = runner.invoke(args=["idempotency", "purge"])
    assert "0 expired record(s) deleted" in purged.output
    app.extensions["gate"].set()
    slow.join(10)
    assert result[0].status_code == 200
    replay = post(app, "/slow", {"gated": 1})
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert app.extensions["runs"] == ["slow"]


def test_waiting_duplicates_hold_no_pool_slot_while_they_sleep(
    make_field_app: MakeApp, clean_db: str
) -> None:
    app, _ = make_field_app(IDEMPOTENCY_DATABASE_OPTIONS={"pool_size": 2, "pool_timeout": 0.5})
    app.extensions["gate"] = threading.Event()
    answers: list[TestResponse] = []

    def send() -> None:
        answers.append(post(app, "/gated", {}, key="gated"))

    holder = threading.Thread(target=send)
    holder.start()
    wait_until(lambda: app.extensions["runs"], 5, "the holder to be in its view")
    waiters = [threading.Thread(target=send) for _ in range(4)]
    for waiter in waiters:
        waiter.start()
    time.sleep(0.5)  # the waiters poll the claim, each giving its slot back to sleep
    # The holder has one slot; another request must still find the second.
    other = post(app, "/optional", {}, key="other")
    assert other.status_code == 201, other.data
    app.extensions["gate"].set()
    for thread in [holder, *waiters]:
        thread.join(15)
    assert sorted(a.status_code for a in answers) == [200] * 5
    assert sorted(a.headers["Idempotent-Replayed"] for a in answers) == ["false"] + ["true"] * 4
    assert app.extensions["runs"].count("gated") == 1
