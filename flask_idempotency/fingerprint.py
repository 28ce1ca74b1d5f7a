"""The canonical request fingerprint: what makes two requests "the same request".

SHA-256 over the method, the path with its query string, and the canonical
body. A JSON body compares after parsing, so key order and whitespace do not
matter, while ``1500`` and ``1500.0`` stay different (ints and floats keep
their type through ``json``). Any other body compares as bytes.
"""

from __future__ import annotations

import hashlib
import json

from flask import Request


def is_json_mimetype(mimetype: str) -> bool:
    return mimetype == "application/json" or (
        mimetype.startswith("application/") and mimetype.endswith("+json")
    )


def canonical_body(mimetype: str, body: bytes) -> bytes:
    """JSON bodies re-serialised with sorted keys; anything unparsable stays raw bytes."""
    if not body or not is_json_mimetype(mimetype):
        return body
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):
        # Not valid JSON: the view will reject it; compare the bytes as sent.
        return body
    try:
        return json.dumps(parsed, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode(
            "utf-8", "surrogatepass"
        )
    except (ValueError, RecursionError):
        return body


def fingerprint(method: str, path: str, query: bytes, mimetype: str, body: bytes) -> bytes:
    h = hashlib.sha256()
    h.update(method.upper().encode("ascii", "replace"))
    h.update(b"\x00")
    h.update(path.encode("utf-8", "surrogateescape"))
    if query:
        h.update(b"?")
        h.update(query)
    h.update(b"\x00")
    h.update(canonical_body(mimetype, body))
    return h.digest()


def request_fingerprint(request: Request) -> bytes:
    """The default ``IDEMPOTENCY_FINGERPRINT_FUNC``."""
    return fingerprint(
        request.method,
        request.path,
        request.query_string,
        request.mimetype,
        request.get_data(cache=True),
    )
