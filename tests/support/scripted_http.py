"""A real HTTP server on loopback that answers from a script and records what came.

For the client half's tests: each answer a server can give (a ``503`` with
``Retry-After``, a ``409 in_progress``, a ``422 key_reused``, a slow answer past
the client's timeout) is one entry, and what the client sent on each attempt
(method, headers, body) is there to compare afterwards. Werkzeug's own server,
threaded, so a slow answer does not hold up the next attempt.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from werkzeug.serving import WSGIRequestHandler, make_server
from werkzeug.wrappers import Request, Response

from ._procs import LOOPBACK
from .lifecycle import ClosesOnExit


@dataclasses.dataclass(frozen=True)
class Answer:
    status: int = 200
    body: bytes = b"{}"
    headers: Mapping[str, str] = dataclasses.field(
        default_factory=lambda: {"Content-Type": "application/json"}
    )
    #: Seconds to wait before answering (past a client's timeout, say).
    delay: float = 0.0

    @classmethod
    def error(cls, status: int, code: str, *, profile: str = "stripe", **headers: str) -> Answer:
        """One of the extension's error answers, in either profile's format."""
        if profile == "ietf":
            document: dict[str, Any] = {
                "type": f"urn:flask-idempotency:error:{code}",
                "title": code,
                "status": status,
                "code": code,
            }
            content_type = "application/problem+json"
        else:
            document = {"error": {"type": "idempotency_error", "code": code, "message": code}}
            content_type = "application/json"
        headers = {"Content-Type": content_type, **headers}
        return cls(status, json.dumps(document).encode(), headers)


@dataclasses.dataclass(frozen=True)
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


class _QuietHandler(WSGIRequestHandler):
    """No access log: a test's captured logs hold only the client's lines. HTTP/1.1,
    so connections are kept alive between requests, as gunicorn's gthread workers do."""

    protocol_version = "HTTP/1.1"

    def log_request(self, *args: Any, **kwargs: Any) -> None:
        pass


class ScriptedServer(ClosesOnExit):
    """``ScriptedServer()``: listening at ``url`` (``host``, ``port``); ``script(*answers)``
    queues answers, and once they run out each request gets ``default(seen)`` (a
    ``200 {}`` unless given); ``seen`` lists the requests in arrival order, each
    recorded before it is answered (counted even if its answer is lost)."""

    def __init__(self, default: Callable[[Seen], Answer] = lambda seen: Answer()) -> None:
        self._default = default
        self._lock = threading.Lock()
        self._answers: collections.deque[Answer] = collections.deque()
        self.seen: list[Seen] = []
        self._server = make_server(
            LOOPBACK, 0, self._app, threaded=True, request_handler=_QuietHandler
        )
        self.host, self.port = LOOPBACK, self._server.server_port
        self.url = f"http://{LOOPBACK}:{self.port}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )
        self._thread.start()

    def script(self, *answers: Answer | Iterable[Answer]) -> None:
        with self._lock:
            for answer in answers:
                if isinstance(answer, Answer):
                    self._answers.append(answer)
                else:
                    self._answers.extend(answer)

    def keys(self) -> list[str | None]:
        """The ``Idempotency-Key`` each request carried (``None``: none)."""
        return [seen.headers.get("Idempotency-Key") for seen in self.seen]

    def _app(self, environ: dict[str, Any], start_response: Any) -> Any:
        request = Request(environ)
        with self._lock:
            seen = Seen(
                request.method, request.full_path.rstrip("?"), dict(request.headers),
                request.get_data(),
            )  # fmt: skip
            self.seen.append(seen)
            answer = self._answers.popleft() if self._answers else self._default(seen)
        if answer.delay:
            time.sleep(answer.delay)
        return Response(answer.body, answer.status, dict(answer.headers))(environ, start_response)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)
