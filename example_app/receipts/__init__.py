"""The receipts service (CONTRACT §5): one receipt per charge, however often its event arrives.

A created charge emits ``charge.succeeded`` in its own transaction (charges.py);
the relay publishes it to RabbitMQ (``AMQP_URL``), at least once; this
service's handler writes the receipt inside the consumer guard's transaction,
so a redelivery, a re-publish, or a consumer killed mid-handler never writes a
second one. ``python -m example_app.receipts`` runs it; without ``AMQP_URL`` it
relays the outbox itself, in one process (the embedded path). With
``EVENTS_EMBEDDED=1`` each web worker does that too, so ``make run`` alone
produces receipts.

``GET /v1/receipts?customer=<c>`` lists the receipts of that customer for the
calling API key.
"""

from __future__ import annotations

import math
import os
import secrets
import threading
import time
from collections.abc import Mapping, MutableMapping
from typing import Any

from flask import Blueprint, Flask, Response, current_app, jsonify, request

from example_app.auth import current_owner, require_api_key
from example_app.charges import CHARGE_SUCCEEDED
from example_app.extensions import idempotency
from example_app.schemas import load_customer_query
from flask_idempotency.events import Delivery, EmbeddedEvents, Subscription

bp = Blueprint("receipts", __name__)

#: The topic exchange the relay publishes the payments API's events to.
DEFAULT_EVENTS_EXCHANGE = "payments.events"
#: The receipts service's queue; messages it gives up on go to ``receipts.dlq``.
DEFAULT_RECEIPTS_QUEUE = "receipts"
#: Attempts before an event whose handler keeps failing is dead-lettered.
MAX_ATTEMPTS = 5
#: ``app.extensions`` key of the running embedded path (``EVENTS_EMBEDDED``).
EMBEDDED_KEY = "receipts_embedded_events"

INSERT_RECEIPT = """
INSERT INTO receipts (id, charge, event_id, owner, customer, amount, currency)
VALUES (%s, %s, %s, %s, %s, %s, %s)
"""
LIST_RECEIPTS = """
SELECT id, charge, amount, currency, floor(extract(epoch FROM created_at))::bigint
  FROM receipts
 WHERE owner = %s AND customer = %s
 ORDER BY seq
"""


def config_from_env(environ: Mapping[str, str]) -> dict[str, Any]:
    """The events keys of the app's configuration (CONTRACT §2: ``AMQP_URL``)."""
    return {
        "AMQP_URL": environ.get("AMQP_URL", "").strip() or None,
        "EVENTS_EXCHANGE": environ.get("EVENTS_EXCHANGE", "").strip() or DEFAULT_EVENTS_EXCHANGE,
        "RECEIPTS_QUEUE": environ.get("RECEIPTS_QUEUE", "").strip() or DEFAULT_RECEIPTS_QUEUE,
        "EVENTS_EMBEDDED": _flag(environ, "EVENTS_EMBEDDED"),
        # Seconds the handler lingers inside its transaction, so crash drills can
        # land a SIGKILL mid-handler. 0 anywhere real.
        "RECEIPTS_DELAY_SECONDS": _seconds(environ, "RECEIPTS_DELAY_SECONDS"),
    }


def apply_defaults(config: MutableMapping[str, Any]) -> None:
    """Point the extension's relay at ``AMQP_URL`` and the exchange, unless set."""
    config.setdefault("IDEMPOTENCY_BROKER_URL", config.get("AMQP_URL") or None)
    config.setdefault(
        "IDEMPOTENCY_BROKER_OPTIONS",
        {"exchange": config.get("EVENTS_EXCHANGE") or DEFAULT_EVENTS_EXCHANGE},
    )


def init_app(app: Flask) -> None:
    app.register_blueprint(bp)
    if app.config.get("EVENTS_EMBEDDED"):
        starter = _EmbeddedStarter(app)
        app.before_request(starter)


def new_receipt_id() -> str:
    return "rc_" + secrets.token_hex(12)


@idempotency.consumer("receipts", max_attempts=MAX_ATTEMPTS)
def write_receipt(delivery: Delivery) -> None:
    """One receipt for the charge in ``delivery``; runs once in effect per event."""
    charge = delivery.payload
    params = (
        new_receipt_id(),
        charge["id"],
        delivery.id,
        charge["owner"],
        charge["customer"],
        int(charge["amount"]),
        charge["currency"],
    )
    with idempotency.connection().cursor() as cur:
        cur.execute(INSERT_RECEIPT, params)
    delay = float(current_app.config.get("RECEIPTS_DELAY_SECONDS") or 0)
    if delay:
        time.sleep(delay)


def subscription(config: Mapping[str, Any]) -> Subscription:
    """The receipts queue, bound to ``charge.succeeded`` on the events exchange."""
    return Subscription(
        write_receipt,
        config.get("RECEIPTS_QUEUE") or DEFAULT_RECEIPTS_QUEUE,
        [CHARGE_SUCCEEDED],
        config.get("EVENTS_EXCHANGE") or DEFAULT_EVENTS_EXCHANGE,
    )


def embedded(app: Flask) -> EmbeddedEvents:
    """The outbox relayed straight to the receipts handler, in this process."""
    return EmbeddedEvents(app, [(write_receipt, [CHARGE_SUCCEEDED])])


class _EmbeddedStarter:
    """Starts the embedded path on a worker's first request (after gunicorn's fork,
    and never in CLI processes such as ``flask idempotency migrate``)."""

    def __init__(self, app: Flask) -> None:
        self.app = app
        self._lock = threading.Lock()
        self._pid = -1

    def __call__(self) -> None:
        if self._pid == os.getpid():
            return
        with self._lock:
            if self._pid != os.getpid():
                self._pid = os.getpid()
                # Kept where shutdown code (and tests) can stop it.
                self.app.extensions[EMBEDDED_KEY] = embedded(self.app).start()


@bp.get("/v1/receipts")
@require_api_key
def list_receipts() -> Response:
    customer = load_customer_query(request)
    with idempotency.transaction() as conn, conn.cursor() as cur:
        cur.execute(LIST_RECEIPTS, (current_owner(), customer))
        rows = cur.fetchall()
    data = [
        {"id": r[0], "charge": r[1], "amount": int(r[2]), "currency": r[3], "created": int(r[4])}
        for r in rows
    ]
    return jsonify({"data": data})


def _flag(environ: Mapping[str, str], name: str) -> bool:
    raw = environ.get(name, "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{name} must be 1 or 0, not {raw!r}")


def _seconds(environ: Mapping[str, str], name: str) -> float:
    raw = environ.get(name, "").strip()
    try:
        value = float(raw or 0)
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, not {raw!r}") from None
    if not 0 <= value < math.inf:
        raise ValueError(f"{name} must be 0 or more seconds, not {raw!r}")
    return value
