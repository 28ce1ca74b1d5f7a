"""Configuration, read once from ``IDEMPOTENCY_*`` keys and validated at ``init_app``.

Every key is documented here, next to its default, and repeated in the README.
Bad values fail at start-up with a clear ``ValueError``, not on the first request.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
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
    #: request holds one. With ``db=`` (or ``engine=``) the engine's own pool serves
    #: instead: its ``pool_size + max_overflow``.
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
    #: statements (claim, completion, release, lease renewal) may take; your view's own
    #: statements keep your session's setting. The extension gives up on its statement
    #: 1 s after this if no answer came (a partition, a hung proxy: the socket is shut
    #: down); the claim and completion wait for locks for ``lock_timeout`` at most, and
    #: maintenance statements (purge, recover) also send ``SET LOCAL statement_timeout``.
    #: Either way the request answers 503.
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
        interval = self.lease_renew_interval
        return self.lease / 3.0 if interval is None else interval

    @functools.cached_property
    def key_environ_name(self) -> str:
        """Where WSGI puts the key header (``Idempotency-Key``:
        ``HTTP_IDEMPOTENCY_KEY``), as ``request.headers`` spells it on each read."""
        name = self.key_header.upper().replace("-", "_")
        return name if name in ("CONTENT_TYPE", "CONTENT_LENGTH") else f"HTTP_{name}"


#: The settings with a closed set of string values, and those values.
CHOICES = {
    "redis_fill": ("completion", "replay"),
    "profile": ("stripe", "ietf"),
    "oversize": ("omit_body", "reject"),
    "claim_mode": ("row", "transaction"),
}
#: What a boolean setting may be spelled as in a string (an environment variable).
_BOOLEAN_WORDS = {"1": True, "true": True, "yes": True, "on": True}
_BOOLEAN_WORDS.update({"0": False, "false": False, "no": False, "off": False})
#: The types of the settings that are functions.
_FUNCTION_TYPES = ("ShouldStore", "ScopeFunc", "FingerprintFunc")


def _coerce(name: str, kind: str, value: Any) -> Any:
    """``value`` as the field ``name``, of type ``kind``, holds it; else ``ValueError``.
    Every ``float`` setting is a number of seconds, so a ``timedelta`` is one too."""
    if kind in _FUNCTION_TYPES and not callable(value):
        raise ValueError(f"{config_key(name)} must be callable")
    if kind == "bool" and not isinstance(value, bool):
        word = _BOOLEAN_WORDS.get(value.lower()) if isinstance(value, str) else None
        if word is None:
            raise ValueError(f"{config_key(name)} must be a boolean, got {value!r}")
        return word
    if kind.startswith(("float", "int")):
        if isinstance(value, timedelta) and kind != "int":
            return value.total_seconds()
        if not isinstance(value, bool):
            with contextlib.suppress(TypeError, ValueError):
                return int(value) if kind == "int" else float(value)
        what = "an integer" if kind == "int" else "a number of seconds"
        raise ValueError(f"{config_key(name)} must be {what}, got {value!r}")
    if name in CHOICES:
        return str(value).strip().lower()
    if kind == "tuple[str, ...]":
        return (value,) if isinstance(value, str) else tuple(value)
    return value


def settings_from_config(config: Mapping[str, Any], *, engine_given: bool = False) -> Settings:
    """Build :class:`Settings` from a config namespace (``IDEMPOTENCY_`` prefix stripped);
    ``engine_given``: the app gave its SQLAlchemy database (``db=``), so no DSN.
    ``None`` is the default of any setting but a function."""
    kinds = {field.name: str(field.type) for field in dataclasses.fields(Settings)}
    values: dict[str, Any] = {}
    for name, value in ungroup(config).items():
        if name not in kinds:
            raise ValueError(f"Unknown configuration key IDEMPOTENCY_{name.upper()}")
        if value is not None or kinds[name] in _FUNCTION_TYPES:
            values[name] = _coerce(name, kinds[name], value)
    settings = Settings(**values)
    validate(settings, engine_given)
    return settings


#: The bounds of the numeric settings: the rule as said, and the settings it binds.
#: Those that "be" something refuse 0 (the "at least 1" ones are integers); the
#: others only what is below it. A NaN fails every rule.
#: (what a setting must be, as the error says it; its lowest value; whether that value
#: itself is allowed) -> the settings bound so (NaN fails every comparison: refused).
_BOUNDS: dict[tuple[str, float, bool], tuple[str, ...]] = {
    ("be positive", 0, False): ("ttl", "lease", "pool_timeout", "connect_timeout")
    + ("statement_timeout", "redis_timeout", "redis_breaker_cooldown", "store_breaker_cooldown"),
    ("be at least 1", 1, True): ("pool_size", "redis_breaker_threshold", "store_breaker_threshold"),
    ("not be negative", 0, True): ("retry_after", "wait", "max_stored_body"),
    ("not be negative (0 = no lock timeout)", 0, True): ("lock_timeout",),
}


def validate(settings: Settings, engine_given: bool) -> None:
    if engine_given and settings.database_url is not None:
        # memory:// too: it has no database for db= to join.
        raise ValueError(
            "With db= (or engine=) the extension uses that engine's database: "
            "remove IDEMPOTENCY_DATABASE_URL"
        )
    if not engine_given and settings.database_url is None:
        raise ValueError(
            "Set IDEMPOTENCY_DATABASE_URL, or pass db= (Flask-SQLAlchemy) or engine= "
            "(a SQLAlchemy Engine) to Idempotency"
        )
    if not settings.key_header or not settings.key_header.isascii():
        raise ValueError("IDEMPOTENCY_KEY_HEADER must be a non-empty ASCII header name")
    for (rule, lowest, allowed), names in _BOUNDS.items():
        for name in names:
            value = getattr(settings, name)
            if not (value >= lowest if allowed else value > lowest):
                raise ValueError(f"{config_key(name)} must {rule}")
    if settings.ttl < settings.lease:
        raise ValueError("IDEMPOTENCY_TTL must be at least IDEMPOTENCY_LEASE")
    interval = settings.renew_interval
    if interval < 0 or (interval > 0 and interval >= settings.lease):
        raise ValueError(
            "IDEMPOTENCY_LEASE_RENEW_INTERVAL must be 0 (off) or shorter than IDEMPOTENCY_LEASE"
        )
    for pattern in settings.not_replayed_headers:
        if not (isinstance(pattern, str) and _HEADER_PATTERN.fullmatch(pattern)):
            raise ValueError(
                "IDEMPOTENCY_NOT_REPLAYED_HEADERS must list header names, or prefixes "
                f"ending in '*', got {pattern!r}"
            )
    for name, choices in CHOICES.items():
        value = getattr(settings, name)
        if value not in choices:
            raise ValueError(
                f"{config_key(name)} must be one of {', '.join(choices)}, got {value!r}"
            )


#: A header name (RFC 9110's ``token``), or a prefix of one followed by ``*``.
_HEADER_PATTERN = re.compile(r"[!#$%&'+\-.^_`|~0-9A-Za-z]+\*?")
