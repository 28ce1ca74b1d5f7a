"""The fake card processor: CONTRACT §3 over real HTTP and in process.

The app's guarantees rest on this fake behaving like a real idempotent processor, so
each protocol rule and each fault switch is checked through both clients.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from werkzeug.serving import make_server

from example_app.processor import create_app, parse_bind
from example_app.processor_client import (
    Charged,
    ChargeOutcome,
    Declined,
    HttpProcessorClient,
    InProcessProcessorClient,
    ProcessorClient,
    ProcessorUnavailable,
    outcome_from_answer,
    processor_client_from_env,
    shared_processor,
)
from example_app.processor_core import FakeProcessor
from support.waiting import wait_until

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Served:
    processor: FakeProcessor
    base_url: str
    port: int

    def request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, object]:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
        try:
            connection.request(method, path, body=body, headers=headers or {})
            response = connection.getresponse()
            return response.status, json.loads(response.read())
        finally:
            connection.close()


@pytest.fixture
def served() -> Iterator[Served]:
    processor = FakeProcessor()
    server = make_server("127.0.0.1", 0, create_app(processor), threaded=True)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        port = server.server_port
        yield Served(processor, f"http://127.0.0.1:{port}", port)
    finally:
        processor.reset()  # wakes handlers still sleeping in a latency or a hang
        server.shutdown()
        server.server_close()
        thread.join(5)


@dataclass
class Harness:
    processor: FakeProcessor
    make_client: Callable[[float], ProcessorClient]

    def client(self, timeout_seconds: float = 5.0) -> ProcessorClient:
        return self.make_client(timeout_seconds)


@pytest.fixture(params=["http", "in_process"])
def harness(request: pytest.FixtureRequest) -> Iterator[Harness]:
    if request.param == "http":
        served: Served = request.getfixturevalue("served")
        yield Harness(served.processor, lambda t: HttpProcessorClient(served.base_url, t))
        return
    processor = FakeProcessor()
    try:
        yield Harness(processor, lambda t: InProcessProcessorClient(processor, t))
    finally:
        processor.reset()


def new_key() -> str:
    return f"key-{uuid.uuid4()}"


def charge(
    client: ProcessorClient, key: str, source: str = "tok_visa", amount: int = 1500
) -> ChargeOutcome:
    return client.charge(key, amount, "eur", "cus_1", source)


def outcomes(processor: FakeProcessor, key: str) -> list[str]:
    return [entry.outcome for entry in processor.ledger() if entry.key == key]


# -- the protocol, through both clients ------------------------------------------


def test_success_charges_once(harness: Harness) -> None:
    key = new_key()
    outcome = charge(harness.client(), key)
    assert isinstance(outcome, Charged) and outcome.payment_id.startswith("py_")
    assert harness.processor.charges_for(key) == 1
    [entry] = harness.processor.ledger()
    assert (entry.status, entry.payment_id, entry.params) == (200, outcome.payment_id, entry.params)
    assert entry.params is not None and entry.params.amount == 1500


def test_decline_moves_no_money(harness: Harness) -> None:
    key = new_key()
    outcome = charge(harness.client(), key, source="tok_decline_insufficient_funds")
    assert isinstance(outcome, Declined) and outcome.payment_id.startswith("py_")
    assert harness.processor.charges_for(key) == 0
    assert outcomes(harness.processor, key) == ["declined"]


@pytest.mark.parametrize("source", ["tok_visa", "tok_decline"])
def test_replay_returns_the_same_answer_without_a_second_charge(
    harness: Harness, source: str
) -> None:
    key, client = new_key(), harness.client()
    first, second = charge(client, key, source), charge(client, key, source)
    assert first == second
    assert outcomes(harness.processor, key) == [first.__class__.__name__.lower(), "replayed"]
    assert harness.processor.summary()[key] == {"calls": 2, "charges": int(source == "tok_visa")}


def test_same_key_other_parameters_is_a_mismatch(harness: Harness) -> None:
    key, client = new_key(), harness.client()
    assert isinstance(charge(client, key, amount=1500), Charged)
    outcome = charge(client, key, amount=2500)
    assert isinstance(outcome, ProcessorUnavailable) and "idempotency_mismatch" in outcome.reason
    assert outcomes(harness.processor, key) == ["charged", "mismatch"]
    assert harness.processor.charges_for(key) == 1


def test_concurrent_calls_with_one_key_charge_once(harness: Harness) -> None:
    harness.processor.set_latency(0.5)
    key, client, callers = new_key(), harness.client(), 6
    barrier = threading.Barrier(callers)
    results: list[ChargeOutcome] = []

    def call() -> None:
        barrier.wait()
        results.append(charge(client, key))

    threads = [threading.Thread(target=call) for _ in range(callers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(5)
    charged = [r for r in results if isinstance(r, Charged)]
    refused = [r for r in results if isinstance(r, ProcessorUnavailable)]
    assert len(charged) == 1 and len(refused) == callers - 1
    assert all("409" in r.reason for r in refused)
    assert harness.processor.charges_for(key) == 1
    assert sorted(outcomes(harness.processor, key)) == ["charged"] + ["in_progress"] * 5


def test_a_call_the_client_gave_up_on_still_charges_once(harness: Harness) -> None:
    harness.processor.set_latency(0.5)
    key, client = new_key(), harness.client(timeout_seconds=0.15)
    timed_out = charge(client, key)
    assert isinstance(timed_out, ProcessorUnavailable) and "no answer" in timed_out.reason
    still_running = charge(client, key)
    assert isinstance(still_running, ProcessorUnavailable) and "409" in still_running.reason
    wait_until(lambda: harness.processor.charges_for(key) > 0, 3, "the abandoned call's charge")
    harness.processor.set_latency(0)
    retried = charge(client, key)
    charged_entry = next(e for e in harness.processor.ledger() if e.charged)
    assert retried == Charged(str(charged_entry.payment_id))
    assert harness.processor.charges_for(key) == 1


# -- the fault switches ------------------------------------------------------------


def test_injected_500_charges_nothing_and_a_retry_charges(harness: Harness) -> None:
    harness.processor.fail_next(1, "500")
    key, client = new_key(), harness.client()
    failed = charge(client, key)
    assert isinstance(failed, ProcessorUnavailable) and "500" in failed.reason
    assert harness.processor.charges_for(key) == 0
    assert isinstance(charge(client, key), Charged)
    assert outcomes(harness.processor, key) == ["failed", "charged"]


def test_timeout_is_unavailable_within_the_client_timeout(harness: Harness) -> None:
    harness.processor.fail_next(1, "timeout")
    key, client = new_key(), harness.client(timeout_seconds=0.2)
    started = time.monotonic()
    outcome = charge(client, key)
    assert time.monotonic() - started < 2
    assert isinstance(outcome, ProcessorUnavailable) and "no answer" in outcome.reason
    assert harness.processor.charges_for(key) == 0
    assert isinstance(charge(client, key), Charged)  # the hang did not claim the key


def test_garbage_body_is_unavailable(harness: Harness) -> None:
    harness.processor.fail_next(1, "garbage")
    key = new_key()
    outcome = charge(harness.client(), key)
    assert isinstance(outcome, ProcessorUnavailable) and "not JSON" in outcome.reason
    assert harness.processor.charges_for(key) == 0


def test_lost_answer_then_retry_returns_the_stored_charge(harness: Harness) -> None:
    harness.processor.fail_next(1, "after_charge_500")
    key, client = new_key(), harness.client()
    lost = charge(client, key)
    assert isinstance(lost, ProcessorUnavailable) and "500" in lost.reason
    assert harness.processor.charges_for(key) == 1
    [entry] = harness.processor.ledger()
    assert (entry.status, entry.outcome) == (500, "charged")
    retried = charge(client, key)
    assert retried == Charged(str(entry.payment_id))
    assert harness.processor.summary()[key] == {"calls": 2, "charges": 1}


def test_failures_apply_to_the_next_calls_only(harness: Harness) -> None:
    harness.processor.fail_next(2, "500")
    client = harness.client()
    results = [charge(client, new_key()) for _ in range(3)]
    assert [type(r) for r in results] == [ProcessorUnavailable, ProcessorUnavailable, Charged]


def test_reset_forgets_keys_ledger_and_switches(harness: Harness) -> None:
    key, client = new_key(), harness.client()
    charge(client, key)
    harness.processor.set_latency(2)
    harness.processor.fail_next(3, "garbage")
    harness.processor.reset()
    assert harness.processor.ledger() == []
    assert harness.processor.switches()["latency_seconds"] == 0.0
    assert harness.processor.switches()["fail_next"] == 0
    assert isinstance(charge(client, key, amount=999), Charged)  # the old key is gone


# -- HTTP only -----------------------------------------------------------------------


def test_connection_refused_is_unavailable() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    outcome = charge(HttpProcessorClient(f"http://127.0.0.1:{port}", 1.0), new_key())
    assert isinstance(outcome, ProcessorUnavailable) and "ConnectionRefused" in outcome.reason


def test_base_url_path_prefix_is_kept(served: Served) -> None:
    client = HttpProcessorClient(served.base_url + "/", 5)
    assert isinstance(charge(client, new_key()), Charged)


@pytest.mark.parametrize(
    ("headers", "body", "code"),
    [
        (
            {},
            b'{"amount": 1, "currency": "eur", "customer": "c", "source": "s"}',
            "missing_idempotency_key",
        ),
        ({"Idempotency-Key": "k" * 256}, b"{}", "invalid_idempotency_key"),
        ({"Idempotency-Key": "k"}, b"not json", "invalid_request"),
        (
            {"Idempotency-Key": "k"},
            b'{"amount": 1.5, "currency": "eur", "customer": "c", "source": "s"}',
            "invalid_request",
        ),
        (
            {"Idempotency-Key": "k"},
            b'{"amount": 1, "currency": "eur", "customer": "c", "source": "s", "extra": 1}',
            "invalid_request",
        ),
    ],
)
def test_invalid_calls_get_a_json_400(
    served: Served, headers: dict[str, str], body: bytes, code: str
) -> None:
    headers = {"Content-Type": "application/json", **headers}
    status, payload = served.request("POST", "/v1/charges", body, headers)
    assert status == 400
    assert isinstance(payload, dict) and payload["status"] == "error" and payload["code"] == code
    assert [entry.outcome for entry in served.processor.ledger()] == ["invalid"]


def test_control_ledger_and_reset_routes(served: Served) -> None:
    assert served.request("GET", "/healthz") == (200, {"status": "ok"})
    control = json.dumps({"fail_next": 1, "fail_mode": "after_charge_500"}).encode()
    status, switches = served.request("POST", "/v1/_control", control)
    assert status == 200 and isinstance(switches, dict) and switches["fail_next"] == 1

    key, client = new_key(), HttpProcessorClient(served.base_url, 5)
    assert isinstance(charge(client, key), ProcessorUnavailable)
    assert isinstance(charge(client, key), Charged)
    status, ledger = served.request("GET", "/v1/_ledger")
    assert status == 200 and isinstance(ledger, dict)
    assert ledger["keys"] == {key: {"calls": 2, "charges": 1}}
    assert [call["outcome"] for call in ledger["calls"]] == ["charged", "replayed"]
    assert ledger["calls"][0]["params"]["amount"] == 1500

    assert served.request("POST", "/v1/_reset")[0] == 200
    assert served.request("GET", "/v1/_ledger")[1] == {
        "calls": [],
        "lookups": [],
        "keys": {},
        "switches": served.processor.switches(),
    }


@pytest.mark.parametrize(
    "control",
    [
        {"latency_seconds": -1},
        {"latency_seconds": True},
        {"hang_seconds": 0},
        {"fail_next": 1, "fail_mode": "explode"},
        {"fail_next": -1},
        {"surprise": 1},
        [],
    ],
)
def test_bad_control_changes_nothing(served: Served, control: object) -> None:
    before = served.processor.switches()
    status, payload = served.request("POST", "/v1/_control", json.dumps(control).encode())
    assert status == 400 and isinstance(payload, dict) and payload["code"] == "invalid_control"
    assert served.processor.switches() == before


def test_python_dash_m_serves_on_processor_bind() -> None:
    env = {**os.environ, "PROCESSOR_BIND": "127.0.0.1:0", "PYTHONPATH": str(REPO_ROOT)}
    process = subprocess.Popen(
        [sys.executable, "-m", "example_app.processor"],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert "listening on http://127.0.0.1:" in line
        port = int(line.split("http://127.0.0.1:")[1].split()[0])
        client = HttpProcessorClient(f"http://127.0.0.1:{port}", 5)
        assert isinstance(charge(client, new_key()), Charged)
    finally:
        process.terminate()
        process.communicate(timeout=5)


# -- pieces --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "body", "expected"),
    [
        (200, b'{"id": "py_1", "status": "succeeded"}', Charged("py_1")),
        (402, b'{"id": "py_2", "status": "declined"}', Declined("py_2")),
        (200, b'{"id": "py_1", "status": "declined"}', None),
        (200, b'{"id": 7, "status": "succeeded"}', None),
        (200, b'{"status": "succeeded"}', None),
        (200, b'["py_1"]', None),
        (200, b"", None),
        (402, b"{}", None),
        (400, b'{"status": "error", "code": "idempotency_mismatch"}', None),
        (409, b"", None),
        (503, b"<html></html>", None),
    ],
)
def test_only_protocol_answers_count(status: int, body: bytes, expected: object) -> None:
    outcome = outcome_from_answer(status, body)
    if expected is None:
        assert isinstance(outcome, ProcessorUnavailable) and outcome.reason
    else:
        assert outcome == expected


def test_client_from_env() -> None:
    in_process = processor_client_from_env({})
    assert isinstance(in_process, InProcessProcessorClient)
    assert in_process.processor is shared_processor() and in_process.timeout_seconds == 10
    over_http = processor_client_from_env(
        {"PROCESSOR_URL": "http://processor:8001", "PROCESSOR_TIMEOUT_SECONDS": "2.5"}
    )
    assert isinstance(over_http, HttpProcessorClient) and over_http.timeout_seconds == 2.5


@pytest.mark.parametrize(
    "environ",
    [
        {"PROCESSOR_TIMEOUT_SECONDS": "soon"},
        {"PROCESSOR_TIMEOUT_SECONDS": "0"},
        {"PROCESSOR_TIMEOUT_SECONDS": "nan"},
        {"PROCESSOR_URL": "ftp://processor"},
        {"PROCESSOR_URL": "http://"},
    ],
)
def test_client_from_env_rejects_bad_values(environ: dict[str, str]) -> None:
    with pytest.raises(ValueError):
        processor_client_from_env(environ)


def test_parse_bind() -> None:
    assert parse_bind("0.0.0.0:8001") == ("0.0.0.0", 8001)
    assert parse_bind("[::1]:9000") == ("::1", 9000)
    for bad in ("8001", "host:", ":8001", "host:99999", "host:port"):
        with pytest.raises(ValueError):
            parse_bind(bad)
