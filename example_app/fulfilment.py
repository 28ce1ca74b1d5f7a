"""The warehouse and the mailer of ``POST /v1/orders``, faked together as one service.

Two idempotent actions, each keyed by its ``Idempotency-Key`` like the card
processor's charges (CONTRACT §3):

* ``POST /v1/reservations`` ``{"sku", "quantity"}`` -> ``200 {"id": "rs_…"}``: stock held;
* ``POST /v1/notifications`` ``{"to", "template", "order"}`` -> ``200 {"id": "nt_…"}``:
  the confirmation sent.

The same key with the same body answers the first answer again, and nothing
happens twice; the same key with another body is ``400 idempotency_mismatch``.
``GET /v1/_ledger`` lists every call (tests count them), ``POST /v1/_reset``
forgets everything. Run it with ``python -m example_app.fulfilment`` (on
``FULFILMENT_BIND``, default ``127.0.0.1:8002``) or ``gunicorn -w 1 --threads 8
example_app.fulfilment:app``; ONE process, as its memory is its state. Without
``FULFILMENT_URL`` the payments app uses an in-process copy.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import threading
from typing import Any, Protocol
from urllib.parse import urlsplit

import requests
from flask import Flask, Response, jsonify, request
from werkzeug.serving import make_server

from flask_idempotency.client import IdempotentSession, RetryPolicy

DEFAULT_BIND = "127.0.0.1:8002"
DEFAULT_TIMEOUT_SECONDS = 10.0
MAX_ANSWER_BYTES = 64 * 1024

#: Each action: its path, the prefix of the ids it makes and the fields it takes.
ACTIONS = {
    "reservation": ("/v1/reservations", "rs_", ("sku", "quantity")),
    "notification": ("/v1/notifications", "nt_", ("to", "template", "order")),
}


@dataclasses.dataclass(frozen=True)
class Call:
    """One call as the service saw it; ``outcome`` is ``created`` when it acted."""

    kind: str
    key: str | None
    outcome: str
    id: str | None


class FakeFulfilment:
    """Idempotent reservations and notifications in memory, with a ledger of calls."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._answers: dict[tuple[str, str], tuple[str, str]] = {}  # -> (body, id)
        self._calls: list[Call] = []

    def act(self, kind: str, key: str | None, body: object) -> tuple[int, dict[str, Any]]:
        """One call of action ``kind``: the status and JSON answer."""
        fields = ACTIONS[kind][2]
        if not key or len(key) > 255:
            return self._refuse(kind, key, "missing_idempotency_key")
        if not isinstance(body, dict) or sorted(body) != sorted(fields):
            return self._refuse(kind, key, "invalid_request")
        canonical = json.dumps(body, sort_keys=True)
        with self._lock:
            known = self._answers.get((kind, key))
            if known is None:
                made = ACTIONS[kind][1] + secrets.token_hex(12)
                self._answers[(kind, key)] = (canonical, made)
                self._calls.append(Call(kind, key, "created", made))
                return 200, {"id": made}
            if known[0] != canonical:
                self._calls.append(Call(kind, key, "mismatch", None))
                return 400, {"status": "error", "code": "idempotency_mismatch"}
            self._calls.append(Call(kind, key, "replayed", known[1]))
            return 200, {"id": known[1]}

    def _refuse(self, kind: str, key: str | None, code: str) -> tuple[int, dict[str, Any]]:
        with self._lock:
            self._calls.append(Call(kind, key, "invalid", None))
        return 400, {"status": "error", "code": code}

    def calls(self) -> list[Call]:
        with self._lock:
            return list(self._calls)

    def reset(self) -> None:
        with self._lock:
            self._answers.clear()
            self._calls.clear()


def create_app(fake: FakeFulfilment | None = None) -> Flask:
    """The service around ``fake`` (a fresh one if None), kept in ``app.extensions``."""
    service = fake if fake is not None else FakeFulfilment()
    app = Flask(__name__)
    app.config["MAX_CONTENT_LENGTH"] = MAX_ANSWER_BYTES
    app.extensions["fake_fulfilment"] = service

    def action(kind: str) -> Response:
        status, payload = service.act(
            kind, request.headers.get("Idempotency-Key"), request.get_json(silent=True)
        )
        response = jsonify(payload)
        response.status_code = status
        return response

    for kind, (path, _, _) in ACTIONS.items():
        app.add_url_rule(path, kind, lambda kind=kind: action(kind), methods=["POST"])

    @app.get("/v1/_ledger")
    def ledger() -> Response:
        return jsonify({"calls": [dataclasses.asdict(call) for call in service.calls()]})

    @app.post("/v1/_reset")
    def reset() -> Response:
        service.reset()
        return jsonify({"status": "ok"})

    @app.get("/healthz")
    def healthz() -> Response:
        return jsonify({"status": "ok"})

    return app


