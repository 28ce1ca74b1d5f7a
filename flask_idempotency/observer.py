"""The observer types: what the extension reports about its work.

Every request that reaches a decorated view ends in exactly one
:class:`RequestOutcome`. The extension counts it per process (``idempotency.metrics()``),
logs it (``flask_idempotency.requests``, see ``request_log.py``) and hands it, as a
:class:`RequestEvent`, to the observers attached to the app. It also times its
stages (the claim, a replay, the completion) for them, and reports what its
parts see: lease renewals and takeovers, the Redis cache and its breaker, the
connection pool.

An observer subclasses :class:`Observer`, overrides the hooks it cares about
and is attached with ``flask_idempotency.observability.attach``. Two ship with
the package, each behind an optional dependency and imported only by the
application that uses it:

- ``observability.prometheus.PrometheusMetrics`` (``prometheus-client``);
- ``observability.tracing.OpenTelemetryTracing`` (``opentelemetry-api``).

With no observer attached the request path pays for a dict increment and a
log-level check; nothing here imports either library.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib

#: A span attribute's value, as OpenTelemetry accepts it.
AttributeValue = str | bool | int | float
Attributes = dict[str, AttributeValue]


class RequestOutcome(str, enum.Enum):
    """How a request to a decorated view ended; exactly one per request.

    The values are the ``outcome`` label of ``flask_idempotency_requests_total``
    and the ``outcome`` field of the log event.
    """

    #: The view ran under a new claim and its answer was stored.
    EXECUTED = "executed"
    #: A stored answer was sent again; ``source`` says from where (cache or store).
    REPLAYED = "replayed"
    #: 409: a request with the key was still running.
    IN_PROGRESS = "in_progress"
    #: 422: the key was used with another request.
    KEY_REUSED = "key_reused"
    #: The view ran (or raised) and its answer was not stored: a 5xx, a
    #: not-acted-on 4xx, an exception. The claim was given up; a retry runs.
    RELEASED = "released"
    #: 409: the view ran past its lease, another request took the key over and
    #: this attempt's completion was refused (rolled back).
    LEASE_LOST = "lease_lost"
    #: 503: PostgreSQL failed or did not answer; the view did not run, or its
    #: attempt was rolled back.
    STORE_UNAVAILABLE = "store_unavailable"
    #: 500: the database has no idempotency schema (``flask idempotency migrate``
    #: was never run); the view did not run, or its attempt was rolled back.
    SCHEMA_MISSING = "schema_missing"
    #: 500: the schema is older than the installed release (a migration not applied).
    SCHEMA_OUTDATED = "schema_outdated"
    #: 500: an answer that would have been stored could not be (too large under
    #: ``oversize="reject"``); rolled back.
    NOT_STORABLE = "not_storable"
    #: 400: the key header is malformed.
    INVALID_KEY = "invalid_key"
    #: 400: a ``required`` route was called without a key.
    MISSING_KEY = "missing_key"
    #: 400: no principal to scope the key to.
    MISSING_SCOPE = "missing_scope"
    #: 400: the body could not be read (broken framing, a client gone mid-body).
    MALFORMED_BODY = "malformed_body"
    #: 413: the body exceeds ``MAX_CONTENT_LENGTH``.
    BODY_TOO_LARGE = "body_too_large"
    #: An ``optional`` route called without a key: the view ran in an ordinary
    #: transaction, nothing deduplicated.
    KEYLESS = "keyless"
    #: ``GET``, ``HEAD``, ``OPTIONS`` or ``TRACE``: let through, any key ignored.
    SAFE_METHOD = "safe_method"


class Stage(str, enum.Enum):
    """The timed stages of a request an observer is told about (``stage_started`` /
    ``stage_ended``). Not the recovery points a view runs with ``idempotency.phase()``:
    those are the application's own, and are stored with the record."""

    CLAIM = "claim"
    REPLAY = "replay"
    COMPLETE = "complete"


