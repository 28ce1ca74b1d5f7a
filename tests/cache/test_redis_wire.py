"""The cache's per-thread Redis connections (``flask_idempotency.cache.wire``)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import redis
import redis.connection
import redis.exceptions
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from flask_idempotency.cache.redis import client_from_url
from flask_idempotency.cache.wire import ThreadConnections, pack
from support.forking import in_forked_child
from support.servers import ThrowawayRedis

argument = st.one_of(
    st.binary(max_size=300), st.text(max_size=100), st.integers(-(2**63), 2**63 - 1)
)


@hypothesis_settings(max_examples=200, deadline=None)
@given(
    command=st.sampled_from(["GET", "SET", "DEL", "PING"]),
    args=st.lists(argument, max_size=6),
)
def test_pack_is_byte_for_byte_what_redis_py_sends(
    command: str, args: list[bytes | str | int]
) -> None:
    """(redis-py also splits a first argument with spaces into words; the cache
    always passes a command's words as separate arguments.)"""
    expected = b"".join(redis.connection.Connection().pack_command(command, *args))
    assert pack(command, *args) == expected


@pytest.fixture
def connections(clean_redis: str) -> Iterator[ThreadConnections]:
    client = client_from_url(clean_redis, 0.5)
    wire = ThreadConnections(client.connection_pool)
    try:
        yield wire
    finally:
        wire.close()
        client.close()


def _client_id(wire: ThreadConnections) -> int:
    return int(wire.execute("CLIENT", "ID"))


def test_each_thread_keeps_its_own_connection(connections: ThreadConnections) -> None:
    ids: list[int] = []

    def work() -> None:
        ids.extend([_client_id(connections), _client_id(connections)])

    threads = [threading.Thread(target=work) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    per_thread = [tuple(ids[i : i + 2]) for i in range(0, len(ids), 2)]
    assert all(first == second for first, second in per_thread), "a thread switched sockets"
    assert len({first for first, _ in per_thread}) == 3, "threads shared a socket"


def test_replies_and_errors_are_redis_pys(connections: ThreadConnections) -> None:
    assert connections.execute("SET", "wire:k", b"\x00\xffvalue", "PX", 60_000) == b"OK"
    assert connections.execute("GET", "wire:k") == b"\x00\xffvalue"
    assert connections.execute("GET", "wire:missing") is None
    assert connections.execute("DEL", "wire:k", "wire:missing") == 1
    before = _client_id(connections)
    with pytest.raises(redis.exceptions.ResponseError):
        connections.execute("HGET", "wire:k")  # wrong number of arguments
    assert _client_id(connections) == before, "an error reply leaves the socket in step"


def test_a_timeout_drops_the_socket_so_a_late_reply_is_never_read(clean_redis: str) -> None:
    client = client_from_url(clean_redis, 0.2)
    wire = ThreadConnections(client.connection_pool)
    try:
        wire.execute("SET", "wire:present", b"v")
        before = _client_id(wire)
        with pytest.raises(redis.exceptions.TimeoutError):
            wire.execute("BLPOP", "wire:empty-list", 1)  # answers after 1 s; we wait 0.2 s
        # Were the socket kept, this would read BLPOP's late reply instead of its own.
        assert wire.execute("GET", "wire:present") == b"v"
        assert _client_id(wire) != before
    finally:
        wire.close()
        client.close()


def test_a_restarted_redis_is_reached_again_after_reset() -> None:
    with ThrowawayRedis() as server:
        client = client_from_url(server.url, 0.5)
        wire = ThreadConnections(client.connection_pool)
        try:
            assert wire.execute("PING") == b"PONG"
            server.restart()
            with pytest.raises(redis.exceptions.ConnectionError):
                wire.execute("PING")  # the stale socket fails once, and is dropped
            assert wire.execute("PING") == b"PONG"
            before = _client_id(wire)
            wire.reset()  # what the cache does after a socket error: every thread reconnects
            assert _client_id(wire) != before
        finally:
            wire.close()
            client.close()


def test_a_forked_child_never_touches_its_parents_socket(connections: ThreadConnections) -> None:
    parent_id = _client_id(connections)

    def child() -> bool:
        own = _client_id(connections) != parent_id
        connections.close()  # must not shut down the parent's socket
        return own

    assert in_forked_child(child)
    assert _client_id(connections) == parent_id
