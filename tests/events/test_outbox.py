"""``idempotency.emit()``: an event exists exactly when its transaction commits.

Through Flask's test client on the run's PostgreSQL: a completed request writes
its events with the answer; a released, rolled-back or fenced attempt writes
none; a replay writes none again; ``transaction()`` and keyless routes settle
their events with their own rows. Then what ``purge`` removes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from flask import Flask

from flask_idempotency import digests
from flask_idempotency.events import outbox
from support.pg_query import query

from . import app as events_app

MakeApp = Callable[..., Flask]


def post(app: Flask, path: str, key: str | None = None, **body: Any) -> Any:
    headers = {"Idempotency-Key": key} if key else {}
    return app.test_client().post(path, json=body, headers=headers)


def events(url: str) -> list[tuple[Any, ...]]:
    return query(
        url,
        "SELECT id, record_key, derived_key, event_type, payload, published_at, attempts"
        " FROM idempotency_outbox ORDER BY seq",
    )


def counts(url: str) -> tuple[int, int]:
    things = query(url, "SELECT count(*) FROM ev_things")[0][0]
    emitted = query(url, "SELECT count(*) FROM idempotency_outbox")[0][0]
    print(f"rows={things} events={emitted}")
    return things, emitted


def test_a_completed_request_commits_its_events_and_a_replay_emits_none(
    make_events_app: MakeApp, clean_db: str
) -> None:
    app = make_events_app()
    first = post(app, "/things", "k-1", label="a", events=2)
    assert first.status_code == 201
    replay = post(app, "/things", "k-1", label="a", events=2)
    assert replay.status_code == 201 and replay.headers["Idempotent-Replayed"] == "true"
    assert counts(clean_db) == (1, 2)
    rows = events(clean_db)
    record = digests.record_key("tenant", "k-1")
    assert [r[0] for r in rows] == first.get_json()["events"]
    assert all(r[0].startswith("evt_") and len(r[0]) == 36 for r in rows)
    assert rows[0][0] != rows[1][0]
    assert {bytes(r[1]) for r in rows} == {record}
    assert {r[2] for r in rows} == {digests.derived_key(record, "events")}
    assert [r[4] for r in rows] == [{"label": "a", "n": 0}, {"label": "a", "n": 1}]
    assert all(r[3] == "thing.created" and r[5] is None and r[6] == 0 for r in rows)


@pytest.mark.parametrize(
    "body",
    [
        pytest.param({"status": 500}, id="released-5xx"),
        pytest.param({"status": 409}, id="released-not-stored-4xx"),
        pytest.param({"raise": True}, id="rolled-back-raise"),
        pytest.param({"steal": True}, id="fenced"),
    ],
)
def test_released_rolled_back_and_fenced_attempts_emit_nothing(
    make_events_app: MakeApp, clean_db: str, body: dict[str, Any]
) -> None:
    app = make_events_app()
    answer = post(app, "/things", "k-2", label="x", **body)
    assert answer.status_code in (500, 409)
    if body.get("steal"):
        assert answer.get_json()["error"]["code"] == "lease_lost"
    assert counts(clean_db) == (0, 0)


def test_a_retry_after_a_failed_attempt_emits_once(make_events_app: MakeApp, clean_db: str) -> None:
    app = make_events_app()
    assert post(app, "/things", "k-3", label="r", status=500).status_code == 500
    assert post(app, "/things", "k-3", label="r").status_code == 201
    assert counts(clean_db) == (1, 1)


def test_keyless_and_transaction_events_settle_with_their_rows(
    make_events_app: MakeApp, clean_db: str
) -> None:
    app = make_events_app()
    assert post(app, "/maybe", None, label="kept").status_code == 201
    assert post(app, "/maybe", None, label="gone", status=500).status_code == 500
    assert post(app, "/tx", None, label="tx").status_code == 201
    assert post(app, "/tx", None, label="tx-raised", **{"raise": True}).status_code == 500
    assert counts(clean_db) == (2, 2)
    rows = events(clean_db)
    # No record: no record key, no derived key, a random id.
    assert all(r[1] is None and r[2] is None and r[0].startswith("evt_") for r in rows)
    assert [r[4]["label"] for r in rows] == ["kept", "tx"]


def test_emit_refuses_bad_types_and_payloads_and_needs_a_transaction(
    make_events_app: MakeApp, clean_db: str
) -> None:
    app = make_events_app()
    for bad in ("has space", "", "x" * 256):
        with pytest.raises(ValueError):
            outbox.check_event_type(bad)
    assert post(app, "/things", "k-4", bad_payload=True).status_code == 500
    with app.app_context(), pytest.raises(RuntimeError):
        events_app.idempotency.emit("thing.created", {})
    assert counts(clean_db) == (0, 0)


def test_purge_deletes_published_events_past_their_expiry_only(
    make_events_app: MakeApp, clean_db: str
) -> None:
    app = make_events_app()
    for n in range(4):
        assert post(app, "/things", f"p-{n}", label=str(n)).status_code == 201
    ids = [r[0] for r in events(clean_db)]
    query(
        clean_db,
        "UPDATE idempotency_outbox SET published_at = now(), expires_at = now() - interval '1s'"
        " WHERE id = ANY(%s)",
        (ids[:2],),
    )
    # Pending, even though expired: never purged before it is published.
    query(
        clean_db,
        "UPDATE idempotency_outbox SET expires_at = now() - interval '1s' WHERE id = %s",
        (ids[2],),
    )
    runner = app.test_cli_runner()
    dry = runner.invoke(args=["idempotency", "purge", "--dry-run"])
    assert "2 published event(s) would be deleted" in dry.output
    started = time.monotonic()
    result = runner.invoke(args=["idempotency", "purge", "--batch-size", "1"])
    assert result.exit_code == 0, result.output
    assert "2 published event(s) deleted" in result.output
    assert [r[0] for r in events(clean_db)] == ids[2:]
    print(f"purged 2 of 4 events in {time.monotonic() - started:.3f} s")
