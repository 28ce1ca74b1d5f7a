"""The extension's own error answers, as small ``HTTPException`` subclasses.

Each renders the contract's JSON body, so an application's own error handlers
for ``HTTPException`` (or for one of these classes) still take precedence.
"""

from __future__ import annotations

import json
from typing import Any

from werkzeug.exceptions import HTTPException

from .profiles import PROBLEM_TYPE_BASE, SHOULD_RETRY_HEADER
from .state import current_profile, current_retry_after
from .store.base import SchemaMismatchError, StoreUnavailableError


class IdempotencyError(HTTPException):
    """Base class: a JSON error with ``type: idempotency_error`` and a stable ``error_code``."""

    #: A 400 unless a subclass says otherwise: the request itself is refused.
    code = 400
    error_type = "idempotency_error"
    error_code = "idempotency_error"
    description = "Idempotency error."
    #: A short, fixed summary of the problem type (RFC 9457 ``title``).
    title = "Idempotency error"
    #: Whole seconds for ``Retry-After``; ``None`` leaves the header out.
    retry_after: int | None = None
    #: Whether sending the same request again gets the same answer: in the
    #: ``stripe`` profile such an error says ``Stripe-Should-Retry: false``, since
    #: Stripe's SDKs retry every ``409`` and ``5xx`` unless told not to. One that
    #: is not final carries ``Retry-After``: by default the current app's
    #: ``IDEMPOTENCY_RETRY_AFTER`` (1 outside an app).
    final = True

    def __init__(self, description: str | None = None, *, retry_after: int | None = None) -> None:
        super().__init__(description)
        if retry_after is None and not self.final:
            retry_after = current_retry_after()
        if retry_after is not None:
            self.retry_after = max(0, int(retry_after))

    def get_body(self, environ: Any = None, scope: Any = None) -> str:
        """The contract's JSON error, or RFC 9457 problem details (``ietf`` profile)."""
        if current_profile().stripe:
            error = {"type": self.error_type, "code": self.error_code, "message": self.description}
            return json.dumps({"error": error})
        problem: dict[str, Any] = {"type": PROBLEM_TYPE_BASE + self.error_code, "title": self.title}
        problem.update(status=self.code, detail=self.description, code=self.error_code)
        return json.dumps(problem)

    def get_headers(self, environ: Any = None, scope: Any = None) -> list[tuple[str, str]]:
        stripe = current_profile().stripe
        headers = [("Content-Type", "application/json" if stripe else "application/problem+json")]
        if self.retry_after is not None:
            headers.append(("Retry-After", str(self.retry_after)))
        if stripe and self.final:
            headers.append((SHOULD_RETRY_HEADER, "false"))
        return headers


class MissingKey(IdempotencyError):
    title = "Idempotency-Key missing"
    error_code = "missing_key"
    description = "This endpoint requires an Idempotency-Key header."


class InvalidKey(IdempotencyError):
    title = "Invalid Idempotency-Key"
    error_code = "invalid_key"
    description = (
        "The Idempotency-Key must be one value of 1 to 255 visible ASCII characters "
        "(0x21-0x7E); a comma outside quotes separates two values."
    )


class ScopeUnavailable(IdempotencyError):
    """The request names no principal (no user, no credentials) that its key could
    belong to. Refused before anything is claimed, never pooled with other
    principals' records.

    A 400, not a 401: the app's own authentication, which runs first, decides
    who must authenticate and with which challenge (a 401 must carry a
    ``WWW-Authenticate`` scheme the extension cannot know); and not a 5xx,
    which clients retry as they are: resending this request unchanged cannot
    succeed. Send credentials, or configure ``IDEMPOTENCY_SCOPE_FUNC``.
    """

    title = "No principal to scope the key to"
    error_code = "missing_scope"
    description = (
        "This request carries no principal (user or credentials) to scope its "
        "Idempotency-Key to, so it was not processed. Send your credentials; the "
        "application may configure IDEMPOTENCY_SCOPE_FUNC to name its principals "
        "(e.g. the logged-in user), or choose flask_idempotency.global_scope if it "
        "has a single one."
    )


class MalformedBody(IdempotencyError):
    """The request body could not be read (broken chunked framing, a client gone
    mid-body): a 400 before anything is claimed, never a 500."""

    title = "Unreadable request body"
    error_type = "invalid_request_error"
    error_code = "malformed_body"
    description = "The request body could not be read."


class KeyReused(IdempotencyError):
    code = 422
    title = "Idempotency-Key reused with another request"
    error_code = "key_reused"
    description = (
        "This Idempotency-Key was already used with a different request (method, path or body)."
    )


class RequestInProgress(IdempotencyError):
    code = 409
    title = "Request with this Idempotency-Key in progress"
    error_code = "in_progress"
    description = "A request with this Idempotency-Key is still being processed; retry later."
    final = False


class LeaseLost(IdempotencyError):
    code = 409
    title = "Request taken over after its lease expired"
    error_code = "lease_lost"
    description = (
        "This request took longer than its lease and another request with the same "
        "Idempotency-Key took over; nothing of this attempt was kept. Retry to get the result."
    )
    final = False


