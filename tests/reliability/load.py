"""Clients for the reliability suite: bounded pools of keep-alive connections, raw sockets.

Deliberately plain, like ``support.http_client``: nothing here retries or
reconnects a request behind the test's back, because a hidden retry is exactly
what these tests must count themselves. A transport failure is an ``Answer``
with status 0 and the error's name, never an exception, so a storm can finish
and report every outcome.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import select
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

#: A processor source that the fake processor charges (``tok_decline*`` declines).
GOOD_SOURCE = "tok_visa"


@dataclasses.dataclass(frozen=True)
class Call:
    """One request to send. ``tag`` groups answers (a key, a phase) for the test."""

    method: str
    path: str
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes = b""
    tag: str = ""


@dataclasses.dataclass(frozen=True)
class Answer:
    """What came back for one ``Call``; ``status`` 0 means no HTTP answer at all."""

    call: Call
    status: int
    headers: Mapping[str, str]
    body: bytes
    error: str | None = None
    started: float = 0.0
    finished: float = 0.0

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def code(self) -> str | None:
        """The ``error.code`` of a JSON error body, else ``None``."""
        try:
            payload = json.loads(self.body)
        except ValueError:
            return None
        error = payload.get("error") if isinstance(payload, dict) else None
        code = error.get("code") if isinstance(error, dict) else None
        return code if isinstance(code, str) else None

    @property
    def replayed(self) -> str | None:
        return self.headers.get("idempotent-replayed")

    def describe(self) -> str:
        """A one-line summary for assertion messages: status, code and error, no body."""
        if self.status == 0:
            return f"no answer ({self.error})"
        return f"{self.status} {self.code or ''} replayed={self.replayed}".strip()


def charge_body(
    amount: int, customer: str, *, currency: str = "usd", source: str = GOOD_SOURCE
) -> bytes:
    return json.dumps(
        {"amount": amount, "currency": currency, "customer": customer, "source": source}
    ).encode()


def charge_call(
    api_key: str, key: str | None, body: bytes, *, tag: str = "", path: str = "/v1/charges"
) -> Call:
    """``POST /v1/charges`` as a client of the payments API sends it."""
    headers = [("Authorization", f"Bearer {api_key}"), ("Content-Type", "application/json")]
    if key is not None:
        headers.append(("Idempotency-Key", key))
    return Call("POST", path, tuple(headers), body, tag or (key or ""))


class Connections:
    """Keep-alive connections to one server, one per calling thread.

    A connection the server closed while idle (keep-alive timeout, a restarted
    worker) is noticed before the next request by a zero-timeout ``select`` and
    replaced, so a storm does not count the server's housekeeping as failures.
    A request that fails once sent is reported as failed, never resent.
    """

    def __init__(self, base_url: str, *, timeout: float = 30.0, keep_alive: bool = True) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname or not parts.port:
            raise ValueError(f"need http://host:port, not {base_url!r}")
        self.host, self.port = parts.hostname, parts.port
        self.timeout = timeout
        self.keep_alive = keep_alive
        self._local = threading.local()
        self._lock = threading.Lock()
        self._all: list[http.client.HTTPConnection] = []

    def _connection(self) -> http.client.HTTPConnection:
        conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        if conn is not None and conn.sock is not None:
            readable, _, _ = select.select([conn.sock], [], [], 0)
            if readable:  # EOF (or stray bytes) on an idle connection: start afresh
                conn.close()
                conn = None
        if conn is None or conn.sock is None:
            conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
            conn.auto_open = 0
            conn.connect()
            self._local.conn = conn
            with self._lock:
                self._all.append(conn)
        return conn

    def send(self, call: Call) -> Answer:
        started = time.monotonic()
        conn: http.client.HTTPConnection | None = None
        try:
            conn = self._connection()
            conn.putrequest(call.method, call.path, skip_accept_encoding=True)
            for name, value in call.headers:
                conn.putheader(name, value)
            if call.body or call.method in ("POST", "PUT", "PATCH"):
                conn.putheader("Content-Length", str(len(call.body)))
            if not self.keep_alive:
                conn.putheader("Connection", "close")
            conn.endheaders(call.body or None)
            with conn.getresponse() as response:
                body = response.read()
                headers = {k.lower(): v for k, v in response.getheaders()}
                status = response.status
            if not self.keep_alive or response.will_close:
                conn.close()
        except (OSError, http.client.HTTPException) as exc:
            if conn is not None:
                conn.close()
            return Answer(call, 0, {}, b"", type(exc).__name__, started, time.monotonic())
        return Answer(call, status, headers, body, None, started, time.monotonic())

    def close(self) -> None:
        with self._lock:
            conns, self._all = self._all, []
        for conn in conns:
            conn.close()


def run_all(connections: Connections, calls: Iterable[Call], threads: int) -> list[Answer]:
    """Send ``calls`` through ``threads`` client threads; answers in the calls' order."""
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="load") as pool:
        return list(pool.map(connections.send, calls))


