"""The payments API as deployed: ``gunicorn -c gunicorn.conf.py wsgi:app`` with two
workers, the fake processor as its own service, real PostgreSQL and Redis.

Between the app and the processor sits a small forwarder that can hold the
processor's answer back: the processor has charged, the worker is still waiting,
and the test SIGKILLs that worker. The retry after the lease must take the record
over, send the same derived key, get the processor's stored answer and record
exactly one charge.
"""

from __future__ import annotations

import http.client
import json
import os
import runpy
import signal
import socket
import sys
import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import psycopg2
import pytest

from example_app.auth import owner_of
from flask_idempotency import digests
from support.records import end_leases
from support.servers import GunicornServer, HttpResponse, http_request

REPO_ROOT = Path(__file__).resolve().parents[2]
BODY: dict[str, Any] = {"amount": 2500, "currency": "eur", "customer": "cus_e2e", "source": "tok"}

#: Long enough that the killed worker's claim is still live when the crash test
#: checks for a 409, on a busy machine too; the test then ends that lease in SQL
#: rather than waiting. (A lease must outlast the processor timeout, or the app
#: refuses to start.)
LEASE_SECONDS = 10.0
PROCESSOR_TIMEOUT_SECONDS = 1.5

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="finds the worker to kill through /proc"
)


class HoldingForwarder:
    """Forwards ``POST /v1/charges`` to the processor; can hold one answer back.

    After :meth:`hold_next`, the next call is forwarded (so the processor acts) but
    its answer waits until :meth:`release`; ``held`` is set meanwhile, and
    ``held_peer`` is the caller's address (which worker is waiting).
    """

    def __init__(self, target_url: str) -> None:
        self.target_url = target_url
        self.held = threading.Event()
        self.held_peer: tuple[str, int] | None = None
        self._release = threading.Event()
        self._hold_next = False
        self._lock = threading.Lock()
        forwarder = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                answer = http_request(
                    "POST",
                    forwarder.target_url + self.path,
                    headers={
                        "Content-Type": self.headers.get("Content-Type", "application/json"),
                        "Idempotency-Key": self.headers.get("Idempotency-Key", ""),
                    },
                    body=self.rfile.read(length),
                )
                forwarder.maybe_hold(self.client_address)
                try:
                    self.send_response(answer.status)
                    content_type = answer.headers.get("Content-Type", "application/json")
                    self.send_header("Content-Type", content_type)
                    self.send_header("Content-Length", str(len(answer.body)))
                    self.end_headers()
                    self.wfile.write(answer.body)
                except OSError:
                    pass  # the caller is gone (killed): nobody gets this answer

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def hold_next(self) -> None:
        with self._lock:
            self._hold_next = True
            self.held.clear()
            self._release.clear()

    def maybe_hold(self, peer: tuple[str, int]) -> None:
        with self._lock:
            hold, self._hold_next = self._hold_next, False
        if hold:
            self.held_peer = peer
            self.held.set()
            self._release.wait(30)

    def release(self) -> None:
        self._release.set()

    def close(self) -> None:
        self._release.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


def owner_of_local_port(pids: list[int], port: int) -> int:
    """Which of ``pids`` owns the IPv4 TCP socket bound to local ``port``."""
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].rsplit(":", 1)[1], 16) == port:
            inodes.add(fields[9])
    for pid in pids:
        fd_dir = Path(f"/proc/{pid}/fd")
        for fd in fd_dir.iterdir():
            try:
                link = os.readlink(fd)
            except OSError:
                continue
            if link.startswith("socket:[") and link[8:-1] in inodes:
                return pid
    raise LookupError(f"no process among {pids} owns local port {port}")


@pytest.fixture(scope="module")
def processor() -> Iterator[GunicornServer]:
    """The fake processor as its own service: one worker (its ledger is in memory)."""
    server = GunicornServer(
        "example_app.processor:app",
        workers=1,
        worker_class="gthread",
        threads=8,
        health_path="/healthz",
    )
    try:
        yield server.start()
    finally:
        server.close()


@pytest.fixture(scope="module")
def forwarder(processor: GunicornServer) -> Iterator[HoldingForwarder]:
    fwd = HoldingForwarder(processor.url)
    yield fwd
    fwd.close()


@pytest.fixture(scope="module")
def api(database_url: str, redis_url: str, forwarder: HoldingForwarder) -> Iterator[GunicornServer]:
    server = GunicornServer(
        "wsgi:app",
        config=REPO_ROOT / "gunicorn.conf.py",
        workers=2,
        worker_class="gthread",
        threads=4,
        health_path="/healthz",
        env={
            "DATABASE_URL": database_url,
            "REDIS_URL": redis_url,
            "PROCESSOR_URL": forwarder.url,
            "PROCESSOR_TIMEOUT_SECONDS": str(PROCESSOR_TIMEOUT_SECONDS),
            "IDEMPOTENCY_LEASE_SECONDS": str(LEASE_SECONDS),
        },
    )
    try:
        yield server.start()
    finally:
        server.close()


