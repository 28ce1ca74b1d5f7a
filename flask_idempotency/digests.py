"""The record's key and what is derived from it: pure hashing, no Flask.

Low in the package so that the metrics, logs and stores can label a record
without importing the request layer.
"""

from __future__ import annotations

import hashlib


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
