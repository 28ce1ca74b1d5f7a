"""The Redis fast path: completed responses served without a trip to PostgreSQL.

Redis is only ever a copy. It holds completed responses (the extension puts
one after the completion has committed, or after replaying one from
PostgreSQL), never a processing claim, so losing or wiping it changes no
outcome. Every Redis failure is therefore a miss: logged (rate-limited),
counted by a circuit breaker, never raised.

Cost per call is one round trip: ``get`` is one ``GET``, ``put`` one
``SET ... PX``, ``evict`` one ``DEL`` of all the keys. Every command goes
through redis-py's public API (``get``, ``set``, ``delete``) and its own
connection pool, which is thread-safe and notices a fork by the process id at
checkout. A client built from a URL is configured with documented options
only: no retries and no health-check ``PING`` (either would multiply a slow
Redis's cost), a socket and connect timeout of tens of milliseconds, and a lean
connect handshake (RESP2, and no ``CLIENT SETINFO`` except over TLS, see
``_lean_handshake_kwargs``) where this redis-py has those options.

Redis is not trusted either (contract section 7): every entry is sealed with
an HMAC under a key derived from the application's secret and the database's
identity (``keyring.py``), and carries the record's expiry. An entry that does
not verify, is of another format version, or has outlived its record is a miss
(counted, and logged now and then), so PostgreSQL answers; a replay from Redis
never carries ``Set-Cookie`` or the per-request headers, whatever the entry holds.

Keys are ``{prefix}:{<database identity>}:{<hex of the record key>}``. The
record key is already a SHA-256 of the scope and the client's key, so no client
key reaches Redis, and two scopes never share an entry; the identity keeps two
deployments (two databases) that share one Redis apart, and 0.2.x's keys
(``{prefix}:{<hex>}``) apart from these. The braces are a Redis Cluster hash
tag: a future companion key of the same record lands on the same slot.
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import redis
import redis.backoff
import redis.cluster
import redis.exceptions
import redis.retry

from ..circuit import BreakerState, CircuitBreaker
from ..digests import log_key
from ..observer import Observer
from ..settings import Settings
from ..store.base import StoredResponse
from . import codec, topology
from .base import CachedRecord, ResponseCache
from .keyring import Keyring, LazyKeyring, Unauthentic

log = logging.getLogger("flask_idempotency.cache")

T = TypeVar("T")

#: At most one warning per this many seconds about Redis failures or bad
#: values; the rest go to debug with a count. An outage must not flood the logs
#: at request rate.
LOG_INTERVAL = 10.0

#: Errors after which the pool's idle sockets are presumed dead too (a Redis
#: restart breaks all of them at once): they are dropped, so the next calls
#: reconnect instead of each failing on another stale socket and opening the
#: breaker for nothing.
_SOCKET_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)


class RedisCache(ResponseCache):
    """The :class:`~flask_idempotency.cache.base.ResponseCache` over one Redis client.

    Thread-safe and fork-safe through redis-py's pool, which compares its PID on
    every checkout: a gunicorn worker never shares its master's socket, and no
    connection is opened until the first call.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        secrets: Sequence[bytes],
        identity: Callable[[], bytes],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """The cache ``IDEMPOTENCY_REDIS`` (a client used as it is: its timeouts are
        the application's) or ``IDEMPOTENCY_REDIS_URL`` (a client built for a
        cache, whose query string still wins over these defaults, say
        ``?socket_timeout=0.2``) names. ``secrets`` and ``identity``: what the
        entries are sealed with (``keyring.py``)."""
        self.client, self._owns_client = client_for_settings(settings)
        #: Derived from ``secrets`` and the database's ``identity`` on first use.
        self.keyring = LazyKeyring(secrets, identity, clock=clock)
        self.prefix = settings.redis_prefix
        self.max_body = settings.max_stored_body
        self.breaker = CircuitBreaker(
            settings.redis_breaker_threshold, settings.redis_breaker_cooldown, clock=clock
        )
        self._log = _RateLimitedLog(clock)
        #: Told of lookups, failures and the breaker (``attach_observer``).
        self._observer = Observer()

    def prepare(self) -> None:
        self.keyring.get()  # (a failure is logged, and tried again later)

    def _key(self, ring: Keyring, record_key: bytes) -> str:
        """The Redis key of a record's entry (see the module's docstring)."""
        return f"{self.prefix}:{ring.namespace}:{{{record_key.hex()}}}"

    def attach_observer(self, observer: Observer) -> None:
        """Report lookups, failures and the breaker's state to ``observer``
        (``observability.attach``), starting with the state it is in now."""
        self._observer = observer
        observer.breaker_changed(self.breaker.state.value)

    # -- the ResponseCache interface ------------------------------------------

    def get(self, record_key: bytes) -> CachedRecord | None:
        record = self._get(record_key)
        self._observer.cache_lookup(record is not None)
        return record

    def _get(self, record_key: bytes) -> CachedRecord | None:
        ring = self.keyring.get()
        if ring is None:
            return None
        key = self._key(ring, record_key)
        value = self._call("GET", record_key, lambda: self.client.get(key))
        if value is None:
            return None
        # Redis answered, so the breaker is not concerned with what follows. A
        # rejected entry stays: the PostgreSQL replay after this miss overwrites it.
        if not value.startswith(codec.VERSION_BYTE):
            return self._rejected(record_key, "version", "written by another version")
        try:
            entry = codec.decode(ring.open(key.encode(), value), max_body=self.max_body)
        except Unauthentic as exc:
            return self._rejected(record_key, "unverified", str(exc))
        except codec.CorruptEntry as exc:  # sealed by us, yet unreadable: a bug, not an attack
            return self._rejected(record_key, "corrupt", f"{type(exc).__name__}: {exc}")
        if entry.expires_at <= time.time() * 1000:
            return self._rejected(record_key, "expired", "older than its record")
        # Its headers go out through responses.replay(), which drops Set-Cookie and
        # the per-request headers whatever an entry holds.
        return entry.record

    def _rejected(self, record_key: bytes, reason: str, detail: str) -> CachedRecord | None:
        """An entry that must not be replayed: a miss (``None``), counted and logged
        now and then."""
        self._log.warning(
            "idempotency: cache entry for key %s rejected (%s: %s); treated as a miss",
            log_key(record_key),
            reason,
            detail,
        )
        self._observer.cache_rejected(reason)
        return None

    def put(
        self, record_key: bytes, fingerprint: bytes, response: StoredResponse, ttl: float
    ) -> None:
        # Whole milliseconds, rounded down: the copy must never outlive the record.
        px = int(ttl * 1000)
        if px <= 0:
            return
        ring = self.keyring.get()
        if ring is None:
            return
        # Entries expire at a wall-clock time, shared by every worker and host.
        expires_at = int(time.time() * 1000) + px
        try:
            payload = codec.encode(fingerprint, response, expires_at=expires_at)
        except codec.CodecError as exc:
            self._log.warning(
                "idempotency: response for key %s not cached: %s", log_key(record_key), exc
            )
            return
        key = self._key(ring, record_key)
        value = ring.seal(key.encode(), payload)
        self._call("SET", record_key, lambda: self.client.set(key, value, px=px))

    def evict(self, record_keys: Sequence[bytes]) -> None:
        """One ``DEL`` of every key on a single server. On a Redis Cluster the
        keys of different records hash to different slots, where a multi-key
        ``DEL`` is refused (CROSSSLOT): redis-py's ``RedisCluster.delete`` sends
        one ``DEL`` per slot instead. Eviction is hygiene, not correctness: an
        entry never outlives its record's TTL anyway."""
        ring = self.keyring.get()
        if not record_keys or ring is None:
            return
        keys = [self._key(ring, k) for k in record_keys]
        self._call("DEL", record_keys[0], lambda: self.client.delete(*keys))

    def ping(self) -> None:
        """One ``PING`` through the client, raising what redis-py raises (the breaker
        and the fail-open rules of the request path do not apply)."""
        self.client.ping()

    def close(self) -> None:
        """Close the client if we built it; an application's own client stays its own."""
        if self._owns_client:
            try:
                self.client.close()
            except Exception as exc:  # closing a dead connection must not fail shutdown
                log.debug("idempotency: closing the redis client failed: %s", exc)

    # -- the failure policy ---------------------------------------------------

    def _call(self, command: str, record_key: bytes, fn: Callable[[], T]) -> T | None:
        """Run one Redis command through the breaker; any failure is ``None``.

        Catches every ``Exception``, not just ``RedisError``: redis-py raises
        others too (``ChildDeadlockedError``, an ``OSError`` from a TLS
        handshake), and a cache must never turn an outage into a 500.
        """
        if not self.breaker.allow():
            self._observer.redis_skipped(command)
            return None
        try:
            result = fn()
        except Exception as exc:
            self._observer.redis_failed(command)
            if isinstance(exc, _SOCKET_ERRORS):
                self._drop_idle_connections()
            self._log.warning(
                "idempotency: redis %s for key %s failed (%s: %s); treated as a miss",
                command,
                log_key(record_key),
                type(exc).__name__,
                _short(exc),
            )
            if self.breaker.failure():
                log.warning(
                    "idempotency: redis circuit breaker open; skipping redis for %.1f s",
                    self.breaker.cooldown,
                )
                self._observer.breaker_changed(BreakerState.OPEN.value)
            return None
        if self.breaker.success():
            log.info("idempotency: redis answers again; circuit breaker closed")
            self._observer.breaker_changed(BreakerState.CLOSED.value)
        return result

    def _drop_idle_connections(self) -> None:
        try:
            if isinstance(self.client, redis.cluster.RedisCluster):
                return  # it reloads its slot map and reconnects by itself
            self.client.connection_pool.disconnect(inuse_connections=False)
        except Exception as exc:
            log.debug("idempotency: dropping idle redis connections failed: %s", exc)


