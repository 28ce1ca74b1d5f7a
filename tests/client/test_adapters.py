"""The requests adapter and the httpx transports against a real HTTP server that
answers from a script (``support.scripted_http``): one key per call, kept by every
attempt; what is retried, what is not, how long it waits; the outcome; the hooks.

Each test runs with the three clients: ``requests``, ``httpx`` and ``httpx`` async.
The storms through gunicorn and a fault-injecting proxy are ``test_storms.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import requests

from flask_idempotency.client import (
    AsyncIdempotentTransport,
    CallEvent,
    CallOutcome,
    IdempotentSession,
    IdempotentTransport,
    KeyReused,
    RetryPolicy,
)
from flask_idempotency.client.policy import hash_key
from support._procs import LOOPBACK, free_port
from support.scripted_http import Answer, ScriptedServer

FAST = RetryPolicy(max_attempts=4, deadline=10.0, backoff_base=0.01, backoff_max=0.05)
CLIENTS = ("requests", "httpx", "httpx-async")


class Caller:
    """One of the three clients behind one call signature."""

    def __init__(self, kind: str, policy: RetryPolicy, hooks: list[CallEvent]) -> None:
        self.kind = kind
        self.policy = policy
        self.hooks = [hooks.append]

    def call(
        self,
        method: str,
        url: str,
        *,
        key: str | None = None,
        body: Any = None,
        timeout: float = 5.0,
    ) -> tuple[int, CallOutcome, bytes]:
        headers = {} if key is None else {"Idempotency-Key": key}
        if self.kind == "requests":
            with IdempotentSession(self.policy, hooks=self.hooks) as session:
                r = session.request(method, url, data=body, headers=headers, timeout=timeout)
                return r.status_code, r.idempotency, r.content  # type: ignore[attr-defined]
        if self.kind == "httpx":
            transport = IdempotentTransport(self.policy, hooks=self.hooks)
            with httpx.Client(transport=transport, timeout=timeout) as client:
                x = client.request(method, url, content=body, headers=headers)
                return x.status_code, x.extensions["idempotency"], x.content
        return asyncio.run(self._async_call(method, url, headers, body, timeout))

    async def _async_call(
        self, method: str, url: str, headers: dict[str, str], body: Any, timeout: float
    ) -> tuple[int, CallOutcome, bytes]:
        transport = AsyncIdempotentTransport(self.policy, hooks=self.hooks)
        async with httpx.AsyncClient(transport=transport, timeout=timeout) as client:
            x = await client.request(method, url, content=body, headers=headers)
            return x.status_code, x.extensions["idempotency"], x.content


@pytest.fixture
def server() -> Iterator[ScriptedServer]:
    with ScriptedServer() as scripted:
        yield scripted


@pytest.fixture
def events() -> list[CallEvent]:
    return []


@pytest.fixture(params=CLIENTS)
def make_caller(request: pytest.FixtureRequest, events: list[CallEvent]) -> Callable[..., Caller]:
    def make(policy: RetryPolicy = FAST) -> Caller:
        return Caller(request.param, policy, events)

    return make


@pytest.fixture
def caller(make_caller: Callable[..., Caller]) -> Caller:
    return make_caller()


def test_a_generated_key_is_kept_by_every_attempt(server: ScriptedServer, caller: Caller) -> None:
    server.script(
        Answer.error(503, "store_unavailable", **{"Retry-After": "0"}),
        Answer(502, b'{"error": {"code": "processor_unavailable"}}'),
        Answer(201, b'{"id": "ch_1"}', {"Idempotent-Replayed": "false"}),
    )
    status, outcome, body = caller.call("POST", server.url + "/v1/charges", body=b'{"a": 1}')
    assert (status, body) == (201, b'{"id": "ch_1"}')
    keys = server.keys()
    assert len(keys) == 3 and keys[0] is not None and set(keys) == {keys[0]}
    assert [seen.body for seen in server.seen] == [b'{"a": 1}'] * 3
    assert outcome == CallOutcome(
        key=keys[0], attempts=3, replayed=False, status=201,
        reasons=("status 503", "status 502"),
    )  # fmt: skip


def test_the_callers_key_is_sent(server: ScriptedServer, caller: Caller) -> None:
    replay = Answer(201, headers={"Idempotent-Replayed": "true"})
    server.script(Answer.error(503, "store_unavailable"), replay)
    status, outcome, _ = caller.call("POST", server.url + "/pay", key="order-17-pay")
    assert status == 201 and server.keys() == ["order-17-pay", "order-17-pay"]
    assert outcome.key == "order-17-pay" and outcome.replayed is True


def test_a_second_call_gets_a_key_of_its_own(server: ScriptedServer, caller: Caller) -> None:
    caller.call("POST", server.url + "/pay")
    caller.call("POST", server.url + "/pay")
    first, second = server.keys()
    assert first and second and first != second


def test_a_key_the_server_would_refuse_is_refused_before_sending(
    server: ScriptedServer, caller: Caller
) -> None:
    with pytest.raises(ValueError):
        caller.call("POST", server.url + "/pay", key="not a key")
    assert server.seen == []


@pytest.mark.parametrize("profile", ["stripe", "ietf"])
def test_key_reused_is_raised_after_one_attempt(
    server: ScriptedServer, caller: Caller, profile: str, events: list[CallEvent]
) -> None:
    server.script(Answer.error(422, "key_reused", profile=profile))
    with pytest.raises(KeyReused) as raised:
        caller.call("POST", server.url + "/pay", key="used-key")
    assert raised.value.key == "used-key" and "used-key" not in str(raised.value)
    assert len(server.seen) == 1
    assert [(event.kind, event.status) for event in events] == [("gave_up", 422)]


@pytest.mark.parametrize(
    "answer",
    [
        Answer(400, b'{"error": {"code": "validation_failed"}}'),
        Answer(402, b'{"error": {"code": "card_declined"}}'),
        Answer(404),
        Answer(422, b'{"error": {"code": "validation_failed"}}'),
        Answer(409, b'{"error": {"code": "duplicate"}}'),
        Answer.error(500, "schema_missing", profile="ietf"),
        Answer.error(500, "response_not_storable", **{"Stripe-Should-Retry": "false"}),
        Answer(500, b"oops", {"Stripe-Should-Retry": "false"}),
    ],
    ids=lambda answer: str(answer.status),
)
def test_final_answers_are_not_retried(
    server: ScriptedServer, caller: Caller, answer: Answer
) -> None:
    server.script(answer)
    status, outcome, body = caller.call("POST", server.url + "/pay")
    assert (status, body) == (answer.status, answer.body)
    assert len(server.seen) == 1 and outcome.attempts == 1 and outcome.exhausted is None


@pytest.mark.parametrize("profile", ["stripe", "ietf"])
def test_in_progress_waits_for_retry_after(
    server: ScriptedServer, caller: Caller, events: list[CallEvent], profile: str
) -> None:
    busy = Answer.error(409, "in_progress", profile=profile, **{"Retry-After": "1"})
    server.script(busy, Answer(201, b'{"id": "ch_1"}', {"Idempotency-Replayed": "true"}))
    status, outcome, _ = caller.call("POST", server.url + "/pay", key="k")
    assert status == 201 and outcome.replayed is True and outcome.attempts == 2
    assert [event.wait for event in events if event.kind == "retry"] == [1.0]


def test_retry_after_is_capped(server: ScriptedServer, make_caller: Callable[..., Caller]) -> None:
    caller = make_caller(RetryPolicy(retry_after_cap=0.2, backoff_base=0.01))
    server.script(Answer(429, headers={"Retry-After": "3600"}))
    status, outcome, _ = caller.call("POST", server.url + "/pay")
    assert status == 200 and outcome.attempts == 2


def test_a_wait_past_the_deadline_returns_the_answer(
    server: ScriptedServer, make_caller: Callable[..., Caller], events: list[CallEvent]
) -> None:
    caller = make_caller(RetryPolicy(deadline=2.0, retry_after_cap=30))
    server.script(Answer.error(503, "store_unavailable", **{"Retry-After": "5"}))
    status, outcome, _ = caller.call("POST", server.url + "/pay")
    assert status == 503 and outcome.attempts == 1 and outcome.exhausted == "deadline"
    assert [event.kind for event in events] == ["gave_up"]


def test_attempts_run_out_on_a_failing_server(server: ScriptedServer, caller: Caller) -> None:
    server.script([Answer(500, b"boom")] * 10)
    status, outcome, _ = caller.call("POST", server.url + "/pay")
    assert status == 500 and outcome.attempts == FAST.max_attempts == len(server.seen)
    assert outcome.exhausted == "attempts" and len(set(server.keys())) == 1


def test_an_answer_past_the_timeout_is_asked_for_again(
    server: ScriptedServer, caller: Caller
) -> None:
    server.script(Answer(201, b'{"id": "late"}', delay=1.5), Answer(201, b'{"id": "replayed"}'))
    status, outcome, body = caller.call("POST", server.url + "/pay", key="k", timeout=0.5)
    assert (status, body) == (201, b'{"id": "replayed"}')
    assert server.keys() == ["k", "k"] and outcome.reasons[0].endswith("Timeout")


def test_a_refused_connection_is_retried_then_raised(
    make_caller: Callable[..., Caller], events: list[CallEvent]
) -> None:
    port = free_port()
    caller = make_caller()
    with pytest.raises((requests.ConnectionError, httpx.ConnectError)) as raised:
        caller.call("POST", f"http://{LOOPBACK}:{port}/pay")
    assert [event.kind for event in events] == ["retry"] * 3 + ["gave_up"]
    assert events[-1].attempt == FAST.max_attempts and events[-1].exhausted == "attempts"
    # The outcome rides on the error: the key to call again with later.
    outcome: CallOutcome = raised.value.idempotency  # type: ignore[attr-defined]
    assert outcome.attempts == FAST.max_attempts and outcome.exhausted == "attempts"
    assert outcome.key is not None and events[-1].key_hash == hash_key(outcome.key)


@pytest.mark.parametrize("status", [408, 425, 429])
def test_not_now_answers_are_retried(server: ScriptedServer, caller: Caller, status: int) -> None:
    server.script(Answer(status, headers={"Retry-After": "0"}), Answer(201))
    answer, outcome, _ = caller.call("POST", server.url + "/pay")
    assert answer == 201 and outcome.reasons == (f"status {status}",)


def test_in_progress_without_retry_after_polls_slower_and_slower(
    server: ScriptedServer, make_caller: Callable[..., Caller], events: list[CallEvent]
) -> None:
    caller = make_caller(RetryPolicy(backoff_base=0.05, backoff_max=0.4, deadline=10))
    server.script([Answer.error(409, "idempotency_key_in_use")] * 5)
    status, outcome, _ = caller.call("POST", server.url + "/pay", key="k")
    assert status == 200 and outcome.attempts == 6
    ceilings = [0.05, 0.1, 0.2, 0.4, 0.4]
    waits = [event.wait or 0.0 for event in events if event.kind == "retry"]
    assert all(c / 2 <= w <= c for w, c in zip(waits, ceilings, strict=True)), waits


@pytest.fixture
def cut_body_url() -> Iterator[tuple[str, list[bytes]]]:
    """A server whose first answer is a ``201`` cut short after 6 of its 11 body
    bytes (then the connection closes); later answers are whole."""
    listener = socket.create_server(("127.0.0.1", 0))
    seen: list[bytes] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                seen.append(conn.recv(65536))
                body = b'{"id":' if len(seen) == 1 else b'{"id":"c1"}'
                conn.sendall(b"HTTP/1.1 201 Created\r\nContent-Length: 11\r\n\r\n" + body)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}/v1/charges", seen
    with contextlib.suppress(OSError):
        listener.shutdown(socket.SHUT_RDWR)  # wakes accept(), which close() alone does not
    listener.close()
    thread.join(5)


def test_an_answer_cut_short_is_asked_for_again(
    cut_body_url: tuple[str, list[bytes]], caller: Caller
) -> None:
    url, seen = cut_body_url
    status, outcome, body = caller.call("POST", url, key="k-cut", body=b"{}")
    assert (status, body, outcome.attempts) == (201, b'{"id":"c1"}', 2)
    assert len(seen) == 2 and all(b"k-cut" in request for request in seen)


def test_safe_methods_send_no_key_and_are_retried(server: ScriptedServer, caller: Caller) -> None:
    server.script(Answer(503), Answer(200, b'{"ok": true}'))
    status, outcome, _ = caller.call("GET", server.url + "/v1/charges?customer=c")
    assert status == 200 and outcome.key is None and outcome.attempts == 2
    assert server.keys() == [None, None]
    sent = [(seen.method, seen.path) for seen in server.seen]
    assert sent == [("GET", "/v1/charges?customer=c")] * 2


def test_a_plain_server_works(server: ScriptedServer, caller: Caller) -> None:
    server.script(Answer(201, b"created", {"Content-Type": "text/plain"}))
    status, outcome, body = caller.call("POST", server.url + "/things")
    assert (status, body, outcome.replayed, outcome.attempts) == (201, b"created", None, 1)


def test_hooks_and_logs_carry_the_key_hashed(
    server: ScriptedServer,
    caller: Caller,
    events: list[CallEvent],
    caplog: pytest.LogCaptureFixture,
) -> None:
    server.script(Answer(503, headers={"Retry-After": "0"}))
    with caplog.at_level(logging.INFO, logger="flask_idempotency.client"):
        caller.call("POST", server.url + "/pay?token=secret", key="raw-key-123")
    assert [(e.kind, e.attempt, e.status) for e in events] == [("retry", 1, 503), ("done", 2, 200)]
    assert {e.key_hash for e in events} == {hash_key("raw-key-123")}
    assert events[0].target == server.url + "/pay"  # no query string
    assert server.seen[0].path == "/pay?token=secret"  # which the request itself kept
    logged = "\n".join(
        record.getMessage() for record in caplog.records if record.name.startswith("flask_idem")
    )
    assert hash_key("raw-key-123") in logged
    assert "raw-key-123" not in logged and "secret" not in logged


def test_a_failing_hook_does_not_fail_the_call(
    server: ScriptedServer, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(event: CallEvent) -> None:
        raise RuntimeError("hook bug")

    with IdempotentSession(FAST, hooks=[broken]) as session:
        assert session.post(server.url + "/pay").status_code == 200
    assert "hook bug" in caplog.text


def test_requests_sends_a_streamed_body_once(server: ScriptedServer) -> None:
    server.script(Answer(503), Answer(201))
    with IdempotentSession(FAST) as session:
        answer = session.post(server.url + "/upload", data=iter([b"a", b"b"]))
    assert answer.status_code == 503 and len(server.seen) == 1
    assert answer.idempotency.exhausted == "body"  # type: ignore[attr-defined]


def test_httpx_buffers_a_streamed_body_and_sends_it_whole_again(server: ScriptedServer) -> None:
    server.script(Answer(503), Answer(201))
    with httpx.Client(transport=IdempotentTransport(FAST)) as client:
        answer = client.post(server.url + "/upload", content=iter([b"a", b"b"]))
    assert answer.status_code == 201 and [seen.body for seen in server.seen] == [b"ab", b"ab"]


def test_requests_adapter_refuses_urllib3_retries() -> None:
    from flask_idempotency.client import IdempotentAdapter

    with pytest.raises(TypeError):
        IdempotentAdapter(max_retries=3)


def test_httpx_answers_stay_whole_httpx_responses(server: ScriptedServer) -> None:
    """Read inside the loop, the answer still reaches the client unread: its
    ``elapsed`` and its event hooks work as with httpx's own transport."""
    seen: list[int] = []

    def on_response(response: httpx.Response) -> None:
        seen.append(response.status_code)

    server.script(Answer(503), Answer(201, b'{"id": "ch_1"}'))
    transport = IdempotentTransport(FAST)
    with httpx.Client(transport=transport, event_hooks={"response": [on_response]}) as client:
        answer = client.post(server.url + "/pay", json={"a": 1})
    assert answer.status_code == 201 and answer.json() == {"id": "ch_1"}
    assert answer.elapsed > datetime.timedelta(0) and seen == [201]  # set: it was closed


def test_httpx_gzip_answers_are_decoded_once(server: ScriptedServer) -> None:
    import gzip

    document = b'{"error": {"code": "in_progress"}}'
    zipped = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
    server.script(
        Answer(409, gzip.compress(document), {**zipped, "Retry-After": "0"}),
        Answer(201, gzip.compress(b'{"id": "ch_1"}'), zipped),
    )
    with httpx.Client(transport=IdempotentTransport(FAST)) as client:
        answer = client.post(server.url + "/pay", json={})
    outcome = answer.extensions["idempotency"]
    assert answer.json() == {"id": "ch_1"} and outcome.reasons == ("status 409",)


def test_async_transport_runs_under_trio_too(server: ScriptedServer) -> None:
    import trio  # a dev dependency: a missing one is a broken environment, not a skip

    server.script(Answer(503, headers={"Retry-After": "0"}), Answer(201))

    async def main() -> int:
        async with httpx.AsyncClient(transport=AsyncIdempotentTransport(FAST)) as client:
            return (await client.post(server.url + "/pay")).status_code

    assert trio.run(main) == 201 and len(server.seen) == 2
