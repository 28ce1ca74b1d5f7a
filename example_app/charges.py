"""The payments API: create a charge once, however often the client retries.

``POST /v1/charges`` calls the processor with a key derived from the idempotency
record, then writes the charge on the extension's connection, so the charge row
and the stored response commit together or not at all. A crash between the
processor's answer and that commit leaves no row and no completion; the retry
takes the record over after the lease and sends the same derived key, and the
processor answers with the payment it already made instead of charging again.
When no retry ever comes, ``flask idempotency recover`` runs ``recover_charge``:
it asks the processor which payment was made under the derived key and records
it exactly as the view would have, or releases the record if there is none.
"""

from __future__ import annotations

import logging
import re
import secrets
import time
from typing import Any

import psycopg2
from flask import Blueprint, Request, Response, current_app, g, jsonify, request, url_for
from typing_extensions import assert_never

from example_app.auth import current_owner, require_api_key
from example_app.errors import json_error, resource_missing
from example_app.extensions import idempotency
from example_app.processor_client import (
    Charged,
    Declined,
    NoPayment,
    ProcessorClient,
    ProcessorUnavailable,
)
from example_app.schemas import ChargeRequest, load_charge_request, load_customer_query
from flask_idempotency import Abandoned, SchemaMissing, StoreUnavailable
from flask_idempotency.client import purpose_key

log = logging.getLogger(__name__)

bp = Blueprint("charges", __name__)

PROCESSOR_CLIENT_KEY = "processor_client"

#: The event a created charge emits (CONTRACT §5); the receipts service consumes it.
CHARGE_SUCCEEDED = "charge.succeeded"

#: ``created`` is whole Unix seconds, as in the answers; ``seq`` breaks ties.
_CHARGE_COLUMNS = (
    "id, amount, currency, customer, status, floor(extract(epoch FROM created_at))::bigint"
)

#: One payment is one charge, whatever happened to the idempotency record: a key
#: reused after its TTL (the record purged, the processor still remembering the key)
#: gets the processor's earlier payment back, and so the charge already recorded
#: for it (``CHARGE_FOR_PAYMENT``), never a second row.
INSERT_CHARGE = f"""
INSERT INTO charges (id, owner, customer, amount, currency, description, status, payment_id)
VALUES (%s, %s, %s, %s, %s, %s, 'succeeded', %s)
ON CONFLICT (payment_id) DO NOTHING
RETURNING {_CHARGE_COLUMNS}
"""

CHARGE_FOR_PAYMENT = f"SELECT {_CHARGE_COLUMNS} FROM charges WHERE payment_id = %s AND owner = %s"

GET_CHARGE = f"SELECT {_CHARGE_COLUMNS} FROM charges WHERE id = %s AND owner = %s"

#: Newest first by the ``created`` the client sees; within one second, creation order.
LIST_CHARGES = f"""
SELECT {_CHARGE_COLUMNS} FROM charges
 WHERE owner = %s AND customer = %s
 ORDER BY date_trunc('second', created_at) DESC, seq
"""

_CHARGE_ID = re.compile(r"ch_[0-9a-f]{24}\Z")


def new_charge_id() -> str:
    return "ch_" + secrets.token_hex(12)


def charge_json(row: tuple[Any, ...]) -> dict[str, Any]:
    charge_id, amount, currency, customer, status, created = row
    return {
        "id": charge_id,
        "object": "charge",
        "amount": int(amount),
        "currency": currency,
        "customer": customer,
        "status": status,
        "created": int(created),
    }


def processor_client() -> ProcessorClient:
    client: ProcessorClient = current_app.extensions[PROCESSOR_CLIENT_KEY]
    return client


def crash_drill_pause() -> None:
    """``CRASH_DRILL_DELAY_SECONDS`` (0 anywhere real): linger at a point where a crash
    leaves work half done, so crash drills can land a SIGKILL there."""
    delay: float = current_app.config.get("CRASH_DRILL_DELAY_SECONDS") or 0.0
    if delay > 0:
        time.sleep(delay)


def charge_recovery_data(req: Request) -> dict[str, str]:
    """What recovering a charge needs besides its request: the owner, which the
    record only holds hashed into its key (``require_api_key`` set it)."""
    return {"owner": current_owner()}


