"""Both releases on one Redis: what one caches never breaks the other. An entry the
other release cannot read (another format, another secret) is a miss that goes
to PostgreSQL; either way the client gets the stored answer, byte for byte."""

from __future__ import annotations

import pytest
import redis

from support.databases import flush_redis
from support.waiting import wait_until

from .answers import assert_replays
from .rollout import Stack, new_key
from .test_replay import DIRECTIONS, _servers


def _cached_entries(redis_url: str) -> int:
    client = redis.Redis.from_url(redis_url)
    try:
        return int(client.dbsize())
    finally:
        client.close()


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_an_answer_cached_by_one_release_replays_on_the_other(
    redis_stack: Stack, redis_url: str, direction: str
) -> None:
    stack = redis_stack
    writer, reader = _servers(stack, direction)
    flush_redis(redis_url)
    key = new_key()
    body = {"amount": 1234, "note": "cached ✓"}
    first = writer.charge(key, body)
    assert first.status == 201, first
    # The writer's replay is what fills the cache (or its completion did already).
    assert_replays(writer.charge(key, body), first)
    wait_until(
        lambda: _cached_entries(redis_url) > 0, 10, f"the {writer.release.name} release to cache"
    )

    for _ in range(2):  # the second may read what the reader cached itself
        assert_replays(reader.charge(key, body), first)
    for _ in range(2):  # and the writer, what the reader may have written over its entry
        assert_replays(writer.charge(key, body), first)
    assert stack.runs(key) == [writer.release.name]
