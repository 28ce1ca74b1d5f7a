"""Configuration, read once from ``IDEMPOTENCY_*`` keys and validated at ``init_app``.

Every key is documented here, next to its default, and repeated in the README.
Bad values fail at start-up with a clear ``ValueError``, not on the first request.
"""

from __future__ import annotations

import dataclasses
import functools
import string
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, ClassVar

from flask import Request

from .config_keys import config_key, ungroup
from .fingerprint import request_fingerprint
from .scopes import default_scope

#: Statuses below 500 that mean "the request was not acted on": they are not
#: stored, so a corrected retry under the same key runs (as at Stripe).
NOT_STORED_STATUSES: frozenset[int] = frozenset({400, 401, 403, 404, 408, 409, 422, 425, 429})


def default_should_store(status: int) -> bool:
    """Store every final answer below 500 except those that mean "not acted on"."""
    return status < 500 and status not in NOT_STORED_STATUSES


#: ``None`` from a scope function: the request names no principal (refused, 400).
ScopeFunc = Callable[[Request], str | None]
FingerprintFunc = Callable[[Request], bytes]
ShouldStore = Callable[[int], bool]


@dataclasses.dataclass(frozen=True)
class Settings:
    #: ``IDEMPOTENCY_DATABASE_URL``: libpq DSN or URL (or pass ``db=`` / ``engine=`` to
    #: ``Idempotency``, and the records live in that engine's database). ``"memory://"``
    #: keeps the records in this process's memory instead: for unit tests and local
    #: development, never production (one process only; see the testing page).
    database_url: str | None = None
    #: ``IDEMPOTENCY_DATABASE_OPTIONS["pool_size"]``: connections per process; each in-flight
    #: request holds one.
    pool_size: int = 10
    #: ``IDEMPOTENCY_DATABASE_OPTIONS["pool_timeout"]``: seconds to wait for a free connection
    #: before a 503.
    pool_timeout: float = 5.0
    #: ``IDEMPOTENCY_DATABASE_OPTIONS["connect_timeout"]``: libpq connect timeout, seconds. Short,
    #: so an unreachable database turns into a prompt 503 rather than a hung worker.
    connect_timeout: int = 3
    #: ``IDEMPOTENCY_DATABASE_OPTIONS``: a mapping of the database options listed here
    #: (``pool_size``, ``statement_timeout``...); any other key in it is a libpq
    #: connection parameter (``sslmode``, ``application_name``...).
    connect_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    #: ``IDEMPOTENCY_KEY_HEADER``: the request header carrying the client's key.
    key_header: str = "Idempotency-Key"
    #: ``IDEMPOTENCY_TTL``: seconds a record is kept and replayed (24 h, like Stripe).
    ttl: float = 86400.0
    #: ``IDEMPOTENCY_LEASE``: seconds a processing claim is held without renewal. Long
    #: enough to cover a slow downstream call; a dead worker's key is free after it.
    lease: float = 30.0
    #: ``IDEMPOTENCY_LEASE_RENEW_INTERVAL``: seconds between renewals of in-flight
    #: leases by the per-process keeper thread; ``None`` means lease / 3, ``0`` turns
    #: renewal off (a request then must finish within one lease).
    lease_renew_interval: float | None = None
    #: ``IDEMPOTENCY_RETRY_AFTER``: whole seconds advertised on 409 and 503 answers.
    retry_after: int = 1
    #: ``IDEMPOTENCY_WAIT``: seconds a duplicate waits for the first request to finish
    #: and replays it, instead of an immediate 409 (0 = answer 409 at once).
    wait: float = 0.0
    #: Seconds between a waiting duplicate's checks. Not a key: what an application
    #: chooses is how long a duplicate waits (``WAIT``); 50 ms answers it within a
    #: tick of the first request finishing, at ~20 small queries a second.
    wait_poll_interval: ClassVar[float] = 0.05
    #: ``IDEMPOTENCY_SHOULD_STORE``: ``f(status) -> bool``, which answers are stored.
    should_store: ShouldStore = default_should_store
    #: ``IDEMPOTENCY_SCOPE_FUNC``: ``f(request) -> str | None``, the principal (user,
    #: API key, tenant) a key belongs to; ``None`` refuses the request (``400
    #: missing_scope``). Default: flask-login's user, else the hashed
    #: ``Authorization`` header (``flask_idempotency.scopes``).
    scope_func: ScopeFunc = default_scope
    #: ``IDEMPOTENCY_FINGERPRINT_FUNC``: ``f(request) -> bytes``, what "same request" means.
    fingerprint_func: FingerprintFunc = request_fingerprint
    #: ``IDEMPOTENCY_MAX_STORED_BODY``: largest response body stored, bytes.
    max_stored_body: int = 1024 * 1024
    #: ``IDEMPOTENCY_DATABASE_OPTIONS["async_claim_commit"]``: commit the claim with
    #: ``synchronous_commit = off``, saving one WAL flush per first request (the
    #: benchmarks measure it). Safe: the claim is visible to other
    #: sessions at once, and the business transaction's durable commit flushes it;
    #: a claim lost in a database crash only re-opens a key whose holder's
    #: connection died with the crash, and whose completion therefore fails.
    async_claim_commit: bool = True
    #: ``IDEMPOTENCY_MIGRATION_DIRS``: extra directories of ``NNNN_name.sql`` files
    #: applied by ``flask idempotency migrate`` after the extension's own schema.
    migration_dirs: tuple[str, ...] = ()
    #: ``IDEMPOTENCY_AUTO_MIGRATE``: apply migrations during ``init_app``.
    auto_migrate: bool = False
    #: ``IDEMPOTENCY_REDIS_URL``: Redis URL for the replay cache; off when unset, and off
    #: without the app's ``SECRET_KEY`` (entries are signed with a key derived from it).
    redis_url: str | None = None
    #: ``IDEMPOTENCY_REDIS``: an existing ``redis.Redis`` client instead of a URL.
    redis: Any = None
    #: ``IDEMPOTENCY_REDIS_OPTIONS["prefix"]``: namespace of cache keys.
    redis_prefix: str = "idempotency"
    #: ``IDEMPOTENCY_REDIS_OPTIONS["timeout"]``: socket and connect timeout, seconds. Tens of
    #: milliseconds: a slow cache must cost less than going to PostgreSQL.
    redis_timeout: float = 0.05
    #: ``IDEMPOTENCY_REDIS_OPTIONS["breaker_threshold"]``: consecutive failures that open the
    #: breaker.
    redis_breaker_threshold: int = 3
    #: ``IDEMPOTENCY_REDIS_OPTIONS["breaker_cooldown"]``: seconds Redis is skipped once open.
    redis_breaker_cooldown: float = 5.0
    #: Bodies above this many bytes are zlib-compressed in Redis. Not a key: a detail
    #: of the cache's encoding (deflating a few kB costs less than sending them),
    #: not a deployment decision.
    redis_compress_over: ClassVar[int] = 4096
    #: ``IDEMPOTENCY_REDIS_OPTIONS["fill"]``: when a completed response is copied to Redis.
    #: ``"replay"`` (the default): the first time it is replayed from PostgreSQL;
    #: first requests skip the SET, and Redis holds only keys that were retried
    #: (most keys never are). ``"completion"``: every one, as it commits; a retry
    #: is then answered from Redis even while PostgreSQL is down, at the price of
    #: a SET per first request and every response in Redis for its TTL.
    redis_fill: str = "replay"
    #: ``IDEMPOTENCY_PROFILE``: the API conventions spoken (``flask_idempotency.profiles``):
    #: ``"stripe"`` (JSON errors, ``Idempotent-Replayed: true|false``) or ``"ietf"``
    #: (RFC 9457 problem details, ``Idempotency-Replayed: true`` on replays only).
    profile: str = "stripe"
    #: ``IDEMPOTENCY_OVERSIZE``: an answer whose body is over ``MAX_STORED_BODY``.
    #: ``"omit_body"``: kept and stored without its body; the client gets it whole,
    #: retries get its status and headers with ``Idempotency-Body-Omitted: true``. A
    #: charge the processor made is recorded, never rolled back. ``"reject"``: rolled
    #: back and answered ``500 response_too_large``; every retry runs the view again.
    oversize: str = "omit_body"
    #: ``IDEMPOTENCY_EXPOSE_HEADERS``: name the extension's response headers in
    #: ``Access-Control-Expose-Headers`` so browsers' scripts can read them (CORS).
    expose_headers: bool = False
    #: ``IDEMPOTENCY_NOT_REPLAYED_HEADERS``: response headers that belong to the request
    #: rather than the answer, neither stored nor replayed, so the app's own layers add
    #: this request's on a replay: names, or prefixes ending in ``*``, any case. Default:
    #: CORS's (``Access-Control-*``), which depend on the request's ``Origin``. Beside
    #: these, ``Set-Cookie`` and hop-by-hop headers are never stored nor replayed.
    not_replayed_headers: tuple[str, ...] = ("Access-Control-*",)
    #: ``IDEMPOTENCY_TESTING_DRILLS``: honour the ``Idempotency-Drill`` request header
    #: of ``flask_idempotency.testing.assert_idempotent(atomicity_drill=True)``, which
    #: fails an attempt after its view returned. For test configurations only.
    testing_drills: bool = False
    #: ``IDEMPOTENCY_CLAIM_MODE``: how a key is claimed (the docs' "how it works" page).
    #: ``"row"``: a processing row committed on its own, kept alive by a lease;
    #: visible to ``stats``/``unlock``, no transaction open while the view waits on
    #: others. ``"transaction"``: the view's transaction opens with the claim under
    #: advisory locks and its COMMIT inserts the completed record: one commit per
    #: request, no lease, but the transaction stays open for the whole view.
    #: Every process of a deployment must use the same mode.
    claim_mode: str = "row"
    #: ``IDEMPOTENCY_DATABASE_OPTIONS["statement_timeout"]``: seconds each of the extension's own
    #: statements (claim, completion, release, lease renewal) may take, set with
    #: ``SET LOCAL statement_timeout`` in the same round trip, so your view's own
    #: statements keep your session's setting. The extension also gives up on its
    #: statement 1 s after this if no answer came at all (a partition, a hung proxy:
    #: the socket is shut down). Either way the request answers 503.
    statement_timeout: float = 5.0
    #: ``IDEMPOTENCY_DATABASE_OPTIONS["lock_timeout"]``: seconds the extension's own statements wait
    #: for a row lock (``SET LOCAL lock_timeout``) before a 503; ``0`` waits up to the statement
    #: timeout.
    lock_timeout: float = 2.0
    #: ``IDEMPOTENCY_DATABASE_OPTIONS["breaker_threshold"]``: failures in a row that mean
    #: PostgreSQL is not answering (a statement with no answer by its deadline, a lost
    #: connection, a failed connect) before the store's circuit breaker opens. While it
    #: is open, requests answer ``503 store_unavailable`` at once, those waiting for a
    #: pool connection too, instead of each waiting out the deadline behind a frozen
    #: server. An error the server answered (a constraint, a lock timeout) never counts.
    store_breaker_threshold: int = 3
    #: ``IDEMPOTENCY_DATABASE_OPTIONS["breaker_cooldown"]``: seconds the open breaker
    #: answers 503 before it lets one request through as a probe; the probe's answer
    #: closes it, its failure opens it for another cooldown.
    store_breaker_cooldown: float = 1.0
    #: ``IDEMPOTENCY_BROKER_URL``: where ``flask idempotency relay`` publishes the
    #: outbox's events (a kombu URL: ``amqp://user:pass@host:5672/vhost``); the
    #: relay's ``--broker-url`` overrides it. Unset: the relay refuses to start.
    broker_url: str | None = None
    #: ``IDEMPOTENCY_BROKER_OPTIONS["exchange"]``: the durable topic exchange events are
    #: published to, with the event type as routing key.
    events_exchange: str = "idempotency.events"

    @property
    def renew_interval(self) -> float:
        if self.lease_renew_interval is None:
            return self.lease / 3.0
        return self.lease_renew_interval

    @functools.cached_property
    def key_environ_name(self) -> str:
        """Where WSGI puts the key header (``Idempotency-Key``:
        ``HTTP_IDEMPOTENCY_KEY``), as ``request.headers`` spells it on each read."""
        name = self.key_header.upper().replace("-", "_")
        return name if name in ("CONTENT_TYPE", "CONTENT_LENGTH") else f"HTTP_{name}"


