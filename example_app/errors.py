"""Every answer is JSON, errors included: the app's own, Werkzeug's and the extension's.

Clients of a payments API parse errors by ``type`` and ``code``; an HTML error
page (Flask's default for 404, 405, 413 and 500) would break them.
"""

from __future__ import annotations

import json
import re
from typing import Any

from flask import Flask, Response
from werkzeug.exceptions import HTTPException
from werkzeug.wrappers import Response as BaseResponse

from flask_idempotency import IdempotencyError


class ApiError(HTTPException):
    """An error of this API: ``{"error": {"type", "code", "message", ...extra}}``."""

    def __init__(
        self,
        status: int,
        error_type: str,
        error_code: str,
        message: str,
        *,
        headers: tuple[tuple[str, str], ...] = (),
        **extra: Any,
    ) -> None:
        super().__init__(message)
        self.code = status
        self.payload = {
            "error": {"type": error_type, "code": error_code, "message": message, **extra}
        }
        self.extra_headers = headers

    def get_body(self, environ: Any = None, scope: Any = None) -> str:
        return json.dumps(self.payload)

    def get_headers(self, environ: Any = None, scope: Any = None) -> list[tuple[str, str]]:
        return [("Content-Type", "application/json"), *self.extra_headers]

    def as_response(self) -> Response:
        """This error as a Flask response, for a view to return rather than raise."""
        return Response(self.get_body(), self.code, self.get_headers())


def invalid_request(code: str, message: str, **extra: Any) -> ApiError:
    """A 400 the client can fix; never stored, so a corrected retry under the key runs."""
    return ApiError(400, "invalid_request_error", code, message, **extra)


def resource_missing(message: str = "No such charge.") -> ApiError:
    return ApiError(404, "invalid_request_error", "resource_missing", message)


def json_error(status: int, error_type: str, error_code: str, message: str) -> Response:
    """An error as a response a view returns (rather than raises), such as a 402 or 502."""
    return ApiError(status, error_type, error_code, message).as_response()


def _snake_case(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def handle_http_exception(exc: HTTPException) -> BaseResponse | HTTPException:
    """Render Werkzeug's errors as JSON; pass ours and the extension's through unchanged.

    Headers such as ``Allow`` (405) and ``Retry-After`` are kept.
    """
    if isinstance(exc, ApiError | IdempotencyError) or exc.response is not None:
        return exc.get_response()
    if exc.code is None:
        return exc
    error_type = "api_error" if exc.code >= 500 else "invalid_request_error"
    error_code = "internal_error" if exc.code == 500 else _snake_case(type(exc).__name__)
    headers = tuple((k, v) for k, v in exc.get_headers() if k.lower() != "content-type")
    message = exc.description or "Error."
    return ApiError(exc.code, error_type, error_code, message, headers=headers).as_response()


def register_error_handlers(app: Flask) -> None:
    # Flask routes unhandled exceptions here too, as an InternalServerError, after
    # logging them; the extension then sees a 500 and stores nothing.
    app.register_error_handler(HTTPException, handle_http_exception)
