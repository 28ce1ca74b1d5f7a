"""API-key authentication: ``Authorization: Bearer <key>``.

Any non-empty token is an API key in this demo. The key is never kept: the
idempotency scope and the owner of a charge are a SHA-256 of it, so two keys
sending the same Idempotency-Key get independent records and see only their
own charges.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from flask import Request, g, request

from example_app.errors import ApiError

P = ParamSpec("P")
R = TypeVar("R")

#: RFC 6750: tell the client which scheme to use.
_CHALLENGE = (("WWW-Authenticate", 'Bearer realm="payments"'),)


def bearer_token(authorization: str | None) -> str | None:
    """The token of a ``Bearer`` credential (scheme case-insensitive), else ``None``."""
    parts = (authorization or "").split(None, 1)
    if len(parts) != 2 or parts[0].lower() != "bearer":
        return None
    token = parts[1].strip()
    if not token or any(ch.isspace() for ch in token):
        return None
    return token


def owner_of(token: str) -> str:
    """The stable, non-secret identity of an API key (charges' ``owner`` column)."""
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).hexdigest()


def api_key_scope(req: Request) -> str | None:
    """``IDEMPOTENCY_SCOPE_FUNC``: records belong to the API key's owner, as charges do.

    ``None`` without a key: no principal, so the extension refuses rather than pool
    the request with others (``require_api_key`` answers 401 before that anyway).
    """
    token = bearer_token(req.headers.get("Authorization"))
    return owner_of(token) if token is not None else None


def missing_api_key() -> ApiError:
    return ApiError(
        401,
        "authentication_error",
        "missing_api_key",
        "Provide your API key in an 'Authorization: Bearer <api key>' header.",
        headers=_CHALLENGE,
    )


def require_api_key(view: Callable[P, R]) -> Callable[P, R]:
    """Answer 401 before anything else; put it above ``@idempotency.required`` so a
    401 is never stored and never claims a key."""

    @functools.wraps(view)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        token = bearer_token(request.headers.get("Authorization"))
        if token is None:
            raise missing_api_key()
        g.api_owner = owner_of(token)
        return view(*args, **kwargs)

    return wrapper


def current_owner() -> str:
    """The owner set by :func:`require_api_key` for this request."""
    owner: str = g.api_owner
    return owner
