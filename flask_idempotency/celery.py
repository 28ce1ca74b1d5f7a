"""Idempotent Celery tasks: the consumer guard on the task queue Flask teams run.

A task whose base is :class:`IdempotentTask` runs through the events'
:class:`~flask_idempotency.events.consumer.ConsumerGuard`, the one a kombu
consumer uses, so it has the HTTP route's guarantee:

* its key (``idempotency_key``: the ``idempotency_key`` message header, else
  the task id; or a named argument; or a function) is claimed in
  ``idempotency_records`` under the scope ``consumer:<task name>``, with a lease
  the process's keeper renews while the task runs;
* the task runs with ``idempotency.connection()`` inside the transaction that
  also stores its return value (as JSON) and marks the key done: its writes and
  its result commit together, or not at all;
* a redelivery or a duplicate publish of a finished key returns the stored
  result without running the task.

What the guard answers, and what the task does with it:

==========================================  ===========================================
guard outcome                               task
==========================================  ===========================================
``HANDLED`` / ``DUPLICATE``                 returns the stored result (JSON round trip,
                                            the same value for the first run and replays)
``RETRY``: the task raised                  the exception propagates: Celery's own policy
                                            (``autoretry_for``, ``self.retry()``, or a
                                            failure) decides; the attempt was rolled back
                                            and its claim ended, so the retry runs
``BUSY``: another worker holds the key      the message is published again with a
``FENCED``: our lease was taken over        ``countdown`` (same task id, same ``retries``:
``RETRY``: PostgreSQL unreachable           it spends no retry) and this one is
                                            acknowledged (``Ignore``); the copy then
                                            replays or takes over
``DEAD_LETTERED`` (``key_reused``)          :class:`TaskKeyReused`: a final failure
``DEAD_LETTERED`` (``worker_lost``)         :class:`TaskWorkerLost`: a final failure,
                                            not run (see below)
no key                                      :class:`TaskKeyMissing`: a final failure
==========================================  ===========================================

A worker killed mid-task holds the key until its lease runs out; with
``acks_late=True`` the broker gives the message back (``task_reject_on_worker_lost``
requeues it at once when only the pool process died), the copy is ``BUSY`` until
the lease ends and then takes the record over. A task that kills its worker
every time would loop so for ever (nothing raised, so Celery counts no retry):
once ``idempotency_max_worker_losses`` attempts were lost (the record's
``takeovers`` less ``request.retries``), the next takeover does not run it but
fails it with :class:`TaskWorkerLost` and releases its record, so a re-run after
a fix starts afresh. A raise Celery does not retry releases the record too.
``docs/celery.md`` explains the configuration.

The task's writes go through ``idempotency.connection()`` (psycopg2, raw SQL).
Whatever joins that transaction for a view (the guard sets the same per-message
state on ``g``) works in a task the same way; ``db.session`` will too once it
joins the request's transaction (CONTRACT section 6).

:class:`TaskPublisher` lets the outbox relay publish events as task messages, the
event id as task id, so an emitted event reaches its task once in effect.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
from collections.abc import Callable, Mapping
from typing import Any

from flask import Flask, has_app_context

from .events.amqp import DEFAULT_TIMEOUT, Publisher
from .events.consumer import ConsumerGuard
from .events.messages import ConsumerOutcome, Delivery, Result, consumer_options
from .events.outbox import OutboxEvent
from .store.base import StoredResponse

try:
    import celery
    from celery.exceptions import Ignore, Reject, Retry
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError(
        "flask_idempotency.celery needs Celery: pip install 'flask-idempotency[celery]'"
    ) from exc

log = logging.getLogger("flask_idempotency.celery")

#: The message header that carries a task's idempotency key
#: (``apply_async(..., headers={"idempotency_key": "order-42"})``).
KEY_HEADER = "idempotency_key"

#: The shortest wait before a deferred copy is delivered again: a claim whose
#: lease has just ended can be taken over at once, but not in a busy loop.
_MIN_DEFER = 0.05

#: How a stored result says it is one (a plain consumer's record has no body).
_RESULT_HEADERS = (("Content-Type", "application/json"),)

#: ``idempotency_key=`` as a function: ``(request, args, kwargs) -> key or None``,
#: ``request`` being the task's ``self.request``.
KeyFunc = Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]


class TaskKeyMissing(Exception):
    """The task found no idempotency key (no header, argument or task id): it did not run."""


class TaskKeyReused(Exception):
    """Another task call (other arguments) already used this key: this one did not run."""


class TaskWorkerLost(Exception):
    """The task's earlier attempts lost their worker (a segfault, an OOM kill,
    ``os._exit``) ``idempotency_max_worker_losses`` times: it is not run again.

    Not Celery's ``WorkerLostError``: with ``task_reject_on_worker_lost`` that one
    requeues the message, and this failure is meant to be final.
    """

    def __init__(self, task: str, losses: int, limit: int) -> None:
        super().__init__(task, losses, limit)  # as given: the exception pickles
        self.task = task
        self.losses = losses
        self.limit = limit

    def __str__(self) -> str:
        return (
            f"task {self.task}: {self.losses} earlier attempts lost their worker without "
            f"finishing (idempotency_max_worker_losses={self.limit}); not run again"
        )


class TaskDeferred(Exception):
    """A task run outside a worker (eager, or called directly) could not run now:
    its key is held by a live attempt (``in_progress``), its lease was lost, or
    PostgreSQL is unreachable. A worker would publish it again for later."""

    def __init__(self, reason: str, delay: float) -> None:
        super().__init__(reason, delay)  # as given: the exception pickles (result backends)
        self.reason = reason
        self.delay = delay

    def __str__(self) -> str:
        return f"{self.reason}: try again in {self.delay:.2f} s"


class _TaskGuard(ConsumerGuard):
    """The consumer guard whose completed record keeps the task's result, and
    whose retries are Celery's."""

    def stored_record(self, returned: Any) -> StoredResponse:
        """The task's return value as JSON (``TypeError`` otherwise, which fails the
        attempt like an exception of the task)."""
        body = json.dumps(returned, separators=(",", ":"), allow_nan=False)
        return StoredResponse(200, _RESULT_HEADERS, body.encode("utf-8"))

    def worker_losses(self, takeovers: int, delivery: Delivery) -> int:
        """Takeovers not explained by a retry: each attempt that raised and was
        retried (``request.retries``) was taken over once by its retry; the rest
        were attempts whose worker died (or that outlived their lease)."""
        return max(takeovers - int(delivery.payload["retries"]), 0)  # set by __call__

    def gives_up(self, exc: Exception) -> bool:
        """A raise is final unless Celery delivers the task again: ``Retry`` (from
        ``autoretry_for`` or ``self.retry()``) or ``Reject(requeue=True)``. A final
        failure releases the record, so its attempts are not counted as lost when
        the same key runs again after a fix."""
        return not isinstance(exc, Retry) and not (isinstance(exc, Reject) and exc.requeue)


