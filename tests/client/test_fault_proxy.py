"""The proxy's per-request faults (``TcpProxy.inject``), on real sockets.

The storms trust the proxy to fail exactly the requests its schedule names, in
the way it names: a request that never reached the server, or one the server
answered and the client never heard. These pin that down against a tiny HTTP/1.1
upstream that counts what reached it, before anything else stands on it.
"""

from __future__ import annotations

import contextlib
import http.client
import time
from collections.abc import Iterator

import pytest

from support.scripted_http import Answer, ScriptedServer, Seen
from support.tcp_proxy import Fault, ScriptedFaults, TcpProxy
from support.waiting import wait_until

#: Long enough that a client would wait it out, short enough for a unit test.
HOLD_SECONDS = 0.5
#: Much longer than any hold here: a client that fails, fails on the proxy's reset.
CLIENT_TIMEOUT = 10.0


def echo(seen: Seen) -> Answer:
    return Answer(200, b"got " + seen.body, {})


@pytest.fixture
def upstream() -> Iterator[ScriptedServer]:
    """A real HTTP/1.1 server (keep-alive) that answers ``got <body>``."""
    with ScriptedServer(default=echo) as server:
        yield server


def bodies(server: ScriptedServer) -> list[bytes]:
    """The bodies of the requests that reached the server, in order."""
    return [seen.body for seen in server.seen]


@pytest.fixture
def echo_proxy(upstream: ScriptedServer) -> Iterator[TcpProxy]:
    with TcpProxy(upstream.host, upstream.port) as proxy:
        yield proxy


@contextlib.contextmanager
def reset_by_peer() -> Iterator[None]:
    """Expect a TCP RST. A FIN would be http.client's ``RemoteDisconnected``, a
    subclass of ConnectionResetError, so the type is checked exactly."""
    with pytest.raises(ConnectionResetError) as caught:
        yield
    assert type(caught.value) is ConnectionResetError, repr(caught.value)


def connect(proxy: TcpProxy) -> http.client.HTTPConnection:
    return http.client.HTTPConnection(proxy.host, proxy.port, timeout=CLIENT_TIMEOUT)


def post(conn: http.client.HTTPConnection, body: bytes) -> bytes:
    conn.request("POST", "/", body=body)
    with conn.getresponse() as response:
        return response.read()


def post_once(proxy: TcpProxy, body: bytes) -> bytes:
    """``body`` POSTed on a connection of its own, closed afterwards."""
    with contextlib.closing(connect(proxy)) as conn:
        return post(conn, body)


def test_without_faults_requests_pass_and_each_is_scheduled_once(
    echo_proxy: TcpProxy, upstream: ScriptedServer
) -> None:
    script = ScriptedFaults()
    echo_proxy.inject(script)
    conn = connect(echo_proxy)
    try:
        # Three requests on one keep-alive connection, the last with its body sent
        # in a later packet than its headers: still one request.
        assert post(conn, b"a") == b"got a"
        assert post(conn, b"b") == b"got b"
        conn.putrequest("POST", "/")
        conn.putheader("Content-Length", "1")
        conn.endheaders()
        time.sleep(0.1)  # so the echo_proxy reads the head alone, then the body
        conn.send(b"c")
        with conn.getresponse() as response:
            assert response.read() == b"got c"
    finally:
        conn.close()
    assert post_once(echo_proxy, b"d") == b"got d"  # a second connection
    assert script.calls == 4
    assert bodies(upstream) == [b"a", b"b", b"c", b"d"]
    assert echo_proxy.faults == {}


def test_reset_before_never_reaches_the_server(
    echo_proxy: TcpProxy, upstream: ScriptedServer
) -> None:
    echo_proxy.inject(ScriptedFaults(Fault.RESET_BEFORE))
    with reset_by_peer():
        post_once(echo_proxy, b"lost")
    assert post_once(echo_proxy, b"next") == b"got next"
    assert bodies(upstream) == [b"next"]
    assert echo_proxy.faults == {Fault.RESET_BEFORE: 1}


def test_drop_after_lets_the_server_act_and_resets_the_client(
    echo_proxy: TcpProxy, upstream: ScriptedServer
) -> None:
    echo_proxy.inject(ScriptedFaults(None, Fault.DROP_AFTER))
    conn = connect(echo_proxy)
    try:
        assert post(conn, b"first") == b"got first"
        # The second request on the same connection: a fault per request, not per link.
        with reset_by_peer():
            post(conn, b"acted")
    finally:
        conn.close()
    assert bodies(upstream) == [b"first", b"acted"]
    assert echo_proxy.faults == {Fault.DROP_AFTER: 1}


def test_hold_keeps_the_answer_then_resets(echo_proxy: TcpProxy, upstream: ScriptedServer) -> None:
    echo_proxy.inject(ScriptedFaults(Fault.HOLD), hold_seconds=HOLD_SECONDS)
    started = time.monotonic()
    with reset_by_peer():
        post_once(echo_proxy, b"held")
    assert time.monotonic() - started >= HOLD_SECONDS
    assert bodies(upstream) == [b"held"]
    assert echo_proxy.faults == {Fault.HOLD: 1}


def test_a_hold_outlasts_a_shorter_client_timeout(
    echo_proxy: TcpProxy, upstream: ScriptedServer
) -> None:
    echo_proxy.inject(ScriptedFaults(Fault.HOLD), hold_seconds=HOLD_SECONDS)
    conn = http.client.HTTPConnection(echo_proxy.host, echo_proxy.port, timeout=HOLD_SECONDS / 5)
    try:
        with pytest.raises(TimeoutError):
            post(conn, b"slow")
    finally:
        conn.close()
    assert bodies(upstream) == [b"slow"]
    assert echo_proxy.faults == {Fault.HOLD: 1}


def test_inject_none_turns_faults_off(echo_proxy: TcpProxy, upstream: ScriptedServer) -> None:
    echo_proxy.inject(lambda: Fault.RESET_BEFORE)
    with reset_by_peer():
        post_once(echo_proxy, b"x")
    echo_proxy.inject(None)
    assert post_once(echo_proxy, b"y") == b"got y"
    assert bodies(upstream) == [b"y"]
    assert echo_proxy.faults == {Fault.RESET_BEFORE: 1}


def test_close_ends_a_hold_at_once(upstream: ScriptedServer) -> None:
    echo_proxy = TcpProxy(upstream.host, upstream.port)
    echo_proxy.inject(lambda: Fault.HOLD, hold_seconds=60)
    conn = connect(echo_proxy)
    try:
        conn.request("POST", "/", body=b"z")
        wait_until(lambda: echo_proxy.faults[Fault.HOLD] == 1, 5, "the answer to be held")
        started = time.monotonic()
        echo_proxy.close()
        assert time.monotonic() - started < 5
        with pytest.raises(ConnectionResetError):  # a RST, or close()'s own FIN
            conn.getresponse()
    finally:
        conn.close()
        echo_proxy.close()
