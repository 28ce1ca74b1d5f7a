"""Orders: three external steps, each a recovery point (``idempotency.phase``).

``POST /v1/orders`` reserves the stock at the warehouse, charges the card and
sends the confirmation. One transaction would not do here: after a crash
between two steps, the retry would reserve, charge and notify all over again
(harmless in effect only where every service is idempotent, and still three
calls, a second confirmation email from any mailer that is not). So each step
is a phase: its external call, then the order row's update, committed with the
record's progress. A takeover after a crash (the client's retry, or
``flask idempotency recover``) runs the view again, and each committed phase
returns what it recorded instead of calling out again: the order resumes
after its last committed step. Each step still sends a derived key, so the
one step a crash interrupted before its commit is harmless to repeat.

``recover_order`` finishes an order whose worker died once its first step
committed (stock is held for it): the remaining steps run as a retry would. An
order that died before any step committed is released: nothing of it exists
here, and a retry starts over (the warehouse replays a hold made under its key).
"""

from __future__ import annotations

import logging
import secrets
from typing import Any

import psycopg2
from flask import Blueprint, Request, Response, current_app, g, jsonify, request, url_for
from typing_extensions import assert_never

from example_app.auth import current_owner, require_api_key
from example_app.charges import crash_drill_pause, processor_client
from example_app.errors import json_error, resource_missing
from example_app.extensions import idempotency
from example_app.fulfilment import FulfilmentClient, FulfilmentUnavailable
from example_app.processor_client import Charged, Declined, ProcessorUnavailable
from example_app.schemas import OrderRequest, load_order_request
from flask_idempotency import Abandoned, StoreUnavailable
from flask_idempotency.client import purpose_key

log = logging.getLogger(__name__)

bp = Blueprint("orders", __name__)

FULFILMENT_CLIENT_KEY = "fulfilment_client"

_ORDER_COLUMNS = (
    "id, customer, sku, quantity, amount, currency, status, reservation_id, payment_id, "
    "notification_id, floor(extract(epoch FROM created_at))::bigint"
)
INSERT_ORDER = """
INSERT INTO orders (id, owner, customer, sku, quantity, amount, currency, status, reservation_id)
VALUES (%s, %s, %s, %s, %s, %s, %s, 'reserved', %s)
"""
PAY_ORDER = "UPDATE orders SET status = %s, payment_id = %s WHERE id = %s"
CONFIRM_ORDER = "UPDATE orders SET status = 'confirmed', notification_id = %s WHERE id = %s"
GET_ORDER = f"SELECT {_ORDER_COLUMNS} FROM orders WHERE id = %s AND owner = %s"


class StepUnavailable(Exception):
    """An external step gave no clear answer: nothing of it is committed (502)."""


def fulfilment_client() -> FulfilmentClient:
    client: FulfilmentClient = current_app.extensions[FULFILMENT_CLIENT_KEY]
    return client


def order_json(row: tuple[Any, ...]) -> dict[str, Any]:
    (order_id, customer, sku, quantity, amount, currency, status) = row[:7]
    reservation, payment, notification, created = row[7:]
    return {
        "id": order_id,
        "object": "order",
        "customer": customer,
        "sku": sku,
        "quantity": int(quantity),
        "amount": int(amount),
        "currency": currency,
        "status": status,
        "reservation": reservation,
        "payment": payment,
        "notification": notification,
        "created": int(created),
    }


def order_recovery_data(req: Request) -> dict[str, str]:
    return {"owner": current_owner()}


def recover_order(attempt: Abandoned) -> Response | None:
    """``flask idempotency recover``: finish an order whose worker died (see above)."""
    if not attempt.phases:
        return None
    g.api_owner = attempt.data["owner"]
    return place_order(load_order_request(request), attempt.data["owner"])


@bp.post("/v1/orders")
@require_api_key
@idempotency.required(recover=recover_order, recovery_data=order_recovery_data)
def create_order() -> Response:
    return place_order(load_order_request(request), current_owner())


def place_order(order: OrderRequest, owner: str) -> Response:
    """The three steps; a committed one returns its record without running again."""
    try:
        reserved = idempotency.phase("reserve", lambda: _reserve(order, owner))
        crash_drill_pause()
        paid = idempotency.phase("charge", lambda: _charge(order, reserved["order"]))
        crash_drill_pause()
        if paid["status"] == "declined":
            return json_error(402, "card_error", "card_declined", "The card was declined.")
        idempotency.phase("notify", lambda: _notify(order, reserved["order"]))
        crash_drill_pause()
    except StepUnavailable as exc:
        # Nothing of this step was committed; the steps before it were, so a retry
        # under the same key resumes here (the record is kept, its lease ended).
        log.warning("order step unavailable: %s", exc)
        return json_error(
            502,
            "api_error",
            "upstream_unavailable",
            "A service the order needs did not answer; retry with the same Idempotency-Key.",
        )
    return _answer(reserved["order"], owner)


def _reserve(order: OrderRequest, owner: str) -> dict[str, str]:
    try:
        reservation = fulfilment_client().reserve(purpose_key("reserve"), order.sku, order.quantity)
    except FulfilmentUnavailable as exc:
        raise StepUnavailable(str(exc)) from None
    order_id = "or_" + secrets.token_hex(12)
    _execute(
        INSERT_ORDER,
        (
            order_id,
            owner,
            order.customer,
            order.sku,
            order.quantity,
            order.amount,
            order.currency,
            reservation,
        ),
    )
    return {"order": order_id, "reservation": reservation}


def _charge(order: OrderRequest, order_id: str) -> dict[str, str]:
    outcome = processor_client().charge(
        purpose_key("processor"),
        order.amount,
        order.currency,
        order.customer,
        order.source,
    )
    match outcome:
        case Charged(payment_id=payment_id):
            _execute(PAY_ORDER, ("paid", payment_id, order_id))
            return {"status": "paid", "payment": payment_id}
        case Declined(payment_id=payment_id):
            _execute(PAY_ORDER, ("declined", payment_id, order_id))
            return {"status": "declined", "payment": payment_id}
        case ProcessorUnavailable(reason=reason):
            raise StepUnavailable(reason)
        case _:
            assert_never(outcome)


def _notify(order: OrderRequest, order_id: str) -> dict[str, str]:
    try:
        notification = fulfilment_client().notify(
            purpose_key("notify"), order.customer, "order_confirmed", order_id
        )
    except FulfilmentUnavailable as exc:
        raise StepUnavailable(str(exc)) from None
    _execute(CONFIRM_ORDER, (notification, order_id))
    return {"notification": notification}


def _execute(statement: str, params: tuple[Any, ...]) -> None:
    try:
        with idempotency.connection().cursor() as cur:
            cur.execute(statement, params)
    except (psycopg2.OperationalError, psycopg2.InterfaceError) as exc:
        raise StoreUnavailable() from exc


def _answer(order_id: str, owner: str) -> Response:
    with idempotency.connection().cursor() as cur:
        cur.execute(GET_ORDER, (order_id, owner))
        row = cur.fetchone()
    if row is None:
        raise RuntimeError("a committed order is missing")  # a 500 stores nothing
    response = jsonify(order_json(row))
    response.status_code = 201
    response.headers["Location"] = url_for("orders.get_order", order_id=order_id)
    return response


@bp.get("/v1/orders/<order_id>")
@require_api_key
def get_order(order_id: str) -> Response:
    with idempotency.transaction() as conn, conn.cursor() as cur:
        cur.execute(GET_ORDER, (order_id, current_owner()))
        row = cur.fetchone()
    if row is None:
        raise resource_missing("No such order.")
    return jsonify(order_json(row))
