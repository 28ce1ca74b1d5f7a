"""What a valid charge request is (CONTRACT §2), as marshmallow schemas.

Validation is strict on purpose: in a payments API ``100.0`` or ``"100"`` as an
amount is a client bug to report, not a value to guess at.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from flask import Request
from marshmallow import RAISE, Schema, ValidationError, fields, post_load, validate

from example_app.errors import ApiError, invalid_request

MAX_AMOUNT = 99_999_999


class JsonInteger(fields.Integer):
    """A JSON integer only: floats (``100.0``), booleans and strings are refused.

    ``strict=True`` alone lets ``true`` through on marshmallow 3 (bool is an int).
    """

    def _deserialize(self, value: Any, attr: str | None, data: Any, **kwargs: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.make_error("invalid")
        return super()._deserialize(value, attr, data, **kwargs)


def storable_text(value: str) -> None:
    """PostgreSQL text cannot hold NUL, and lone surrogates are not UTF-8: refuse
    them here as a 400 instead of failing in the database as a 500."""
    if "\x00" in value:
        raise ValidationError("Must not contain NUL characters.")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValidationError("Must be valid Unicode text.") from None


def _short_text(required: bool = True) -> fields.String:
    return fields.String(
        required=required, validate=[validate.Length(min=1, max=64), storable_text]
    )


@dataclasses.dataclass(frozen=True)
class ChargeRequest:
    amount: int
    currency: str
    customer: str
    source: str
    description: str | None


class ChargeRequestSchema(Schema):
    class Meta:
        unknown = RAISE

    amount = JsonInteger(required=True, strict=True, validate=validate.Range(1, MAX_AMOUNT))
    currency = fields.String(
        required=True,
        validate=validate.Regexp(r"[A-Za-z]{3}\Z", error="Must be 3 ASCII letters."),
    )
    customer = _short_text()
    source = _short_text()
    description = fields.String(load_default=None, allow_none=True, validate=storable_text)

    @post_load
    def make_request(self, data: dict[str, Any], **kwargs: Any) -> ChargeRequest:
        return ChargeRequest(
            amount=data["amount"],
            currency=data["currency"].lower(),
            customer=data["customer"],
            source=data["source"],
            description=data["description"],
        )


@dataclasses.dataclass(frozen=True)
class OrderRequest:
    sku: str
    quantity: int
    amount: int
    currency: str
    customer: str
    source: str


class OrderRequestSchema(Schema):
    class Meta:
        unknown = RAISE

    sku = _short_text()
    quantity = JsonInteger(required=True, strict=True, validate=validate.Range(1, 1000))
    amount = JsonInteger(required=True, strict=True, validate=validate.Range(1, MAX_AMOUNT))
    currency = fields.String(
        required=True,
        validate=validate.Regexp(r"[A-Za-z]{3}\Z", error="Must be 3 ASCII letters."),
    )
    customer = _short_text()
    source = _short_text()

    @post_load
    def make_request(self, data: dict[str, Any], **kwargs: Any) -> OrderRequest:
        return OrderRequest(**{**data, "currency": data["currency"].lower()})


class ListChargesSchema(Schema):
    class Meta:
        unknown = "exclude"

    customer = _short_text()


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def json_object_body(req: Request) -> Any:
    """The parsed JSON body, or a 400 that says what is wrong with it."""
    if not req.is_json:
        raise invalid_request(
            "invalid_content_type", "The body must be JSON (Content-Type: application/json)."
        )
    try:
        return json.loads(req.get_data(cache=True), parse_constant=_refuse_constant)
    except (ValueError, RecursionError):
        raise invalid_request("invalid_json", "The body is not valid JSON.") from None


def validation_failed(messages: Any) -> ApiError:
    return invalid_request(
        "validation_failed", "The request has invalid fields.", fields=_field_messages(messages)
    )


def _field_messages(messages: Any) -> dict[str, Any]:
    if isinstance(messages, dict):
        return {str(k): v for k, v in messages.items()}
    return {"_schema": messages if isinstance(messages, list) else [str(messages)]}


def load_charge_request(req: Request) -> ChargeRequest:
    body = json_object_body(req)
    try:
        loaded: ChargeRequest = ChargeRequestSchema().load(body)
    except ValidationError as exc:
        raise validation_failed(exc.messages) from None
    return loaded


def load_order_request(req: Request) -> OrderRequest:
    body = json_object_body(req)
    try:
        loaded: OrderRequest = OrderRequestSchema().load(body)
    except ValidationError as exc:
        raise validation_failed(exc.messages) from None
    return loaded


def load_customer_query(req: Request) -> str:
    try:
        loaded: dict[str, str] = ListChargesSchema().load(req.args.to_dict())
    except ValidationError as exc:
        raise validation_failed(exc.messages) from None
    return loaded["customer"]
