"""Reading and validating the key header, the scope, and the digests derived from them.

Keys are never stored or logged raw: the record's primary key is a SHA-256 of
(scope, key), and logs carry a short prefix of that digest.
"""

from __future__ import annotations

import hashlib

from flask import Request

from .errors import InvalidKey, MissingKey

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
    """
    if raw is None:
        return None
    key = raw.strip(" \t")
    if len(key) >= 2 and key[0] == '"' and key[-1] == '"':
        key = _unquote_sf_string(key[1:-1])
    if not key or len(key) > MAX_KEY_LENGTH or not _VISIBLE_ASCII.issuperset(key):
        raise InvalidKey()
    return key


def require_key(raw: str | None) -> str:
    key = parse_key(raw)
    if key is None:
        raise MissingKey()
    return key


def _unquote_sf_string(inner: str) -> str:
    """Undo sf-string escapes (``\\"`` and ``\\\\``); a bare quote or a bad escape is invalid."""
    out: list[str] = []
    chars = iter(inner)
    for ch in chars:
        if ch == "\\":
            nxt = next(chars, "")
            if nxt not in ('"', "\\"):
                raise InvalidKey()
            out.append(nxt)
        elif ch == '"':
            raise InvalidKey()
        else:
            out.append(ch)
    return "".join(out)


def default_scope(request: Request) -> str:
    """Scope records by the caller's credentials, hashed so no secret is kept.

    Two API keys sending the same Idempotency-Key get independent records.
    Requests without an ``Authorization`` header share the empty scope.
    """
    return default_scope_from_header(request.headers.get("Authorization", ""))


def default_scope_from_header(authorization: str) -> str:
    """The default scope for a raw ``Authorization`` value (also used by the CLI)."""
    if not authorization:
        return ""
    return hashlib.sha256(authorization.encode("utf-8", "surrogateescape")).hexdigest()


def record_key(scope: str, key: str) -> bytes:
    """The record's primary key: SHA-256 over the length-prefixed scope and the key.

    The length prefix keeps (``"ab"``, ``"c"``) and (``"a"``, ``"bc"``) apart.
    """
    scope_bytes = scope.encode("utf-8", "surrogateescape")
    material = b"%d:" % len(scope_bytes) + scope_bytes + key.encode("ascii")
    return hashlib.sha256(material).digest()


def log_key(digest: bytes) -> str:
    """A short, non-reversible label for logs: enough to correlate, nothing to replay."""
    return digest[:6].hex()


def derived_key(digest: bytes, purpose: str) -> str:
    """A stable key for a downstream call (e.g. a card processor) derived from the record.

    A retry of the same client request - even after a crash between the
    downstream answer and our commit - derives the same key, so the downstream
    service's own idempotency prevents a second charge.
    """
    return hashlib.sha256(digest + b"\x00" + purpose.encode("utf-8")).hexdigest()