@pytest.fixture(autouse=True)
def reset_processor(processor: GunicornServer) -> None:
    assert http_request("POST", processor.url + "/v1/_reset").status == 200


def new_token() -> str:
    return f"sk_test_{uuid.uuid4().hex}"


def charge(
    api: GunicornServer, token: str, key: str, body: dict[str, Any] | None = None
) -> HttpResponse:
    sent = {"Authorization": f"Bearer {token}", "Idempotency-Key": key}
    return http_request("POST", api.url + "/v1/charges", sent, json=BODY if body is None else body)


def processor_key(token: str, key: str) -> str:
    return digests.derived_key(digests.record_key(owner_of(token), key), "processor")


def processor_counts(processor: GunicornServer, key: str) -> dict[str, int]:
    ledger = http_request("GET", processor.url + "/v1/_ledger").json()
    counts: dict[str, int] = ledger["keys"].get(key, {"calls": 0, "charges": 0})
    return counts


def charges_of(database_url: str, token: str) -> list[tuple[str, str]]:
    with psycopg2.connect(database_url) as conn, conn.cursor() as cur:
        cur.execute("SELECT id, payment_id FROM charges WHERE owner = %s", (owner_of(token),))
        rows: list[tuple[str, str]] = cur.fetchall()
    conn.close()
    return rows


def test_charge_then_byte_identical_replay(api: GunicornServer, processor: GunicornServer) -> None:
    token = new_token()
    first = charge(api, token, "order-1")
    assert first.status == 201, first.body
    assert first.headers["Idempotent-Replayed"] == "false"
    replay = charge(api, token, "order-1")
    assert replay.status == 201
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert replay.body == first.body
    assert replay.headers["Location"] == first.headers["Location"]
    assert processor_counts(processor, processor_key(token, "order-1")) == {
        "calls": 1,
        "charges": 1,
    }
    fetched = http_request(
        "GET", api.url + first.headers["Location"], {"Authorization": f"Bearer {token}"}
    )
    assert fetched.json() == first.json()


def test_decline_is_stored_and_replayed(api: GunicornServer, processor: GunicornServer) -> None:
    token = new_token()
    declined_body = BODY | {"source": "tok_decline_lost_card"}
    first = charge(api, token, "order-1", declined_body)
    assert first.status == 402
    assert first.json()["error"]["code"] == "card_declined"
    replay = charge(api, token, "order-1", declined_body)
    assert (replay.status, replay.headers["Idempotent-Replayed"]) == (402, "true")
    assert replay.body == first.body
    assert processor_counts(processor, processor_key(token, "order-1"))["calls"] == 1


def test_processor_500_is_502_and_a_retry_charges_once(
    api: GunicornServer, processor: GunicornServer, database_url: str
) -> None:
    token = new_token()
    control = {"fail_next": 1, "fail_mode": "after_charge_500"}
    assert http_request("POST", processor.url + "/v1/_control", json=control).status == 200
    failed = charge(api, token, "order-1")
    assert failed.status == 502
    assert failed.json()["error"]["code"] == "processor_unavailable"
    assert charges_of(database_url, token) == []

    retry = charge(api, token, "order-1")
    assert (retry.status, retry.headers["Idempotent-Replayed"]) == (201, "false")
    key = processor_key(token, "order-1")
    assert processor_counts(processor, key) == {"calls": 2, "charges": 1}
    assert len(charges_of(database_url, token)) == 1


def test_worker_killed_after_the_processor_charged(
    api: GunicornServer,
    processor: GunicornServer,
    forwarder: HoldingForwarder,
    database_url: str,
) -> None:
    token = new_token()
    key = processor_key(token, "order-1")
    outcome: dict[str, object] = {}

    def doomed_request() -> None:
        try:
            outcome["response"] = charge(api, token, "order-1")
        except (OSError, http.client.HTTPException) as exc:
            outcome["error"] = exc

    forwarder.hold_next()
    thread = threading.Thread(target=doomed_request)
    thread.start()
    try:
        assert forwarder.held.wait(5), "the charge never reached the processor"
        # The processor has charged; the answer is on its way; nothing is committed yet.
        assert processor_counts(processor, key) == {"calls": 1, "charges": 1}
        assert forwarder.held_peer is not None
        victim = owner_of_local_port(api.worker_pids(), forwarder.held_peer[1])
        api.kill_worker(victim, signal.SIGKILL)
        thread.join(5)
    finally:
        forwarder.release()
        thread.join(5)
    assert "error" in outcome, outcome  # the client lost its connection, no answer
    assert charges_of(database_url, token) == []

    # The dead worker's lease is still running: the key is busy, nothing runs.
    busy = charge(api, token, "order-1")
    assert busy.status == 409
    assert busy.json()["error"]["code"] == "in_progress"
    # Its lease would end LEASE_SECONDS after its last renewal; end it now instead.
    assert end_leases(database_url, record_key=digests.record_key(owner_of(token), "order-1")) == 1
    retry = charge(api, token, "order-1")
    assert (retry.status, retry.headers["Idempotent-Replayed"]) == (201, "false"), retry.body

    # Same derived key twice at the processor, one charge, one charge row.
    assert processor_counts(processor, key) == {"calls": 2, "charges": 1}
    rows = charges_of(database_url, token)
    assert [row[0] for row in rows] == [retry.json()["id"]]
    ledger = http_request("GET", processor.url + "/v1/_ledger").json()["calls"]
    assert {c["payment_id"] for c in ledger if c["key"] == key} == {rows[0][1]}
    again = charge(api, token, "order-1")
    assert (again.status, again.body) == (201, retry.body)
    api.wait_for_workers(exclude=[victim])