# -- the payments app's side -------------------------------------------------------


class FulfilmentUnavailable(Exception):
    """No clear answer (an error, a timeout): the outcome is unknown."""


class FulfilmentClient(Protocol):
    """Reserve stock and send a confirmation; the same key must always be sent for
    the same action, so a retry never does it twice. Raises ``FulfilmentUnavailable``."""

    def reserve(self, idempotency_key: str, sku: str, quantity: int) -> str: ...

    def notify(self, idempotency_key: str, to: str, template: str, order: str) -> str: ...


class _Client:
    def reserve(self, idempotency_key: str, sku: str, quantity: int) -> str:
        return self._act("reservation", idempotency_key, {"sku": sku, "quantity": quantity})

    def notify(self, idempotency_key: str, to: str, template: str, order: str) -> str:
        body = {"to": to, "template": template, "order": order}
        return self._act("notification", idempotency_key, body)

    def _act(self, kind: str, key: str, body: dict[str, Any]) -> str:
        status, payload = self._send(kind, key, body)
        made = payload.get("id") if isinstance(payload, dict) else None
        if status != 200 or not isinstance(made, str):
            raise FulfilmentUnavailable(f"{kind} answered {status}")
        return made

    def _send(self, kind: str, key: str, body: dict[str, Any]) -> tuple[int, Any]:
        raise NotImplementedError


class HttpFulfilmentClient(_Client):
    """The service over HTTP through the library's retrying client.

    Unlike the card processor, which the contract has called once per attempt
    (its ``409`` or ``5xx`` is the app's ``502``), a reservation or a
    notification is retried within the call: a dropped answer, a timeout or a
    ``5xx`` is asked again under the same derived key, which the service answers
    with its first answer. The whole call, retries included, stays within the
    timeout, below the lease. A session per call: nothing is shared between
    threads or tenants.
    """

    def __init__(self, base_url: str, timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"fulfilment URL must be http://host[:port]: {base_url!r}")
        self._root = base_url.rstrip("/")
        self.timeout_seconds = timeout_seconds
        self.policy = RetryPolicy(
            max_attempts=3, deadline=timeout_seconds, backoff_base=0.2, backoff_max=2.0
        )

    def _send(self, kind: str, key: str, body: dict[str, Any]) -> tuple[int, Any]:
        headers = {"Idempotency-Key": key}
        try:
            with IdempotentSession(self.policy) as session:
                response = session.post(
                    self._root + ACTIONS[kind][0], json=body, headers=headers,
                    timeout=self.timeout_seconds,
                )  # fmt: skip
        except requests.RequestException as exc:
            raise FulfilmentUnavailable(f"{kind}: {type(exc).__name__}") from None
        if len(response.content) > MAX_ANSWER_BYTES:
            return response.status_code, None
        try:
            return response.status_code, response.json()
        except ValueError:
            return response.status_code, None


class InProcessFulfilmentClient(_Client):
    """The fake called directly (one process only: each gunicorn worker has its own)."""

    def __init__(self, fake: FakeFulfilment) -> None:
        self.fake = fake

    def _send(self, kind: str, key: str, body: dict[str, Any]) -> tuple[int, Any]:
        return self.fake.act(kind, key, json.loads(json.dumps(body)))


_SHARED = FakeFulfilment()


def shared_fulfilment() -> FakeFulfilment:
    """The process-wide fake used when FULFILMENT_URL is unset."""
    return _SHARED


def client_for(url: str | None, timeout_seconds: float) -> FulfilmentClient:
    return HttpFulfilmentClient(url, timeout_seconds) if url else InProcessFulfilmentClient(_SHARED)


def main() -> None:
    """Serve the fake, threaded, until interrupted."""
    host, _, port = os.environ.get("FULFILMENT_BIND", DEFAULT_BIND).rpartition(":")
    server = make_server(host, int(port), app, threaded=True)
    print(f"fake fulfilment listening on http://{host}:{server.server_port}", flush=True)
    server.serve_forever()


app = create_app()

if __name__ == "__main__":
    main()
