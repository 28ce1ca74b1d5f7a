"""Who may write the cache: entries sealed with a key only this deployment holds.

Redis is not trusted (contract section 7). Whoever can write to it - another
application on a shared instance, a mis-scoped ACL, an attacker - must not
decide what a client gets. So every entry carries an HMAC-SHA256 tag over the
whole entry and its Redis key, under a key derived from:

- the application's secret (Flask's ``SECRET_KEY``, with a purpose label so
  the key means nothing to sessions or anything else signed with it; the
  ``SECRET_KEY_FALLBACKS`` still verify, so a rotated secret keeps the cache
  warm until the old entries expire), and
- the identity of the database (a random id the schema's migration 0011 writes
  once), so two deployments that share one Redis and even one secret never
  accept each other's entries. The Redis keys carry the identity too, so they
  never even read them.

An entry that fails verification is a miss, never an error: PostgreSQL, which
is trusted, answers the request and the entry is overwritten by a good one.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import struct
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..circuit import CircuitBreaker

log = logging.getLogger("flask_idempotency.cache")

#: Labels the derived key, and changes with the entry format: a key derived for
#: anything else (Flask's sessions, another version's entries) never verifies.
PURPOSE = b"flask-idempotency redis cache entry v2"

#: Bytes of the HMAC-SHA256 tag at the end of every entry.
TAG_SIZE = hashlib.sha256().digest_size

_KEY_LENGTH = struct.Struct(">H")


class Unauthentic(ValueError):
    """An entry whose tag no key of this deployment made: planted, changed, or
    written by another deployment or another secret."""


def secrets_from_config(config: Mapping[str, Any]) -> list[bytes]:
    """The application's secret first (it signs), then ``SECRET_KEY_FALLBACKS``
    (they only verify), as Flask and itsdangerous use them; empty ones skipped."""
    found = [config.get("SECRET_KEY")]
    fallbacks = config.get("SECRET_KEY_FALLBACKS") or ()
    if isinstance(fallbacks, (str, bytes)):
        fallbacks = (fallbacks,)
    found.extend(fallbacks)
    return [s if isinstance(s, bytes) else s.encode("utf-8") for s in found if s]


class Keyring:
    """The derived keys of one deployment: the first signs, every one verifies."""

    def __init__(self, secrets: Sequence[bytes], identity: bytes) -> None:
        #: What the Redis keys of this deployment start with after the prefix.
        self.namespace = identity.hex()
        self._keys = [
            hmac.new(secret, PURPOSE + b"\x00" + identity, hashlib.sha256).digest()
            for secret in secrets
        ]

    def seal(self, redis_key: bytes, payload: bytes) -> bytes:
        """``payload`` with its tag appended, bound to ``redis_key``."""
        return payload + self._tag(self._keys[0], redis_key, payload)

    def open(self, redis_key: bytes, value: bytes) -> bytes:
        """The payload of a sealed ``value``, or :class:`Unauthentic`."""
        if len(value) < TAG_SIZE:
            raise Unauthentic("shorter than a tag")
        payload, tag = value[:-TAG_SIZE], value[-TAG_SIZE:]
        expected = [self._tag(key, redis_key, payload) for key in self._keys]
        # Every expected tag is compared (a list, not any()'s short cut), in constant
        # time each: which key matched, and how much of a forged tag was right, never
        # shows in the timing.
        if not any([hmac.compare_digest(tag, mine) for mine in expected]):
            raise Unauthentic("the tag does not verify")
        return payload

    @staticmethod
    def _tag(key: bytes, redis_key: bytes, payload: bytes) -> bytes:
        mac = hmac.new(key, _KEY_LENGTH.pack(len(redis_key)), hashlib.sha256)
        mac.update(redis_key)
        mac.update(payload)
        return mac.digest()


#: Seconds between two attempts to read the database's identity while PostgreSQL
#: does not give it (down, or not migrated yet): the cache is off meanwhile, and
#: a request must not pay a failing round trip more often than this.
IDENTITY_RETRY = 5.0


class LazyKeyring:
    """The keyring, made on first use: the identity is read from PostgreSQL once
    per process (and inherited by forked workers), not at import or start-up,
    when the database may not answer yet."""

    def __init__(
        self,
        secrets: Sequence[bytes],
        identity: Callable[[], bytes],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._secrets = list(secrets)
        self._identity = identity
        #: Opened by a failed read: the next is tried ``IDENTITY_RETRY`` later.
        self._retry = CircuitBreaker(1, IDENTITY_RETRY, clock=clock)
        self._lock = threading.Lock()
        self._ring: Keyring | None = None

    def get(self) -> Keyring | None:
        """The keyring, or ``None`` while the identity cannot be read (a miss)."""
        with self._lock:
            if self._ring is not None or not self._retry.allow():
                return self._ring
            try:
                self._ring = Keyring(self._secrets, self._identity())
            except Exception as exc:
                self._retry.failure()
                log.warning(
                    "idempotency: the database's identity could not be read (%s); the "
                    "Redis cache is skipped for %.0f s",
                    type(exc).__name__,
                    IDENTITY_RETRY,
                )
            return self._ring