def test_two_api_keys_with_one_idempotency_key_are_independent(api: GunicornServer) -> None:
    alice, bob = new_token(), new_token()
    a = charge(api, alice, "same-key")
    b = charge(api, bob, "same-key")
    assert a.status == b.status == 201
    assert b.headers["Idempotent-Replayed"] == "false"
    assert a.json()["id"] != b.json()["id"]
    foreign = http_request(
        "GET", api.url + a.headers["Location"], {"Authorization": f"Bearer {bob}"}
    )
    assert foreign.status == 404


def raw_exchange(api: GunicornServer, request: bytes) -> tuple[int, dict[str, Any]]:
    """Send bytes as they are (framing the HTTP clients would not produce); the
    status and the JSON body of the answer."""
    received = b""
    with socket.create_connection((api.host, api.port), timeout=10) as sock:
        sock.sendall(request)
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except ConnectionResetError:
            pass  # the server closed with part of our body unread; its answer came first
    head, _, body = received.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)


def chunked_charge(token: str, key: str, chunks: list[bytes]) -> bytes:
    framed = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"
    return (
        b"POST /v1/charges HTTP/1.1\r\nHost: api\r\nConnection: close\r\n"
        b"Authorization: Bearer %s\r\nIdempotency-Key: %s\r\n"
        b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        % (token.encode(), key.encode())
    ) + framed


def test_malformed_framing_is_a_json_4xx(api: GunicornServer) -> None:
    token = new_token()
    body = json.dumps(BODY).encode()
    status, answer = raw_exchange(api, chunked_charge(token, "ok", [body[:10], body[10:]]))
    assert (status, answer["status"]) == (201, "succeeded")

    broken = chunked_charge(token, "broken", [body]).replace(b"%x\r\n" % len(body), b"zz\r\n")
    status, answer = raw_exchange(api, broken)
    assert (status, answer["error"]["code"]) == (400, "malformed_body")

    # Streamed past MAX_CONTENT_LENGTH (1 MiB): refused, not cut and acted on.
    huge = json.dumps(BODY | {"description": "x" * (1024 * 1024)}).encode()
    status, answer = raw_exchange(api, chunked_charge(token, "huge", [huge]))
    assert (status, answer["error"]["type"]) == (413, "invalid_request_error")
    status, answer = raw_exchange(
        api,
        b"POST /v1/charges HTTP/1.1\r\nHost: api\r\nConnection: close\r\n"
        b"Authorization: Bearer t\r\nIdempotency-Key: k\r\n"
        b"Content-Type: application/json\r\nContent-Length: 2000000\r\n\r\n{}",
    )
    assert status == 413


def test_start_up_message_says_where_and_how(api: GunicornServer) -> None:
    log = api.log_text()
    assert f"payments API listening on {api.url}" in log
    assert f"try: curl -i {api.url}/v1/charges" in log


@pytest.mark.parametrize(
    ("env", "bind"),
    [
        ({}, "127.0.0.1:8000"),
        ({"PORT": "5000"}, "0.0.0.0:5000"),
        ({"PORT": "5000", "GUNICORN_BIND": "[::1]:9000"}, "[::1]:9000"),
    ],
)
def test_gunicorn_conf_reads_the_environment(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], bind: str
) -> None:
    for name in ("PORT", "GUNICORN_BIND", "WEB_CONCURRENCY", "PROCESSOR_TIMEOUT_SECONDS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    conf = runpy.run_path(str(REPO_ROOT / "gunicorn.conf.py"))
    assert conf["bind"] == [bind]
    assert 1 <= conf["workers"] <= 8
    assert conf["worker_class"] == "gthread" and conf["threads"] >= 2
    assert conf["timeout"] > 10 and conf["graceful_timeout"] > 10
    assert conf["preload_app"] is False

    monkeypatch.setenv("WEB_CONCURRENCY", "3")
    monkeypatch.setenv("PROCESSOR_TIMEOUT_SECONDS", "40")
    conf = runpy.run_path(str(REPO_ROOT / "gunicorn.conf.py"))
    assert conf["workers"] == 3
    assert conf["timeout"] > 40 and conf["graceful_timeout"] > 40
