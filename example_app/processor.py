"""The fake card processor as its own HTTP service (CONTRACT §3).

Run it with ``python -m example_app.processor`` (threaded, on ``PROCESSOR_BIND``,
default ``127.0.0.1:8001``) or ``gunicorn -w 1 --threads 8 example_app.processor:app``.
Use ONE worker process: the ledger and the keys live in that process's memory, so a
second worker would have its own ledger and could charge the same key twice. Give it
threads, so that a call hanging in a "timeout" failure does not hold up the others.

Besides ``POST /v1/charges`` and its lookup, ``GET /v1/charges?idempotency_key=``, it
has routes for tests and demos, which a real processor would not: ``GET /v1/_ledger``,
``POST /v1/_control``, ``POST /v1/_reset``, ``GET /healthz``.

The client side is re-exported here for convenience; ``example_app.processor_client``
is the lighter import (it does not build this module's Flask app).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from flask import Flask, Response, jsonify, request
from werkzeug.serving import make_server

from example_app.processor_client import (
    Charged,
    ChargeOutcome,
    Declined,
    HttpProcessorClient,
    InProcessProcessorClient,
    ProcessorClient,
    ProcessorUnavailable,
    processor_client_from_env,
    shared_processor,
)
from example_app.processor_core import FAILURE_MODES, FakeProcessor, LedgerEntry

__all__ = [
    "ChargeOutcome",
    "Charged",
    "Declined",
    "FakeProcessor",
    "HttpProcessorClient",
    "InProcessProcessorClient",
    "ProcessorClient",
    "ProcessorUnavailable",
    "app",
    "create_app",
    "main",
    "parse_bind",
    "processor_client_from_env",
    "shared_processor",
]

DEFAULT_BIND = "127.0.0.1:8001"

# A charge body is about a hundred bytes; anything near this limit is not one.
MAX_BODY_BYTES = 64 * 1024


def _json(status: int, payload: object) -> Response:
    response = jsonify(payload)
    response.status_code = status
    return response


def _ledger_json(entries: list[LedgerEntry]) -> list[dict[str, object]]:
    return [entry.to_json() for entry in entries]


def create_app(processor: FakeProcessor | None = None) -> Flask:
    """Build the service around ``processor`` (a fresh one if None), kept in app.extensions."""
    fake = processor if processor is not None else FakeProcessor()
    app = Flask(__name__)
    app.config["MAX_CONTENT_LENGTH"] = MAX_BODY_BYTES
    app.extensions["fake_processor"] = fake

    @app.post("/v1/charges")
    def charge() -> Response:
        # force: a processor reads JSON whatever the Content-Type; silent: bad JSON is a
        # 400 from the core, in the protocol's error shape, rather than Flask's HTML page.
        body = request.get_json(force=True, silent=True)
        answer = fake.handle_charge(request.headers.get("Idempotency-Key"), body)
        return Response(answer.body, status=answer.status, content_type=answer.content_type)

    @app.get("/v1/charges")
    def lookup() -> Response:
        # The payment made under a key, for recovering abandoned attempts (CONTRACT §3).
        answer = fake.handle_lookup(request.args.get("idempotency_key"))
        return Response(answer.body, status=answer.status, content_type=answer.content_type)

    @app.get("/v1/_ledger")
    def ledger() -> Response:
        return _json(
            200,
            {
                "calls": _ledger_json(fake.ledger()),
                "lookups": [{"key": key, "status": status} for key, status in fake.lookups()],
                "keys": fake.summary(),
                "switches": fake.switches(),
            },
        )

    @app.post("/v1/_control")
    def control() -> Response:
        body = request.get_json(force=True, silent=True)
        error = _apply_control(fake, body)
        if error:
            return _json(400, {"status": "error", "code": "invalid_control", "message": error})
        return _json(200, fake.switches())

    @app.post("/v1/_reset")
    def reset() -> Response:
        fake.reset()
        return _json(200, fake.switches())

    @app.get("/healthz")
    def healthz() -> Response:
        return _json(200, {"status": "ok"})

    return app


def _apply_control(fake: FakeProcessor, body: object) -> str | None:
    """Apply ``{"latency_seconds", "fail_next", "fail_mode", "hang_seconds"}`` (all optional).

    Everything is validated before anything changes, so a bad request changes nothing.
    """
    if not isinstance(body, dict):
        return "the body must be a JSON object"
    unknown = sorted(set(body) - {"latency_seconds", "fail_next", "fail_mode", "hang_seconds"})
    if unknown:
        return f"unknown fields: {', '.join(unknown)}"
    latency, hang = body.get("latency_seconds"), body.get("hang_seconds")
    count, mode = body.get("fail_next"), body.get("fail_mode", "500")
    for name, value in (("latency_seconds", latency), ("hang_seconds", hang)):
        if value is not None and (
            not isinstance(value, int | float) or isinstance(value, bool) or not 0 <= value <= 3600
        ):
            return f"{name} must be a number of seconds between 0 and 3600"
    if hang == 0:
        return "hang_seconds must be > 0"
    if count is not None and (not isinstance(count, int) or isinstance(count, bool) or count < 0):
        return "fail_next must be a non-negative integer"
    if mode not in FAILURE_MODES:
        return f"fail_mode must be one of {', '.join(FAILURE_MODES)}"
    if latency is not None:
        fake.set_latency(float(latency))
    if hang is not None:
        fake.set_hang_seconds(float(hang))
    if count is not None:
        fake.fail_next(count, mode)
    return None


def parse_bind(value: str) -> tuple[str, int]:
    """``host:port`` (``[::1]:8001`` for IPv6) as gunicorn writes it."""
    host, sep, port = value.strip().rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"PROCESSOR_BIND must be host:port, not {value!r}")
    return host, int(port)


def main(environ: Mapping[str, str] | None = None) -> None:
    """Serve the fake processor, threaded, until interrupted."""
    env = os.environ if environ is None else environ
    host, port = parse_bind(env.get("PROCESSOR_BIND", DEFAULT_BIND))
    server = make_server(host, port, app, threaded=True)
    shown = f"[{host}]" if ":" in host else host
    print(
        f"fake card processor listening on http://{shown}:{server.server_port} "
        "(one process; the ledger is in memory and lost on exit)",
        flush=True,
    )
    server.serve_forever()


app = create_app()

if __name__ == "__main__":
    main()
