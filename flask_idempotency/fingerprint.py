"""The canonical request fingerprint: what makes two requests "the same request".

SHA-256 over the method, the path with its query string, and the canonical
body. A JSON body compares after parsing, so key order and whitespace do not
matter, while ``1500`` and ``1500.0`` stay different (ints and floats keep
their type through ``json``). Any other body compares as bytes, fed to the
digest as it streams in (``request_body``), so it is never held whole.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable

from flask import Request

#: Made once: ``json.dumps`` with any argument builds a new encoder per call, and
#: ``json.loads`` of bytes detects their encoding first (both on every request).
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)
_DECODER = json.JSONDecoder()


def _canonical_encoder() -> Callable[[object], str]:
    """``_CANONICAL.encode``, with the C encoder it makes per call made once.

    ``JSONEncoder.encode`` builds a new C encoder (and a float formatter) on every
    call; the body's fingerprint needs the same one every time. Without a
    circular-reference check, which a value ``json.loads`` returned never needs.
    """
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:  # (a Python without the C accelerator)
        return _CANONICAL.encode
    chunks = make(
        None, _CANONICAL.default, json.encoder.encode_basestring, None, ":", ",", True, False, True
    )
    return lambda value: "".join(chunks(value, 0))


_encode_canonical = _canonical_encoder()


def is_json_mimetype(mimetype: str) -> bool:
    return mimetype == "application/json" or (
        mimetype.startswith("application/") and mimetype.endswith("+json")
    )


def canonical_body(mimetype: str, body: bytes) -> bytes:
    """JSON bodies re-serialised with sorted keys; anything unparsable stays raw bytes."""
    if not body or not is_json_mimetype(mimetype):
        return body
    try:
        parsed = _parse(body)
    except (ValueError, RecursionError):
        # Not valid JSON: the view will reject it; compare the bytes as sent.
        return body
    try:
        return _encode_canonical(parsed).encode("utf-8", "surrogatepass")
    except (ValueError, RecursionError):
        return body


def _parse(body: bytes) -> object:
    """``json.loads(body)``: a body opening with ``{`` or ``[`` and no NUL after it
    is UTF-8 by ``json.detect_encoding``'s own rules, so it is decoded as such
    without asking; anything else goes the whole way."""
    if body[:1] in (b"{", b"[") and body[1:2] != b"\x00":
        return _DECODER.decode(body.decode("utf-8", "surrogatepass"))
    return json.loads(body)


#: Where ``request_body.read_body`` leaves the request's fingerprint, computed as the
#: body streamed in: a WSGI environ key, named for the package as PEP 3333 asks (no
#: client header can produce it: those arrive as ``HTTP_*``).
FINGERPRINT_ENVIRON_KEY = "flask_idempotency.fingerprint"


def start(method: str, path: str, query: bytes) -> hashlib._Hash:
    """The digest with the request line in it; the canonical body is fed next.

    Split from :func:`fingerprint` so that a body can be hashed chunk by chunk as
    it arrives, giving the same bytes as hashing it whole.
    """
    h = hashlib.sha256()
    h.update(method.upper().encode("ascii", "replace"))
    h.update(b"\x00")
    h.update(path.encode("utf-8", "surrogateescape"))
    if query:
        h.update(b"?")
        h.update(query)
    h.update(b"\x00")
    return h


def fingerprint(method: str, path: str, query: bytes, mimetype: str, body: bytes) -> bytes:
    h = start(method, path, query)
    h.update(canonical_body(mimetype, body))
    return h.digest()


def request_fingerprint(request: Request) -> bytes:
    """The default ``IDEMPOTENCY_FINGERPRINT_FUNC``: the fingerprint the extension
    computed while it read the body; for a request it did not read, computed here."""
    known = request.environ.get(FINGERPRINT_ENVIRON_KEY)
    if isinstance(known, bytes):
        return known
    return fingerprint(
        request.method,
        request.path,
        request.query_string,
        request.mimetype,
        request.get_data(cache=True),
    )