def recover_charge(attempt: Abandoned) -> Response | None:
    """``flask idempotency recover``: settle a charge whose worker died.

    It never charges: it asks the processor which payment was made under the
    derived key the view sent. A payment is recorded exactly as the view would
    have (charge row, ``charge.succeeded`` and the ``201``, in one transaction);
    a decline is the stored ``402``; no payment releases the record (``None``),
    so a later retry charges afresh; no certain answer is a ``502``, and the next
    pass asks again.
    """
    charge = load_charge_request(request)  # the original body, as the view parsed it
    g.api_owner = attempt.data["owner"]
    outcome = processor_client().lookup(idempotency.derived_key("processor"))
    match outcome:
        case Charged(payment_id=payment_id):
            return _record_charge(charge, payment_id)
        case Declined():
            return _declined()
        case NoPayment():
            return None
        case ProcessorUnavailable(reason=reason):
            log.warning("card processor lookup unavailable: %s", reason)
            return _processor_unavailable()
        case _:
            assert_never(outcome)


@bp.post("/v1/charges")
@require_api_key
@idempotency.required(recover=recover_charge, recovery_data=charge_recovery_data)
def create_charge() -> Response:
    charge = load_charge_request(request)
    outcome = processor_client().charge(
        purpose_key("processor"),
        charge.amount,
        charge.currency,
        charge.customer,
        charge.source,
    )
    match outcome:
        case Charged(payment_id=payment_id):
            crash_drill_pause()  # charged, not yet recorded: the gap recovery closes
            return _record_charge(charge, payment_id)
        case Declined():
            return _declined()
        case ProcessorUnavailable(reason=reason):
            log.warning("card processor unavailable: %s", reason)
            return _processor_unavailable()
        case _:
            assert_never(outcome)


def _declined() -> Response:
    # A final answer: stored by the extension and replayed to retries.
    return json_error(402, "card_error", "card_declined", "The card was declined.")


def _processor_unavailable() -> Response:
    # Unknown outcome: a 5xx stores nothing, and a retry asks the processor again
    # under the same derived key, which cannot charge twice.
    return json_error(
        502,
        "api_error",
        "processor_unavailable",
        "The card processor did not answer; retry with the same Idempotency-Key.",
    )


def _record_charge(charge: ChargeRequest, payment_id: str) -> Response:
    """Insert the charge in the transaction that will also store this answer."""
    conn = idempotency.connection()
    owner = current_owner()
    params = (
        new_charge_id(),
        owner,
        charge.customer,
        charge.amount,
        charge.currency,
        charge.description,
        payment_id,
    )
    try:
        with conn.cursor() as cur:
            cur.execute(INSERT_CHARGE, params)
            row = cur.fetchone()
            created = row is not None
            if row is None:
                cur.execute(CHARGE_FOR_PAYMENT, (payment_id, owner))
                row = cur.fetchone()
        if created and row is not None:
            # In the same transaction as the charge row and the stored answer: a
            # released, rolled-back or fenced attempt emits nothing. A payment
            # already recorded (a key reused after its TTL) emitted its event then.
            idempotency.emit(CHARGE_SUCCEEDED, {**charge_json(row), "owner": owner})
    except (psycopg2.OperationalError, psycopg2.InterfaceError) as exc:
        raise StoreUnavailable() from exc
    if row is None:
        # The derived key includes the API key, so this cannot happen; if it does,
        # a 500 stores nothing and records nothing.
        raise RuntimeError("the processor's payment is recorded under another API key")
    body = charge_json(row)
    response = jsonify(body)
    response.status_code = 201
    response.headers["Location"] = url_for("charges.get_charge", charge_id=body["id"])
    return response


@bp.get("/v1/charges/<charge_id>")
@require_api_key
def get_charge(charge_id: str) -> Response:
    if not _CHARGE_ID.match(charge_id):
        raise resource_missing()
    with idempotency.transaction() as conn, conn.cursor() as cur:
        cur.execute(GET_CHARGE, (charge_id, current_owner()))
        row = cur.fetchone()
    if row is None:
        # Another API key's charge is as missing as one that never existed.
        raise resource_missing()
    return jsonify(charge_json(row))


@bp.get("/v1/charges")
@require_api_key
def list_charges() -> Response:
    customer = load_customer_query(request)
    with idempotency.transaction() as conn, conn.cursor() as cur:
        cur.execute(LIST_CHARGES, (current_owner(), customer))
        rows = cur.fetchall()
    return jsonify({"data": [charge_json(row) for row in rows]})


@bp.get("/healthz")
def healthz() -> Response | tuple[Response, int, dict[str, str]]:
    """Up when PostgreSQL answers with the extension's schema: without it no charge
    can be taken (fail closed). A missing schema is a deployment step to take, not
    an outage to wait out: 500 and no Retry-After."""
    try:
        idempotency.ping()
    except SchemaMissing as exc:  # and SchemaOutdated
        return jsonify({"status": "misconfigured", "postgres": exc.error_code}), 500, {}
    except StoreUnavailable as exc:
        body = {"status": "unavailable", "postgres": "unreachable"}
        return jsonify(body), 503, {"Retry-After": str(exc.retry_after)}
    return jsonify({"status": "ok", "postgres": "ok"})