class IdempotentTask(celery.Task):  # type: ignore[misc]
    """A Celery task that runs once in effect per idempotency key.

    Use it as ``base``; the options are task attributes, so they can be given to
    the decorator too::

        @celery_app.task(base=IdempotentTask, bind=True, acks_late=True,
                         idempotency_key="charge_id")
        def write_receipt(self, charge_id, amount): ...

    The task body writes through ``idempotency.connection()``; its return value
    must be JSON. See the module's docstring for what each outcome does.
    """

    #: The Flask app whose extension (``Idempotency``) stores the records. ``None``:
    #: the current app, so a task base that pushes an app context (Flask's
    #: "Background Tasks with Celery" pattern) needs nothing more.
    flask_app: Flask | None = None
    #: Where the key comes from: ``None`` for the ``idempotency_key`` header, else
    #: the task id (stable across redeliveries and retries; pass ``task_id=`` to
    #: make a re-publish a duplicate); the name of an argument of the task; or a
    #: function ``(request, args, kwargs) -> key``.
    idempotency_key: str | KeyFunc | None = None
    #: Scope of the task's records, ``consumer:<name>``; default: the task's name.
    #: Tasks that share a name share their keys.
    idempotency_name: str | None = None
    #: Seconds a claim is held without renewal, and a finished key remembered;
    #: ``None``: the app's ``IDEMPOTENCY_LEASE`` / ``IDEMPOTENCY_TTL``. The lease is
    #: how long a killed worker's message waits before it is taken over.
    idempotency_lease: float | None = None
    idempotency_ttl: float | None = None
    #: Longest wait before a copy deferred by a live holder is delivered again.
    idempotency_busy_delay: float = 1.0
    #: Wait before a copy deferred by a PostgreSQL outage is delivered again.
    idempotency_outage_delay: float = 1.0
    #: Attempts lost with their worker (killed, segfaulted, ``os._exit``) after
    #: which the task is not run again but fails with :class:`TaskWorkerLost`,
    #: its record released; ``None``: no limit. Attempts that raised are
    #: Celery's to count (``max_retries``) and do not count here.
    idempotency_max_worker_losses: int | None = 3

    @functools.cached_property
    def idempotency_guard(self) -> _TaskGuard:
        """The guard this task runs through (built on first use: Celery sets the
        task's options as attributes after the class is made)."""
        options = consumer_options(
            self.idempotency_name or self.name,
            key=None,
            # A task's failed attempts are Celery's to count (``max_retries``), so the
            # guard never gives up on one itself; they still show in ``takeovers``.
            max_attempts=None,
            lease=self.idempotency_lease,
            ttl=self.idempotency_ttl,
            retry_delay=self.idempotency_outage_delay,
            max_retry_delay=self.idempotency_outage_delay,
            busy_delay=self.idempotency_busy_delay,
            max_worker_losses=self.idempotency_max_worker_losses,
        )
        return _TaskGuard(self._run_delivery, options)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        key = self.idempotency_key_for(request, args, kwargs)
        if key is None or key == "":
            raise TaskKeyMissing(
                f"task {self.name}: no idempotency key (no {KEY_HEADER!r} header, "
                "argument or task id)"
            )
        delivery = Delivery(
            id=str(key),
            type=self.name,
            payload={"args": args, "kwargs": kwargs, "retries": request.retries or 0},
            headers=dict(request.headers or {}),
            redelivered=bool((request.delivery_info or {}).get("redelivered")),
            body={"task": self.name, "arguments": self._arguments(args, kwargs)},
        )
        if self.flask_app is None and not has_app_context():
            raise RuntimeError(
                f"task {self.name}: no Flask app for its idempotency records; set flask_app= "
                "on the task (or its base), or run tasks in an app context"
            )
        # ``app=None``: the guard takes the current app.
        result = self.idempotency_guard.handle(delivery, app=self.flask_app)
        return self._outcome(result, request, args, kwargs)

    def _run_delivery(self, delivery: Delivery) -> Any:
        return self.run(*delivery.payload["args"], **delivery.payload["kwargs"])

    def _run_signature(self) -> inspect.Signature:
        # Under autoretry_for, run is a wrapper and _orig_run the task function.
        return inspect.signature(getattr(self, "_orig_run", None) or self.run)

    def _arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """What "the same call" means (the fingerprint): the arguments by name, with
        defaults filled in, so ``f(1)`` and ``f(x=1)`` are one call; as given when
        they do not fit the signature (the task will say so when it runs)."""
        try:
            bound = self._run_signature().bind(*args, **kwargs)
        except (TypeError, ValueError):
            return {"args": list(args), "kwargs": kwargs}
        bound.apply_defaults()
        return bound.arguments

    def idempotency_key_for(
        self, request: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """This call's key, as ``idempotency_key`` says; ``None`` when there is none."""
        # Read from the class: a function given to the decorator must not become a method.
        spec = type(self).idempotency_key
        if spec is None:
            return (request.headers or {}).get(KEY_HEADER) or request.id
        if callable(spec):
            return spec(request, args, kwargs)
        if spec in kwargs:
            return kwargs[spec]
        try:
            bound = self._run_signature().bind_partial(*args, **kwargs)
        except TypeError:
            return None
        return bound.arguments.get(spec)

    def _outcome(
        self, result: Result, request: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        outcome = result.outcome
        if outcome is ConsumerOutcome.HANDLED or outcome is ConsumerOutcome.DUPLICATE:
            if outcome is ConsumerOutcome.DUPLICATE:
                log.info("task %s[%s]: already done; stored result returned", self.name, request.id)
            stored = result.stored  # (a plain consumer's record has no body: None)
            return json.loads(stored.body) if stored is not None and stored.body else None
        if result.error is not None and outcome is not ConsumerOutcome.FENCED:
            # The task raised (its writes were rolled back, its claim ended):
            # Celery's retry policy decides what comes next.
            raise result.error
        if outcome is ConsumerOutcome.DEAD_LETTERED:
            if result.reason == "key_reused":
                raise TaskKeyReused(
                    f"task {self.name}: key already used by a call with other arguments"
                )
            if result.reason == "worker_lost":
                limit = self.idempotency_max_worker_losses
                raise TaskWorkerLost(self.name, result.attempts, limit or 0)
            raise TaskKeyMissing(f"task {self.name}: {result.reason}")
        # BUSY, FENCED, or PostgreSQL unreachable: not this attempt's to run now. This
        # message is published again for ``result.delay`` from now and acknowledged.
        # Not ``self.retry()``: that spends one of the task's retries and records a
        # RETRY state over the holder's; a copy under the same task id and
        # ``retries`` is the same message, later. Published before the ack, as
        # Celery's retry is: a crash in between leaves one more copy, which the
        # key absorbs.
        reason = result.reason or outcome.value
        delay = max(result.delay, _MIN_DEFER)
        if request.called_directly or request.is_eager:
            raise TaskDeferred(reason, delay)
        log.info("task %s[%s]: %s; again in %.2f s", self.name, request.id, reason, delay)
        self.signature_from_request(request, args, kwargs, countdown=delay).apply_async()
        raise Ignore()


class TaskPublisher(Publisher):
    """The relay's publisher for Celery: each outbox event becomes a task message.

    ``routes`` maps event types to task names; the task gets the event's envelope
    (``{"id", "type", "created", "derived_key", "data"}``) as its one argument,
    under the event id as task id and ``idempotency_key`` header. A re-publish
    (the relay died before marking the row) is then the same task id, which an
    :class:`IdempotentTask` replays instead of running::

        Relay(idempotency.state.store,
              TaskPublisher(celery_app, {"charge.succeeded": "receipts.write"})).run()

    Publishing waits for the broker's confirm on a connection of its own (made
    with ``confirm_publish``), whatever the Celery app's transport options. An
    event type with no route answers False: the relay defers it, as it does an
    event no queue is bound to. Connecting and closing are ``amqp.Publisher``'s.
    """

    def __init__(
        self,
        celery_app: Any,
        routes: Mapping[str, str],
        *,
        url: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        super().__init__(url or str(celery_app.conf.broker_url), "", timeout=timeout)
        self.celery_app = celery_app
        self.routes = dict(routes)

    def make_producer(self, conn: Any) -> Any:
        return self.celery_app.amqp.Producer(conn.default_channel)

    def publish(self, event: OutboxEvent) -> bool:
        return event.type in self.routes and super().publish(event)

    def send(self, producer: Any, event: OutboxEvent) -> None:
        self.celery_app.send_task(
            self.routes[event.type],
            args=[json.loads(event.envelope())],
            task_id=event.id,
            headers={KEY_HEADER: event.id},
            producer=producer,
            retry=False,  # the relay retries, with its own backoff
            add_to_parent=False,
        )


#: What an application uses; ``KEY_HEADER`` (the header a task's key travels in)
#: is read by name by producers that set it themselves.
__all__ = [
    "IdempotentTask",
    "TaskDeferred",
    "TaskKeyMissing",
    "TaskKeyReused",
    "TaskPublisher",
    "TaskWorkerLost",
]