def run_waves(
    connections: Connections,
    waves: Sequence[Sequence[Call]],
    *,
    barrier_timeout: float = 30.0,
    between: Callable[[int, list[Answer]], None] | None = None,
) -> list[Answer]:
    """Send each wave's calls at the same instant (one thread each, behind a barrier).

    A wave must finish before the next starts, so each wave really is that many
    concurrent requests. ``between(index, answers)`` runs after each wave.
    """
    size = max((len(wave) for wave in waves), default=1)
    answers: list[Answer] = []
    with ThreadPoolExecutor(max_workers=size, thread_name_prefix="wave") as pool:
        for index, wave in enumerate(waves):
            barrier = threading.Barrier(len(wave))

            def fire(call: Call, barrier: threading.Barrier = barrier) -> Answer:
                barrier.wait(barrier_timeout)
                return connections.send(call)

            got = list(pool.map(fire, wave))
            answers.extend(got)
            if between is not None:
                between(index, got)
    return answers


@dataclasses.dataclass(frozen=True)
class RawAnswer:
    """A response read off a raw socket; ``status`` 0 when none came."""

    status: int
    headers: Mapping[str, str]
    body: bytes
    error: str | None = None

    @property
    def content_type(self) -> str:
        return self.headers.get("content-type", "")

    def json(self) -> Any:
        return json.loads(self.body)


def raw_exchange(
    host: str, port: int, data: bytes, *, timeout: float = 15.0, half_close: bool = False
) -> RawAnswer:
    """Write ``data`` (a whole request, any bytes at all) and read the answer until EOF.

    The request should say ``Connection: close``. ``half_close`` shuts our side
    for writing afterwards, which is how a client that sent a short body looks.
    """
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            try:
                sock.sendall(data)
            except OSError:
                pass  # the server may answer (413, 400) and close before reading it all
            if half_close:
                try:
                    sock.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
            chunks: list[bytes] = []
            while True:
                try:
                    chunk = sock.recv(65536)
                except ConnectionResetError:
                    break  # answered, then reset because of unread request bytes
                if not chunk:
                    break
                chunks.append(chunk)
    except OSError as exc:
        return RawAnswer(0, {}, b"", type(exc).__name__)
    return parse_raw_response(b"".join(chunks))


def parse_raw_response(raw: bytes) -> RawAnswer:
    """Status, headers and body of one HTTP/1.x response (Content-Length or chunked)."""
    head, sep, rest = raw.partition(b"\r\n\r\n")
    if not sep:
        return RawAnswer(0, {}, b"", "no complete response" if raw else "no response")
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        return RawAnswer(0, {}, b"", "malformed status line")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = _dechunk(rest)
    elif "content-length" in headers and headers["content-length"].isdigit():
        body = rest[: int(headers["content-length"])]
    else:
        body = rest
    return RawAnswer(int(parts[1]), headers, body)


def _dechunk(data: bytes) -> bytes:
    out: list[bytes] = []
    while data:
        size_line, _, data = data.partition(b"\r\n")
        try:
            size = int(size_line.split(b";")[0], 16)
        except ValueError:
            break
        if size == 0:
            break
        out.append(data[:size])
        data = data[size + 2 :]
    return b"".join(out)