_SECONDS_FIELDS = {
    "statement_timeout",
    "lock_timeout",
    "ttl",
    "lease",
    "lease_renew_interval",
    "wait",
    "pool_timeout",
    "redis_timeout",
    "redis_breaker_cooldown",
    "store_breaker_cooldown",
}
_INT_FIELDS = {
    "pool_size",
    "connect_timeout",
    "retry_after",
    "max_stored_body",
    "redis_breaker_threshold",
    "store_breaker_threshold",
}
_BOOL_FIELDS = {
    "async_claim_commit",
    "auto_migrate",
    "expose_headers",
    "testing_drills",
}
_CALLABLE_FIELDS = {"should_store", "scope_func", "fingerprint_func"}
#: ``IDEMPOTENCY_REDIS_OPTIONS["fill"]`` values (see :attr:`Settings.redis_fill`).
REDIS_FILLS = ("completion", "replay")
#: ``IDEMPOTENCY_PROFILE`` values (see :attr:`Settings.profile`).
PROFILE_NAMES = ("stripe", "ietf")
#: ``IDEMPOTENCY_OVERSIZE`` values (see :attr:`Settings.oversize`).
OVERSIZE_CHOICES = ("omit_body", "reject")
#: Settings with a closed set of string values.
#: ``IDEMPOTENCY_CLAIM_MODE`` values (see :attr:`Settings.claim_mode`).
CLAIM_MODES = ("row", "transaction")
_CHOICE_FIELDS = {
    "redis_fill": REDIS_FILLS,
    "profile": PROFILE_NAMES,
    "oversize": OVERSIZE_CHOICES,
    "claim_mode": CLAIM_MODES,
}