def client_for_settings(settings: Settings) -> tuple[Any, bool]:
    """The client ``IDEMPOTENCY_REDIS`` or ``IDEMPOTENCY_REDIS_URL`` names, and
    whether it is ours to close; ``ValueError`` (at ``init_app``) for a malformed
    URL or a client that decodes responses. Connects to nothing.

    A client built from a URL is one for a cache, where a slow answer must cost
    less than asking PostgreSQL (a ``redis+sentinel``/``redis+cluster`` URL gets
    the same from ``topology.py``):

    - ``socket_timeout`` and ``socket_connect_timeout`` = ``IDEMPOTENCY_REDIS_OPTIONS["timeout"]``;
    - no retries (redis-py 6+ retries three times by default, with backoff);
    - no health-check ``PING`` before commands on idle connections;
    - where supported: RESP2 (redis-py 8 defaults to RESP3, whose ``HELLO``,
      and the maintenance-notification handshake that comes with it, add
      round trips to every new connection) and no ``CLIENT SETINFO``.
    """
    if settings.redis is not None:
        connection_kwargs: dict[str, Any] = getattr(settings.redis, "get_connection_kwargs", dict)()
        if connection_kwargs.get("decode_responses"):
            raise ValueError(
                "IDEMPOTENCY_REDIS must not decode responses: cached entries are binary"
            )
        return settings.redis, False
    url, timeout = settings.redis_url, settings.redis_timeout
    assert url is not None  # (no cache is built without one or the other)
    handshake = _lean_handshake_kwargs(tls=url.startswith("rediss"))
    if topology.is_topology_url(url):
        return topology.client_for(url, timeout, handshake), True
    client = redis.Redis.from_url(
        url,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        retry=redis.retry.Retry(redis.backoff.NoBackoff(), 0),
        health_check_interval=0,
        **handshake,
    )
    return client, True


