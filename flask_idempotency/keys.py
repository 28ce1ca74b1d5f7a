"""Reading and validating the key header, resolving the scope, and the digests derived from them.

Keys are never stored or logged raw: the record's primary key is a SHA-256 of
(scope, key), and logs carry a short prefix of that digest.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

from flask import Request

from .errors import InvalidKey, ScopeUnavailable

log = logging.getLogger("flask_idempotency.requests")

#: The scopes of event consumers' and Celery tasks' records (``consumer:<name>``,
#: ``events/consumer.py``): an HTTP scope is refused from this namespace, so no
#: value a scope function returns can claim (or pre-claim) a message's key.
#: Refusing, rather than moving consumers and tasks elsewhere, keeps every record
#: key and every derived key byte-identical across the upgrade, HTTP, consumer
#: and task alike: the only requests it changes are those that collided.
RESERVED_SCOPE_PREFIX = "consumer:"

#: The IETF draft and Stripe both cap keys at 255 characters.
MAX_KEY_LENGTH = 255
_VISIBLE_ASCII = frozenset(chr(c) for c in range(0x21, 0x7F))


def parse_key(raw: str | None) -> str | None:
    """Return the client's key, ``None`` when the header is absent.

    Accepts the Structured-Field string form (``"abc"``) as ``abc``, since the
    IETF draft defines the header as an sf-string and some clients quote it.
    Raises :class:`InvalidKey` for anything else outside 1..255 visible ASCII.

    Surrounding spaces and tabs are not part of a field value (RFC 9110 §5.5);
    gunicorn strips them but Werkzeug's server keeps trailing ones, so they are
    dropped here, or one key would be valid under one server and not another.

    One value only: a server joins repeated header lines with a comma (RFC 9110
    §5.3; gunicorn ``a,b``, Werkzeug ``a, b``), so an unquoted comma means the
    client sent more than one key, and no choice between them is safe (a retry
    carrying only ``a`` would run again). Inside quotes a comma is the key's own.
    """
    if raw is None:
        return None
    key = raw.strip(" \t")
    if len(key) >= 2 and key[0] == '"' and key[-1] == '"':
        key = _unquote_sf_string(key[1:-1])
    elif "," in key:
        raise InvalidKey()
    if not key or len(key) > MAX_KEY_LENGTH or not _VISIBLE_ASCII.issuperset(key):
        raise InvalidKey()
    return key


#: The inside of an sf-string (RFC 8941): no bare quote, and a backslash escapes
#: only a quote or a backslash.
_SF_STRING_INSIDE = re.compile(r'(?:[^"\\]|\\["\\])*')
_SF_ESCAPE = re.compile(r'\\(["\\])')


def _unquote_sf_string(inner: str) -> str:
    """Undo sf-string escapes (``\\"`` and ``\\\\``); a bare quote or a bad escape is invalid."""
    if not _SF_STRING_INSIDE.fullmatch(inner):
        raise InvalidKey()
    return _SF_ESCAPE.sub(r"\1", inner)


def resolve_scope(scope_func: Callable[[Request], str | None], request: Request) -> str:
    """The request's scope, as ``scope_func`` names it.

    ``None`` means the request names no principal: it is refused with
    :class:`ScopeUnavailable` (``400 missing_scope``) before anything is claimed,
    rather than pooled with other principals' records; so is a scope in the
    consumers' and tasks' namespace (:data:`RESERVED_SCOPE_PREFIX`). Anything but a ``str``
    or ``None`` is a bug in the scope function, raised as a ``TypeError``.
    """
    scope: object = scope_func(request)
    if isinstance(scope, str):
        if scope.startswith(RESERVED_SCOPE_PREFIX):
            # A user-chosen name (a tenant, a login) reaching a consumer's namespace:
            # refused like a request with no principal, the value never logged.
            log.warning(
                "idempotency: the scope function %s returned a scope in the reserved "
                "%r namespace (event consumers' and Celery tasks' records); refused",
                getattr(scope_func, "__qualname__", repr(scope_func)),
                RESERVED_SCOPE_PREFIX,
            )
            raise ScopeUnavailable()
        return scope
    if scope is None:
        raise ScopeUnavailable()
    name = getattr(scope_func, "__qualname__", repr(scope_func))
    raise TypeError(
        f"the idempotency scope function {name} returned {type(scope).__name__}; "
        "it must return a str, or None when the request names no principal"
    )