def build_request(
    method: bytes,
    target: bytes,
    headers: Sequence[tuple[bytes, bytes]],
    body: bytes = b"",
    *,
    content_length: bool = True,
) -> bytes:
    """An HTTP/1.1 request as bytes, with ``Host`` and ``Connection: close`` added."""
    lines = [method + b" " + target + b" HTTP/1.1", b"Host: 127.0.0.1", b"Connection: close"]
    lines += [name + b": " + value for name, value in headers]
    if content_length:
        lines.append(b"Content-Length: " + str(len(body)).encode())
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def status_counts(answers: Iterable[Answer]) -> dict[str, int]:
    """``{"201": n, "409 in_progress": n, "0 RemoteDisconnected": n, ...}`` for printing."""
    counts: dict[str, int] = {}
    for answer in answers:
        if answer.status == 0:
            label = f"0 {answer.error}"
        elif answer.status >= 300:
            label = f"{answer.status} {answer.code or '-'}"
        else:
            label = f"{answer.status} replayed={answer.replayed}"
        counts[label] = counts.get(label, 0) + 1
    return dict(sorted(counts.items()))


class LoadLoop:
    """Client threads sending calls until stopped, keeping every answer.

    ``next_call()`` picks each request (a new key, a replay of a finished one);
    ``on_answer`` sees each answer as it arrives, so the next calls can depend
    on earlier outcomes. Used to keep traffic flowing through an outage.
    """

    def __init__(
        self,
        connections: Connections,
        next_call: Callable[[], Call],
        *,
        threads: int,
        on_answer: Callable[[Answer], None] | None = None,
        pause: float = 0.0,
    ) -> None:
        self.connections = connections
        self.next_call = next_call
        self.on_answer = on_answer
        self.pause = pause
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._answers: list[Answer] = []
        self._threads = [
            threading.Thread(target=self._run, name=f"load-{i}", daemon=True)
            for i in range(threads)
        ]

    def _run(self) -> None:
        while not self._stop.is_set():
            answer = self.connections.send(self.next_call())
            with self._lock:
                self._answers.append(answer)
            if self.on_answer is not None:
                self.on_answer(answer)
            if self.pause:
                self._stop.wait(self.pause)

    def start(self) -> LoadLoop:
        for thread in self._threads:
            thread.start()
        return self

    def answers(self) -> list[Answer]:
        with self._lock:
            return list(self._answers)

    def stop(self, timeout: float = 60.0) -> list[Answer]:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout)
        alive = [t.name for t in self._threads if t.is_alive()]
        if alive:
            raise TimeoutError(f"load threads still running: {alive}")
        return self.answers()


def percentile(values: Sequence[float], fraction: float) -> float:
    """The ``fraction`` quantile (nearest rank) of ``values``; 0 when empty."""
    if not values:
        return 0.0
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(fraction * len(ordered)) - 1))
    return ordered[index]


def retry_until_final(
    connections: Connections, calls: list[Call], *, deadline: float
) -> tuple[dict[str, Answer], Counter[str]]:
    """Send each call until it gets a final answer (not 409, not a transport error),
    honouring ``Retry-After``, as a well-behaved client would."""
    final: dict[str, Answer] = {}
    retries: Counter[str] = Counter()
    pending = list(calls)
    end = time.monotonic() + deadline
    with ThreadPoolExecutor(max_workers=16, thread_name_prefix="retry") as pool:
        while pending and time.monotonic() < end:
            answers = list(pool.map(connections.send, pending))
            pending = []
            wait = 0.2
            for answer in answers:
                if answer.status == 0 or answer.status == 409 or answer.status >= 500:
                    retries[answer.describe()] += 1
                    pending.append(answer.call)
                    wait = max(wait, float(answer.headers.get("retry-after", "0") or 0))
                else:
                    final[answer.call.tag] = answer
            if pending:
                time.sleep(min(wait, 2.0))
    assert not pending, f"{len(pending)} keys never got a final answer"
    return final, retries
