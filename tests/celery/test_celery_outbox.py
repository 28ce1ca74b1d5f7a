"""The events outbox into Celery: a charge emitted by a view reaches its task once.

The view (tests/events/app.py) writes a row and emits ``thing.created`` in the
transaction that stores its answer; the relay publishes it with
:class:`~flask_idempotency.celery.TaskPublisher` as a ``ct.record_event`` task
under the event id; the relay then "dies" before marking it published and
publishes it again. The task's effect exists once, and both copies answer
with the stored result.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from typing import Any

import pytest
from celery_harness import *  # noqa: F403  (the fixtures, used by name)
from celery_harness import wait_for_rows
from events import app as events_app
from flask import Flask

from flask_idempotency.celery import TaskPublisher
from flask_idempotency.events import Relay
from flask_idempotency.events.outbox import OutboxEvent
from support.pg_query import query


@pytest.fixture
def view_app(clean_db: str) -> Iterator[Flask]:
    app = events_app.create_app(clean_db)
    yield app
    app.extensions["idempotency"].close()


def test_an_event_emitted_by_a_view_reaches_its_celery_task_exactly_once(
    view_app: Flask, celery_worker: Any, celery_client: Any, clean_db: str
) -> None:
    celery_worker(concurrency=2)
    client = view_app.test_client()
    key = "k_" + secrets.token_hex(4)
    first = client.post("/things", json={"label": "a"}, headers={"Idempotency-Key": key})
    replay = client.post("/things", json={"label": "a"}, headers={"Idempotency-Key": key})
    assert first.status_code == 201 and replay.headers["Idempotent-Replayed"] == "true"
    (event_id,) = first.get_json()["events"]  # the replay emitted nothing

    store = view_app.extensions["idempotency"].store
    publisher = TaskPublisher(celery_client, {"thing.created": "ct.record_event"})
    assert Relay(store, publisher).run(once=True).published == 1
    # The relay died after the broker's confirm, before its commit: published again.
    query(clean_db, "UPDATE idempotency_outbox SET published_at = NULL")
    assert Relay(store, publisher).run(once=True).published == 1

    value = celery_client.AsyncResult(event_id).get(timeout=30)
    done = wait_for_rows(
        clean_db,
        "SELECT count(*) FROM ct_deliveries WHERE key = %s AND state = 'SUCCESS'",
        (event_id,),
        2,
    )
    effects = query(clean_db, "SELECT attempt FROM ct_effects WHERE key = %s", (event_id,))
    print(f"deliveries {done}; effects {effects}; result {value}")
    assert done == 2
    assert effects == [(1,)]
    assert value == {"event": event_id, "data": {"label": "a", "n": 0}, "attempt": 1}


def test_an_event_type_without_a_task_is_left_to_the_relay_to_defer(
    celery_client: Any,
) -> None:
    publisher = TaskPublisher(celery_client, {"thing.created": "ct.record_event"})
    event = OutboxEvent("evt_x", "thing.deleted", "{}", None, 0, 0)
    try:
        assert publisher.publish(event) is False
    finally:
        publisher.close()
