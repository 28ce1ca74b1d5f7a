"""A worker replays from Redis through a PostgreSQL outage that began before its
first request.

The cache's entries are sealed with a key derived from the database's identity,
which lives in PostgreSQL. Read lazily, a worker whose first request came during
an outage could not open any entry, and answered 503 where the contract asks for
a Redis replay ("while PostgreSQL is down, every route but a Redis replay answers
503"). It is read when the app starts, while PostgreSQL answers.
"""

from __future__ import annotations

from typing import Any

from support import core_app
from support.dead_store import make_unreachable

CONFIG = {"IDEMPOTENCY_REDIS_OPTIONS": {"fill": "completion"}}


def _post(app: Any, key: str) -> Any:
    return app.test_client().post("/charges", json={"amount": 1}, headers={"Idempotency-Key": key})


def test_a_worker_whose_first_request_meets_an_outage_replays_from_redis(
    clean_db: str, clean_redis: str
) -> None:
    config = {**CONFIG, "IDEMPOTENCY_REDIS_URL": clean_redis}
    first = core_app.create_app(clean_db, config)  # one worker serves the first request
    second = core_app.create_app(clean_db, config)  # another starts, serves nothing yet
    try:
        answer = _post(first, "k-outage")
        assert answer.status_code == 201
        make_unreachable(second)  # PostgreSQL is gone before its first request
        replay = _post(second, "k-outage")
        assert replay.status_code == 201, replay.get_data(as_text=True)
        assert replay.headers["Idempotent-Replayed"] == "true"
        assert replay.get_data() == answer.get_data()
        new_key = _post(second, "k-new")
        assert new_key.status_code == 503  # the store decides a new key: fail closed
    finally:
        first.extensions["idempotency"].close()
        second.extensions["idempotency"].close()
