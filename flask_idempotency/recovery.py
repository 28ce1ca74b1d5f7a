"""Recovery of abandoned attempts: what a ``recover=`` route keeps, and gets back.

A worker that dies after a payment processor charged but before its commit
leaves a ``processing`` record and no business row. A retry would take the
record over and the processor would replay the payment; when no retry ever
comes (a phone that lost signal, a batch job that crashed), nothing would
record it. So a route can say how to finish such an attempt without its
client::

    @idempotency.required(recover=recover_charge, recovery_data=owner_of_request)
    def create_charge(): ...

Its claim then keeps what recovery needs with the record, in the claim
statement itself (:func:`capture`: the endpoint, the request as the view saw
it, and ``recovery_data(request)``, JSON for what the request alone does not
say, such as a principal the record only holds hashed); other routes write
nothing more. The completion drops it. ``flask idempotency recover``
(``completer.py``) later hands an abandoned attempt to ``recover_charge`` as an
:class:`Abandoned`, in a request context rebuilt from the stored request.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import inspect
import json
from collections.abc import Mapping
from typing import Any

from flask import Flask, Request
from werkzeug.test import create_environ

from . import digests
from .request_body import whole_body
from .route_options import RouteOptions

#: Set on the decorator's wrapper (and copied outwards by ``functools.wraps``), so
#: the command finds each endpoint's options in ``app.view_functions``.
ROUTE_ATTRIBUTE = "_idempotency_route"

#: Version of the stored payload's layout; a payload of another is left alone.
PAYLOAD_VERSION = 1


def capture(options: RouteOptions, request: Request) -> bytes:
    """What recovery needs of this request, written with its claim: the endpoint,
    the request as the view saw it (method, URL, content type, body) and the
    route's ``recovery_data(request)``. Kept only while the attempt is unfinished.
    """
    data = options.recovery_data(request) if options.recovery_data is not None else None
    document = {
        "v": PAYLOAD_VERSION,
        "endpoint": request.endpoint,
        "method": request.method,
        "root_url": request.root_url,
        "path": request.path,
        "query": request.query_string.decode("latin-1"),
        "content_type": request.content_type,
        "body": base64.b64encode(whole_body(request)).decode("ascii"),
        "data": data,
    }
    try:
        return json.dumps(document, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        raise TypeError(f"recovery_data= must return JSON: {exc}") from None


@dataclasses.dataclass(frozen=True)
class Abandoned:
    """An attempt whose holder died, as the route's ``recover=`` function gets it.

    While the function runs, ``flask.request`` is this request rebuilt (so the
    view's own parsing works on it) and ``idempotency.connection()``,
    ``derived_key()``, ``emit()`` and ``phase()`` are bound to the record.
    """

    endpoint: str
    method: str
    path: str
    query: str
    content_type: str | None
    body: bytes
    #: What the route's ``recovery_data(request)`` returned (JSON), or ``None``.
    data: Any
    #: The recovery points the dead holder committed, in order.
    phases: Mapping[str, Any]
    #: Seconds since the record's lease ended, when it was taken over.
    abandoned_seconds: float
    root_url: str = dataclasses.field(default="http://localhost/", repr=False)
    record_key: bytes = dataclasses.field(default=b"", repr=False)

    @classmethod
    def from_payload(
        cls, raw: bytes, record_key: bytes, phases: Mapping[str, Any], abandoned: float
    ) -> Abandoned:
        """``ValueError`` for a payload this version cannot read."""
        try:
            doc = json.loads(raw)
            if (version := doc.pop("v", None)) != PAYLOAD_VERSION:
                raise ValueError(f"payload version {version!r}")
            doc["body"] = base64.b64decode(doc["body"], validate=True)
            # The fields capture() wrote, no more and no fewer (else a TypeError).
            return cls(**doc, phases=phases, abandoned_seconds=abandoned, record_key=record_key)
        except (KeyError, TypeError, AttributeError, binascii.Error) as exc:
            raise ValueError(f"unreadable recovery payload ({type(exc).__name__})") from None

    def derived_key(self, purpose: str) -> str:
        """The key the view sent downstream for ``purpose`` (``idempotency.derived_key``)."""
        return digests.derived_key(self.record_key, purpose)

    def environ(self) -> dict[str, Any]:
        return create_environ(
            path=self.path,
            base_url=self.root_url,
            query_string=self.query,
            method=self.method,
            data=self.body,
            content_type=self.content_type,
        )


def route_options_of(view: Any) -> RouteOptions | None:
    """The options of an idempotent view (``None`` for any other view): on the
    decorator's wrapper, or under decorators above it that did not copy them."""
    try:
        fn = inspect.unwrap(view, stop=lambda f: hasattr(f, ROUTE_ATTRIBUTE))
    except ValueError:  # a cycle of __wrapped__
        return None
    options = getattr(fn, ROUTE_ATTRIBUTE, None)
    return options if isinstance(options, RouteOptions) else None


def recoverable_routes(app: Flask) -> dict[str, RouteOptions]:
    """Each endpoint of ``app`` whose idempotent view declares ``recover=``."""
    every = {endpoint: route_options_of(view) for endpoint, view in app.view_functions.items()}
    return {endpoint: o for endpoint, o in every.items() if o is not None and o.recover is not None}