def _lean_handshake_kwargs(*, tls: bool) -> dict[str, Any]:
    """Documented ``redis.Redis`` options that trim the connect handshake, if this
    redis-py has them.

    Over TLS, ``CLIENT SETINFO`` stays: a TLS 1.3 server sends its session
    tickets just after the handshake, and a connection that has read no reply
    yet still holds them when redis-py's pool checks a new connection for
    unread data (``can_read()``), which then fails it ("Connection not
    ready"): a quarter of new connections on a loaded machine. Reading the
    ``SETINFO`` reply consumes the tickets, for one round trip per connect.

    The package supports ``redis>=4.5``, where these parameters do not exist
    yet; they are detected on ``redis.Redis``'s signature rather than assumed,
    and passing them explicitly also avoids the deprecation warnings of their
    older spellings.
    """
    params = frozenset(inspect.signature(redis.Redis.__init__).parameters)
    options: dict[str, Any] = {}
    if "protocol" in params:
        options["protocol"] = 2
    if tls:
        return options
    if "driver_info" in params:
        options["driver_info"] = None  # documented: None disables CLIENT SETINFO
    elif "lib_name" in params:
        options["lib_name"] = None
        options["lib_version"] = None
    return options


def _short(exc: Exception, limit: int = 200) -> str:
    """An error message for a log line: redis-py's never carry keys or values,
    but they can be long (a whole server reply); keep one line of it."""
    text = str(exc).splitlines()[0] if str(exc) else ""
    return text if len(text) <= limit else text[:limit] + "..."


class _RateLimitedLog:
    """Warnings at most once per ``LOG_INTERVAL``; the rest at debug, and counted
    into the next warning, so an outage at request rate is a line every few
    seconds that still says how much was hidden."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._last: float | None = None
        self._suppressed = 0

    def warning(self, msg: str, *args: object) -> None:
        with self._lock:
            now = self._clock()
            quiet = self._last is not None and now - self._last < LOG_INTERVAL
            if quiet:
                self._suppressed += 1
            else:
                self._last, suppressed, self._suppressed = now, self._suppressed, 0
        if quiet:
            log.debug(msg, *args)
        elif suppressed:
            log.warning(msg + " (%d similar messages suppressed)", *args, suppressed)
        else:
            log.warning(msg, *args)
