"""The canonical request fingerprint: what makes two requests "the same request".

SHA-256 over the method, the path with its query string, and the canonical
body. A JSON body compares after parsing, so key order and whitespace do not
matter, while ``1500`` and ``1500.0`` stay different (ints and floats keep
their type through ``json``). Any other body compares as bytes, fed to the
digest as it streams in (``request_body``), so it is never held whole.

The media type of ``Content-Type`` (lower case, parameters such as ``charset``
left out: Werkzeug's ``request.mimetype``) is part of the request too, so the
same bytes as ``text/plain`` and as ``application/json`` are two requests.
Fingerprints come in two formats, and a record is compared the way it was
written (:func:`matches`), so a retry that spans the upgrade replays:

* **v0**, the only one before 0.3.0: the 32-byte digest above. Still written
  for ``application/json`` bodies and for requests with neither a body nor a
  media type, the common cases that were never ambiguous, so that workers of
  the previous release, which compare fingerprints byte for byte, keep
  replaying them during a rolling upgrade.
* **v1**, every other request: :data:`V1_MARKER`, the v0 digest, and 16 bytes
  of SHA-256 over the media type (49 bytes). The v0 digest inside it is what a
  record written before 0.3.0 is compared with; the PostgreSQL claim does the
  same server-side (``store/sql.py``), and the claim's advisory lock is taken
  on it (``store.sql.advisory_locks``).

A v0 fingerprint is exactly 32 bytes, so the marker and the length tell the
formats apart.
"""

from __future__ import annotations

import hashlib
import json

from flask import Request

#: Sorted keys, no whitespace, and text as it is: what "the same JSON" compares.
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def is_json_mimetype(mimetype: str) -> bool:
    return mimetype == "application/json" or (
        mimetype.startswith("application/") and mimetype.endswith("+json")
    )


def canonical_body(mimetype: str, body: bytes) -> bytes:
    """JSON bodies re-serialised with sorted keys; anything unparsable stays raw bytes
    (not valid JSON: the view will reject it; compare the bytes as sent)."""
    if not body or not is_json_mimetype(mimetype):
        return body
    return _canonical_json(body) or body


def _canonical_json(body: bytes) -> bytes | None:
    """``body`` as canonical JSON (never empty), or ``None`` when it is no JSON."""
    try:
        return _CANONICAL.encode(json.loads(body)).encode("utf-8", "surrogatepass")
    except (ValueError, RecursionError):
        return None


#: Where ``request_body.read_body`` leaves the request's fingerprint, computed as the
#: body streamed in: a WSGI environ key, named for the package as PEP 3333 asks (no
#: client header can produce it: those arrive as ``HTTP_*``).
FINGERPRINT_ENVIRON_KEY = "flask_idempotency.fingerprint"


#: The first byte of a v1 fingerprint (a v0 one has none, and 32 bytes): whether a
#: v0 record may stand for this request. ``UNAMBIGUOUS``: the body is no canonical
#: JSON, so a v0 record of its digest can only be a non-JSON request of a release
#: before 0.3.0, compared as it was written. ``AMBIGUOUS``: the body is (or may
#: be) its own canonical JSON, so a v0 record of its digest may as well be an
#: ``application/json`` request with the same bytes (which v0 still is), a
#: different request: no fallback, a ``422``.
V1_UNAMBIGUOUS = b"\x01"
V1_AMBIGUOUS = b"\x02"
#: The bytes of the media type's digest in a v1 fingerprint: the media type is the
#: client's own choice for its own record (records are scoped), so 128 bits are
#: far beyond any accidental collision, and the record stays small.
MEDIA_TYPE_DIGEST_SIZE = 16
V0_SIZE = 32
V1_SIZE = 1 + V0_SIZE + MEDIA_TYPE_DIGEST_SIZE
#: The media type whose bodies keep v0 fingerprints (JSON compared canonically, as
#: the previous release compares it).
V0_MEDIA_TYPE = "application/json"
#: A body up to this size is checked exactly for being its own canonical JSON; a
#: larger one is taken for ambiguous when it opens as JSON may (no JSON API sends
#: such a body as ``text/plain`` in practice, and the cost is only a 422 for a retry
#: that spans the upgrade). Bounded, so a streamed body is never held whole.
KEEP_FOR_JSON_CHECK = 64 * 1024
_JSON_OPENINGS = frozenset(b'{["-0123456789tfn')


class Fingerprinter:
    """The fingerprint of one request: made with the request line, then fed the
    canonical body as it streams in, giving the same bytes as hashing it whole."""

    def __init__(self, method: str, path: str, query: bytes) -> None:
        # The request line: method NUL path[?query] NUL, then the body.
        verb = method.upper().encode("ascii", "replace")
        target = path.encode("utf-8", "surrogateescape") + (b"?" + query if query else b"")
        self._h = hashlib.sha256(verb + b"\x00" + target + b"\x00")
        self._kept = bytearray()
        self._size = 0

    def update(self, chunk: bytes) -> None:
        """Feed the next part of the canonical body."""
        self._h.update(chunk)
        self._size += len(chunk)
        if len(self._kept) <= KEEP_FOR_JSON_CHECK:
            self._kept += chunk[: KEEP_FOR_JSON_CHECK + 1 - len(self._kept)]

    def finish(self, mimetype: str) -> bytes:
        """The fingerprint, for ``mimetype`` as Werkzeug's ``request.mimetype`` gives
        it (lower case, no parameters)."""
        v0 = self._h.digest()
        if mimetype == V0_MEDIA_TYPE or (not mimetype and not self._size):
            return v0
        media = hashlib.sha256(b"media-type\x00" + mimetype.encode("latin-1", "replace"))
        marker = V1_AMBIGUOUS if self._may_be_canonical_json(mimetype) else V1_UNAMBIGUOUS
        return marker + v0 + media.digest()[:MEDIA_TYPE_DIGEST_SIZE]

    def _may_be_canonical_json(self, mimetype: str) -> bool:
        if is_json_mimetype(mimetype) or not self._size:
            return True
        kept = bytes(self._kept)
        if self._size > KEEP_FOR_JSON_CHECK:
            return kept[0] in _JSON_OPENINGS
        return _canonical_json(kept) == kept


def written_before(fp: bytes) -> bytes | None:
    """The v0 fingerprint a record written before 0.3.0 holds for the request whose
    fingerprint is ``fp``: ``fp`` itself when it is v0, the v0 digest inside an
    unambiguous v1 one, ``None`` when no v0 record can be this request's."""
    if len(fp) == V1_SIZE and fp[:1] in (V1_UNAMBIGUOUS, V1_AMBIGUOUS):
        return fp[1 : 1 + V0_SIZE] if fp[:1] == V1_UNAMBIGUOUS else None
    return fp


def matches(stored: bytes, fp: bytes) -> bool:
    """Whether a stored fingerprint is the request's, compared the way it was
    written: a v0 record (32 bytes) against the request's v0 digest when that
    cannot be another request's, any other byte for byte. A custom
    ``IDEMPOTENCY_FINGERPRINT_FUNC``'s values compare byte for byte (unless one is
    49 bytes opening with 0x01 and another exactly its 32 bytes after it: a
    custom function chooses its own format)."""
    if stored == fp:
        return True
    return len(stored) == V0_SIZE and len(fp) == V1_SIZE and stored == written_before(fp)


def fingerprint(method: str, path: str, query: bytes, mimetype: str, body: bytes) -> bytes:
    h = Fingerprinter(method, path, query)
    h.update(canonical_body(mimetype, body))
    return h.finish(mimetype)


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