@dataclasses.dataclass(slots=True)
class RequestEvent:
    """One request's outcome, with what an on-call engineer needs to place it
    (read-only for observers; not frozen only because that costs on every request).

    Never the raw key or a body, and the scope only as its digest:
    ``key_digest`` and ``scope_digest`` are 12 hex digits of SHA-256 digests,
    enough to correlate log lines, spans and ``flask idempotency show``, nothing
    to replay a request with.
    """

    outcome: RequestOutcome
    #: The URL rule (``/v1/charges/<id>``), not the path: bounded, safe as a label.
    route: str
    method: str
    #: ``"cache"`` or ``"store"`` for a replay, else ``None``.
    source: str | None = None
    #: The answer's status when the extension knows it.
    status: int | None = None
    #: The request held a claim (it was in flight until now).
    claimed: bool = False
    #: Its claim took over a record whose holder's lease had expired.
    takeover: bool = False
    key_digest: str | None = None
    #: Seconds from the decorator to the outcome.
    duration: float | None = None
    #: Seconds spent in the claim statement(s) (every try of a waiting duplicate).
    claim_duration: float | None = None
    #: Seconds spent storing the answer (the completion and its commit).
    completion_duration: float | None = None
    #: Why, for failures (an exception's class and message; never a body).
    error: str | None = None
    _scope: str | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def scope_digest(self) -> str | None:
        """The scope's digest, computed when asked for (a log line, not a counter)."""
        return scope_digest(self._scope) if self._scope is not None else None


def scope_digest(scope: str) -> str:
    """A short label for a scope, like ``digests.log_key`` for a record: the scope may
    name a user or a tenant, which logs and traces do not need to carry."""
    return hashlib.sha256(scope.encode("utf-8", "surrogateescape")).digest()[:6].hex()


class Observer:
    """Hooks called by the extension; each does nothing unless overridden.

    Called on request threads (and the lease keeper's thread): keep them quick,
    thread-safe and free of exceptions. ``stage_started`` returns anything; it
    comes back to ``stage_ended`` of the same stage, so a tracer can carry its
    span across.
    """

    #: Whether ``stage_started`` needs the stage's attributes from the start (the
    #: route, the key digest: a span's); without, they are not computed.
    stage_attributes = False

    def request_finished(self, event: RequestEvent) -> None:
        """A request reached its outcome."""

    def claimed(self, takeover: bool) -> None:
        """A claim was won: the view is about to run (``request_finished`` follows)."""

    def stage_started(self, stage: Stage, attributes: Attributes) -> object:
        """A :class:`~flask_idempotency.observability.Stage` of a request begins."""
        return None

    def stage_ended(
        self,
        stage: Stage,
        started: object,
        seconds: float,
        attributes: Attributes,
        error: BaseException | None,
    ) -> None:
        """The stage ended after ``seconds``; ``attributes`` now hold its result."""

    def leases_renewed(self, renewed: int) -> None:
        """The lease keeper extended ``renewed`` leases in one round."""

    def lease_renewal_failed(self) -> None:
        """A renewal round failed (PostgreSQL unreachable or too slow)."""

    def cache_lookup(self, hit: bool) -> None:
        """The response cache was asked for a record (a failure is a miss)."""

    def cache_rejected(self, reason: str) -> None:
        """A cached entry was not replayed (``unverified``, ``version``, ``expired``,
        ``corrupt``): a miss, and PostgreSQL answered."""

    def redis_failed(self, command: str) -> None:
        """A Redis command failed (and was treated as a miss)."""

    def redis_skipped(self, command: str) -> None:
        """A Redis command was skipped because the circuit breaker is open."""

    def breaker_changed(self, state: str) -> None:
        """The Redis circuit breaker is now ``closed``, ``open`` or ``half-open``."""

    def store_breaker_changed(self, state: str) -> None:
        """The store's (PostgreSQL's) circuit breaker is now ``closed`` or ``open``."""

    def pool_checkout(self) -> None:
        """A request took a connection from the pool."""

    def pool_checkin(self) -> None:
        """A connection came back to the pool."""

    def pool_waiting(self, delta: int) -> None:
        """A request began (``+1``) or stopped (``-1``) waiting for a free connection."""

    def pool_timeout(self) -> None:
        """A request gave up waiting for a connection (and answers 503)."""

    def dead_lettered(self, consumer: str, reason: str) -> None:
        """A consumer gave a message up (``handler_failed``, ``key_reused``,
        ``missing_key``...): it went to the dead-letter queue, or was rejected into the
        queue's dead-letter exchange (a Celery task)."""