class StoreUnavailable(IdempotencyError, StoreUnavailableError):
    """PostgreSQL could not be reached or did not answer: fail closed.

    The one class an application needs for this condition: raise it from a view
    (a ``503`` with ``Retry-After``, by default the app's
    ``IDEMPOTENCY_RETRY_AFTER``), or catch it around ``idempotency.ping()``. It is
    also the store's own ``StoreUnavailableError``, so either ``except`` works.
    """

    code = 503
    title = "Idempotency store unavailable"
    error_code = "store_unavailable"
    description = "The idempotency store is unavailable; the request was not processed."
    final = False


class SchemaMissing(IdempotencyError, SchemaMismatchError):
    """The database answers but has no idempotency tables: ``flask idempotency
    migrate`` (or the Alembic revision) was never run. Fail closed.

    A ``500`` without ``Retry-After``, not the outage's ``503``: the server is
    misconfigured, and a client retrying the same request cannot change that (a
    payments client stops and alerts on a 500 it does not know, rather than
    retrying for ever). The view never runs. It is also a ``StoreUnavailableError``,
    so code that catches that around ``idempotency.ping()`` still fails closed.
    """

    code = 500
    title = "Idempotency schema missing"
    error_code = "schema_missing"
    description = (
        "The server's idempotency store is not set up (its schema is missing); "
        "the request was not processed."
    )

    #: No schema at all, rather than an older one (:class:`SchemaOutdated`).
    missing = True

    def __init__(self, description: str | None = None, *, detail: str = "") -> None:
        IdempotencyError.__init__(self, description)
        #: What the operator needs (the missing object and the command); for logs
        #: and ``except`` clauses, never sent to the client.
        self.detail = detail


class SchemaOutdated(SchemaMissing):
    """The idempotency schema is older than the installed flask-idempotency (a new
    release's migration not applied): ``500`` ``schema_outdated``, as above."""

    title = "Idempotency schema outdated"
    error_code = "schema_outdated"
    description = (
        "The server's idempotency store has an outdated schema; the request was not processed."
    )
    missing = False


def from_store_error(exc: StoreUnavailableError, retry_after: int) -> IdempotencyError:
    """The answer for a store failure: a schema problem is named (``500``, no
    ``Retry-After``), anything else is the outage's ``503 store_unavailable``."""
    if isinstance(exc, SchemaMissing):
        return exc
    if isinstance(exc, SchemaMismatchError):
        cls = SchemaMissing if exc.missing else SchemaOutdated
        return cls(detail=exc.detail)
    return StoreUnavailable(retry_after=retry_after)


#: ``assert_idempotent(atomicity_drill=True)`` sends it to fail an attempt after its
#: view returned; honoured only with ``IDEMPOTENCY_TESTING_DRILLS = True``.
DRILL_HEADER = "Idempotency-Drill"
DRILL_FAIL_AFTER_VIEW = "fail-after-view"


class DrillFailure(IdempotencyError):
    """The attempt a test drill failed after its view returned: rolled back and
    released, as when the completion itself fails."""

    code = 503
    title = "Attempt failed by a test drill"
    error_code = "drill_failure"
    description = "This attempt was failed on purpose by a test drill; nothing was kept."
    final = False


class ResponseTooLarge(IdempotencyError):
    """The view answered with a body larger than the configured maximum to store.

    Rather than answer without being able to replay (which would let a retry run
    the operation twice), the attempt is rolled back and reported as a 500.
    """

    code = 500
    title = "Response too large to store"
    error_code = "response_too_large"
    description = "The response was too large to store for idempotent replay; nothing was kept."


class ResponseNotStorable(IdempotencyError):
    """The view's answer holds a value the store cannot keep (a header with a NUL or
    a lone surrogate, say, echoing a client's input).

    As for :class:`ResponseTooLarge`, the attempt is rolled back rather than
    answered without a record, and it is a ``500`` without ``Retry-After``, not the
    outage's ``503``: the same request would fail the same way, so inviting
    retries would run the view again on each, and raise false "store down" alarms.
    """

    code = 500
    title = "Response cannot be stored"
    error_code = "response_not_storable"
    description = (
        "The response holds a value that cannot be stored for idempotent replay; nothing was kept."
    )


#: SQLSTATE class ``22``, data_exception: PostgreSQL refused a value it was sent (a
#: ``jsonb`` string with ``\u0000``, an unpaired surrogate, a number out of range).
DATA_EXCEPTION_CLASS = "22"


def refused_as_data(exc: BaseException) -> bool:
    """Whether a store failure is PostgreSQL refusing a value as data, read from the
    driver error it was raised from: an answer, not an outage, and no retry helps."""
    seen: BaseException | None = exc
    for _ in range(4):  # the store's error, the driver's, perhaps SQLAlchemy's around it
        code = getattr(seen, "pgcode", None) or getattr(seen, "sqlstate", None)
        if code:
            return str(code).startswith(DATA_EXCEPTION_CLASS)
        seen = getattr(seen, "__cause__", None) or getattr(seen, "orig", None)
    return False  # (past the end of the chain ``seen`` is None, and has neither)
