"""Scope functions: who a key belongs to.

A record is keyed by (scope, key), so one principal (a user, an API key, a
tenant) never sees another's stored answer, even when both send the same key
and the same body. A scope function takes the request and returns a string
naming the principal, or ``None`` when the request names none; the extension
then refuses the request (``400 missing_scope``) rather than pool it with
other principals' records.

Configure one app-wide with ``IDEMPOTENCY_SCOPE_FUNC`` or per route with
``scope_func=``. The scope is only hashed (with the key) into the record's
primary key, so it may hold identifiers but never needs to hold a secret.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable
from typing import Any

from flask import Request, current_app

#: What ``user_scope`` and the flask-login branch of ``default_scope`` put before a
#: user id, so a user id can never equal an ``Authorization`` digest (64 hex digits).
USER_PREFIX = "user:"


def default_scope(request: Request) -> str | None:
    """The default ``IDEMPOTENCY_SCOPE_FUNC``, in this order:

    1. flask-login's ``current_user``, when the app uses flask-login (it has a
       ``login_manager``) and the user is authenticated: ``"user:" + get_id()``.
       A user id stays the same when the user's token or session is renewed.
    2. else the ``Authorization`` header, hashed (:func:`authorization_scope`):
       the same scope as before this order existed, so records stored under it
       still replay.
    3. else ``None``: no principal, and the request is refused.
    """
    return _flask_login_scope(request) or authorization_scope(request)


def authorization_scope(request: Request) -> str | None:
    """The SHA-256 of the raw ``Authorization`` header; ``None`` without one.

    A client whose token rotates (an OAuth or JWT refresh) gets a new scope, so
    a retry after a refresh runs again: scope by the user or account behind
    the token instead (:func:`user_scope`) whenever the app can name it.
    """
    authorization = request.headers.get("Authorization")
    return authorization_digest(authorization) if authorization else None


def authorization_digest(authorization: str) -> str:
    """The scope :func:`authorization_scope` gives a raw ``Authorization`` value."""
    return hashlib.sha256(authorization.encode("utf-8", "surrogateescape")).hexdigest()


def global_scope(request: Request) -> str:
    """One scope shared by every request: only for an app with a single principal
    (one client, or a service behind its own gateway that sends no credentials).

    Any two requests with the same key and body are the same request under it,
    whoever sent them. It is the empty scope, the one requests without an
    ``Authorization`` header had before an undeterminable principal was refused,
    so such an app's records stored then still replay once it opts in.
    """
    return ""


def user_scope(get_user_id: Callable[[], Any]) -> Callable[[Request], str | None]:
    """A scope function from a getter of the current user's (or account's) id.

    ``IDEMPOTENCY_SCOPE_FUNC = user_scope(lambda: g.user.id if "user" in g else None)``
    gives ``"user:<id>"``; a getter answering ``None`` (or an empty id) means no
    principal. The id is the same across token refreshes, so a retry made with a
    renewed token replays instead of running again.
    """

    def scope(request: Request) -> str | None:
        user_id = get_user_id()
        if user_id is None:
            return None
        text = str(user_id)
        return USER_PREFIX + text if text else None

    return scope


def _flask_login_user_id() -> Any:
    """The authenticated flask-login user's id, else ``None``.

    flask-login is never imported here: an app using it has imported it and set
    ``app.login_manager``; any other process pays one dict lookup.
    """
    flask_login: Any = sys.modules.get("flask_login")
    if flask_login is None or getattr(current_app, "login_manager", None) is None:
        return None
    user = flask_login.current_user
    return user.get_id() if getattr(user, "is_authenticated", False) else None


_flask_login_scope = user_scope(_flask_login_user_id)