def _coerce_seconds(name: str, value: Any) -> float:
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, bool):
        raise ValueError(f"{config_key(name)} must be a number of seconds")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{config_key(name)} must be a number of seconds, got {value!r}") from None


def _coerce_int(name: str, value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{config_key(name)} must be an integer")
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{config_key(name)} must be an integer, got {value!r}") from None


def _coerce_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in {
        "1",
        "true",
        "yes",
        "on",
        "0",
        "false",
        "no",
        "off",
    }:
        return value.lower() in {"1", "true", "yes", "on"}
    raise ValueError(f"{config_key(name)} must be a boolean, got {value!r}")


def settings_from_config(config: Mapping[str, Any], *, engine_given: bool = False) -> Settings:
    """Build :class:`Settings` from a config namespace (``IDEMPOTENCY_`` prefix stripped);
    ``engine_given``: the app gave its SQLAlchemy database (``db=``), so no DSN."""
    fields = {f.name for f in dataclasses.fields(Settings)}
    values: dict[str, Any] = {}
    for name, value in ungroup(config).items():
        raw_name = name
        if name not in fields:
            raise ValueError(f"Unknown configuration key IDEMPOTENCY_{raw_name.upper()}")
        if value is None and name not in _CALLABLE_FIELDS:
            values[name] = None
            continue
        if name in _SECONDS_FIELDS:
            values[name] = _coerce_seconds(name, value)
        elif name in _INT_FIELDS:
            values[name] = _coerce_int(name, value)
        elif name in _BOOL_FIELDS:
            values[name] = _coerce_bool(name, value)
        elif name in _CALLABLE_FIELDS:
            if not callable(value):
                raise ValueError(f"IDEMPOTENCY_{raw_name.upper()} must be callable")
            values[name] = value
        elif name in _CHOICE_FIELDS:
            values[name] = str(value).strip().lower()
        elif name == "migration_dirs":
            values[name] = (value,) if isinstance(value, str) else tuple(str(v) for v in value)
        elif name == "not_replayed_headers":
            values[name] = (value,) if isinstance(value, str) else tuple(value)
        else:
            values[name] = value
    for name in (
        "pool_size",
        "connect_timeout",
        "retry_after",
        "max_stored_body",
        "statement_timeout",
        "lock_timeout",
    ):
        if name in values and values[name] is None:
            del values[name]
    settings = Settings(**values)
    if engine_given:
        if settings.database_url is not None:
            raise ValueError(
                "With db= (or engine=) the extension uses that engine's database: "
                "remove IDEMPOTENCY_DATABASE_URL"
            )
        validate(dataclasses.replace(settings, database_url="(db's engine)"))
    else:
        validate(settings)
    return settings


def validate(settings: Settings) -> None:
    if settings.database_url is None:
        raise ValueError(
            "Set IDEMPOTENCY_DATABASE_URL, or pass db= (Flask-SQLAlchemy) or engine= "
            "(a SQLAlchemy Engine) to Idempotency"
        )
    if not settings.key_header or not settings.key_header.isascii():
        raise ValueError("IDEMPOTENCY_KEY_HEADER must be a non-empty ASCII header name")
    if settings.ttl <= 0:
        raise ValueError("IDEMPOTENCY_TTL must be positive")
    if settings.lease <= 0:
        raise ValueError("IDEMPOTENCY_LEASE must be positive")
    if settings.ttl < settings.lease:
        raise ValueError("IDEMPOTENCY_TTL must be at least IDEMPOTENCY_LEASE")
    interval = settings.renew_interval
    if interval < 0 or (interval > 0 and interval >= settings.lease):
        raise ValueError(
            "IDEMPOTENCY_LEASE_RENEW_INTERVAL must be 0 (off) or shorter than IDEMPOTENCY_LEASE"
        )
    if settings.pool_size < 1:
        raise ValueError(f"{config_key('pool_size')} must be at least 1")
    if settings.pool_timeout <= 0 or settings.connect_timeout <= 0:
        raise ValueError(
            f"{config_key('pool_timeout')} and {config_key('connect_timeout')} must be positive"
        )
    if settings.retry_after < 0:
        raise ValueError("IDEMPOTENCY_RETRY_AFTER must not be negative")
    if settings.wait < 0:
        raise ValueError("IDEMPOTENCY_WAIT must be >= 0")
    if settings.max_stored_body < 0:
        raise ValueError("IDEMPOTENCY_MAX_STORED_BODY must not be negative")
    for pattern in settings.not_replayed_headers:
        if not _is_header_pattern(pattern):
            raise ValueError(
                "IDEMPOTENCY_NOT_REPLAYED_HEADERS must list header names, or prefixes "
                f"ending in '*', got {pattern!r}"
            )
    for name, choices in _CHOICE_FIELDS.items():
        value = getattr(settings, name)
        if value not in choices:
            raise ValueError(
                f"{config_key(name)} must be one of {', '.join(choices)}, got {value!r}"
            )
    if settings.redis_timeout <= 0 or settings.redis_breaker_threshold < 1:
        raise ValueError(
            f"{config_key('redis_timeout')} must be positive and "
            f"{config_key('redis_breaker_threshold')} at least 1"
        )
    if settings.store_breaker_threshold < 1 or not settings.store_breaker_cooldown > 0:
        raise ValueError(
            f"{config_key('store_breaker_threshold')} must be at least 1 and "
            f"{config_key('store_breaker_cooldown')} positive"
        )
    if not settings.statement_timeout > 0:
        raise ValueError(f"{config_key('statement_timeout')} must be positive")
    if not settings.lock_timeout >= 0:
        raise ValueError(f"{config_key('lock_timeout')} must not be negative (0 = no lock timeout)")


#: What a header name may hold (RFC 9110's ``token``).
_TOKEN_CHARS = frozenset("!#$%&'*+-.^_`|~" + string.ascii_letters + string.digits)


def _is_header_pattern(pattern: object) -> bool:
    """A header name, or a prefix of one followed by ``*``."""
    if not isinstance(pattern, str):
        return False
    name = pattern[:-1] if pattern.endswith("*") else pattern
    return bool(name) and "*" not in name and _TOKEN_CHARS.issuperset(name)
