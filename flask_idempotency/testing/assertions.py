"""``assert_idempotent``: prove through real HTTP that duplicates of a request run its view once.

The check sends ``duplicates`` identical requests (same body, same
``Idempotency-Key``) at the same moment from as many threads, each on a
connection of its own, to a server that really runs them concurrently (a
:class:`~flask_idempotency.testing.live_server.LiveServer`, gunicorn, a deployed app). A
duplicate answered ``409`` with ``Retry-After`` (the first one is still
running) is retried until it gets a final answer. Then:

* exactly one answer is not marked as a replay (``Idempotent-Replayed: true``
  in the ``stripe`` profile, ``Idempotency-Replayed: true`` in ``ietf``);
* every answer has the same status and a byte-identical body;
* the view ran once, if you pass ``executions=`` (a callable returning how many
  times it ran so far, e.g. a ``SELECT count(*)`` of the rows it inserts);
* ``idempotency_records`` gained exactly one completed record, if you pass
  ``database_url=`` (the app's database);
* the same key with a different body answers ``422`` and runs nothing;
* with ``atomicity_drill=True`` (and ``executions=``): an attempt that fails
  after the view returned keeps none of the view's writes, and the retry runs
  the view exactly once. The app under test must enable the drill
  (``IDEMPOTENCY_TESTING_DRILLS = True``); a view whose writes do not commit
  with the stored answer (a Flask-SQLAlchemy view without ``db=db``, a second
  connection) fails it.

All problems found are reported together in one ``AssertionError``. Messages
show at most a short prefix of a body and never the idempotency key.
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import json as jsonlib
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

from ..errors import DRILL_FAIL_AFTER_VIEW, DRILL_HEADER, DrillFailure
from ..profiles import PROFILES

#: Replay markers of the two profiles: ``stripe`` (also ``false`` on the original) and ``ietf``.
REPLAY_HEADERS = tuple(profile.replayed_header for profile in PROFILES.values())

#: How much of a body an assertion message may show.
PREVIEW_BYTES = 40

_MISSING: Any = object()

_CONNECTIONS = {"http": http.client.HTTPConnection, "https": http.client.HTTPSConnection}


@dataclasses.dataclass(frozen=True)
class Answer:
    """The final answer one duplicate got."""

    status: int
    #: Header names in lower case; a repeated header's values joined by ``", "``.
    headers: Mapping[str, str]
    body: bytes
    #: ``409`` answers (request still in progress) retried before this one.
    in_progress_retries: int = 0

    def header(self, name: str) -> str | None:
        return self.headers.get(name.lower())

    @property
    def replayed(self) -> bool:
        return any((self.header(h) or "").strip().lower() == "true" for h in REPLAY_HEADERS)

    @property
    def in_progress(self) -> bool:
        """A ``409`` with ``Retry-After``: the first request is still running."""
        return self.status == 409 and self.header("Retry-After") is not None


@dataclasses.dataclass(frozen=True)
class IdempotencyReport:
    """What ``assert_idempotent`` saw, once every check passed."""

    status: int
    body: bytes
    answers: tuple[Answer, ...]
    #: ``409 in progress`` answers retried, over all duplicates.
    in_progress_retries: int
    #: How many times the view ran (the ``executions`` hook's difference), if given.
    executions: int | None
    #: The status of the same key with a different body (``422``).
    mismatch_status: int


def preview(body: bytes) -> str:
    """A short, safe rendering of a body for messages: its first bytes, escaped."""
    shown = repr(body[:PREVIEW_BYTES])
    return f"{shown}… ({len(body)} bytes)" if len(body) > PREVIEW_BYTES else shown


def _times(count: int) -> str:
    return "once" if count == 1 else f"{count} times"


@dataclasses.dataclass(frozen=True)
class _Request:
    """One request as sent (``dataclasses.replace`` makes the probes' variants)."""

    url: str
    method: str
    headers: Mapping[str, str]
    body: bytes | None
    timeout: float


def _send(request: _Request) -> Answer:
    parts = urlsplit(request.url)
    conn_class = _CONNECTIONS.get(parts.scheme)
    if conn_class is None or not parts.hostname:
        raise ValueError("assert_idempotent needs an http:// or https:// URL")
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    headers = {**request.headers, "Connection": "close"}
    conn = conn_class(parts.hostname, parts.port, timeout=request.timeout)
    with contextlib.closing(conn):
        conn.request(request.method, target, body=request.body, headers=headers)
        response = conn.getresponse()
        fields = response.msg  # case-insensitive; get_all() gives a repeated header's values
        received = {name.lower(): ", ".join(fields.get_all(name, [])) for name in fields}
        return Answer(response.status, received, response.read())


def _send_until_final(request: _Request, deadline: float, start: threading.Barrier) -> Answer:
    """One duplicate: sent when ``start`` lets every duplicate go at once, and re-sent
    while it is answered ``409`` with ``Retry-After``."""
    start.wait()
    retries = 0
    while True:
        answer = _send(request)
        if not answer.in_progress or time.monotonic() >= deadline:
            return dataclasses.replace(answer, in_progress_retries=retries)
        # Faster than Retry-After (whole seconds): a test wants the answer as soon as it
        # exists. Pauses of 10 ms, doubling up to 100 ms.
        time.sleep(min(0.01 * 2**retries, 0.1))
        retries += 1


def _encode(json: Any, data: bytes | str | None, headers: dict[str, str]) -> bytes | None:
    """The body to send: ``json`` serialised (``Content-Type: application/json``
    unless ``headers`` name one), else ``data``."""
    if json is _MISSING:
        return data.encode("utf-8") if isinstance(data, str) else data
    if data is not None:
        raise TypeError("pass json= or data=, not both")
    if not any(name.lower() == "content-type" for name in headers):
        headers["Content-Type"] = "application/json"
    return jsonlib.dumps(json).encode("utf-8")


def _mismatched(body: bytes | None) -> bytes:
    """A body the extension must see as different from ``body``: another JSON value
    when ``body`` is JSON (whitespace or key order would not do), else other bytes."""
    marker = f"assert_idempotent:{secrets.token_hex(4)}"
    try:
        parsed = jsonlib.loads(body or b"")
    except ValueError:
        return (body or b"") + marker.encode("ascii")
    if isinstance(parsed, dict):
        changed: Any = {**parsed, "_assert_idempotent_probe": marker}
    elif isinstance(parsed, list):
        changed = [*parsed, marker]
    else:
        changed = {"_assert_idempotent_probe": marker, "value": parsed}
    return jsonlib.dumps(changed).encode("utf-8")


def _record_snapshot(database_url: str) -> dict[bytes, str]:
    """``record_key -> state`` of every row of ``idempotency_records``."""
    import psycopg2

    try:
        conn = psycopg2.connect(database_url, connect_timeout=10)
    except psycopg2.Error as exc:
        raise AssertionError(
            f"assert_idempotent could not connect to database_url: {exc}"
        ) from None
    with contextlib.closing(conn), conn.cursor() as cur:
        try:
            cur.execute("SELECT record_key, state FROM idempotency_records")
        except psycopg2.errors.UndefinedTable:
            raise AssertionError(
                "database_url has no idempotency_records table: pass the app's own "
                "(migrated) database"
            ) from None
        return {bytes(key): state for key, state in cur.fetchall()}


def assert_idempotent(
    url: str,
    *,
    method: str = "POST",
    json: Any = _MISSING,
    data: bytes | str | None = None,
    headers: Mapping[str, str] | None = None,
    duplicates: int = 20,
    key: str | None = None,
    key_header: str = "Idempotency-Key",
    executions: Callable[[], int] | None = None,
    database_url: str | None = None,
    timeout: float = 30.0,
    atomicity_drill: bool = False,
) -> IdempotencyReport:
    """Send ``duplicates`` identical requests at once; assert the route ran once.

    ``url`` is the route's full URL on a real server (``live_server.url +
    "/v1/charges"``). ``headers`` are sent with every request (your
    ``Authorization``, say); the key is ``key``, else a fresh random one, in
    ``key_header``. ``executions`` is a callable returning how many times the
    view has run so far; ``database_url`` the app's database, to check its
    ``idempotency_records``. The ``422`` probe sends the body with one field
    added (other bytes for a body that is not JSON). ``timeout`` bounds the whole check,
    retries of ``409`` answers included. ``atomicity_drill`` also fails one attempt
    after its view returned (see the module's docstring).

    Returns an :class:`~flask_idempotency.testing.assertions.IdempotencyReport`;
    raises ``AssertionError`` listing every check that failed.
    """
    # pytest shows the caller's line, not this frame (whose arguments hold the key).
    __tracebackhide__ = True
    if duplicates < 2:
        raise ValueError("duplicates must be at least 2")
    sent_headers = dict(headers or {})
    for name in list(sent_headers):
        if name.lower() == key_header.lower():
            given = sent_headers.pop(name)  # sent once, under key_header
            key = key or given
    sent_headers[key_header] = key or f"assert-idempotent-{secrets.token_hex(16)}"
    body = _encode(json, data, sent_headers)  # (adds a json= body's Content-Type first)
    sent = _Request(url, method.upper(), sent_headers, body, timeout)

    started_executions = executions() if executions is not None else 0
    # The records there before the check: the check must add exactly one.
    known = _record_snapshot(database_url) if database_url is not None else None

    deadline = time.monotonic() + timeout
    start = threading.Barrier(duplicates, timeout=timeout)
    with ThreadPoolExecutor(duplicates, "assert_idempotent duplicate") as pool:
        futures = [pool.submit(_send_until_final, sent, deadline, start) for _ in range(duplicates)]
    got = [f.result() for f in futures if f.exception() is None]
    failed = [
        f"#{i}: {type(e).__name__}: {e}" for i, f in enumerate(futures) if (e := f.exception())
    ]
    problems: list[str] = []
    if failed:
        problems.append(
            f"{len(failed)} of {duplicates} duplicates got no answer: " + "; ".join(failed[:3])
        )
    if not got:
        raise AssertionError("assert_idempotent: " + "\n  ".join(problems or ["no answers"]))

    ran = executions() - started_executions if executions is not None else None
    if ran is not None and ran != 1:
        problems.append(
            f"the view ran {_times(ran)} for {duplicates} identical requests (executions hook); "
            "expected once"
        )

    statuses = Counter(a.status for a in got)
    still_running = sum(a.in_progress for a in got)
    if still_running:
        problems.append(f"{still_running} duplicates were still answered 409 after {timeout:g}s")
    if len(statuses) > 1:
        shown = ", ".join(f"{n}×{status}" for status, n in statuses.most_common())
        odd = next(a for a in got if a.status != statuses.most_common(1)[0][0])
        problems.append(
            f"the duplicates got different statuses: {shown} "
            f"(a {odd.status} body: {preview(odd.body)})"
        )

    fresh = [a for a in got if not a.replayed]
    if len(fresh) != 1:
        if len(fresh) == len(got) and any(a.header(REPLAY_HEADERS[0]) for a in got):
            problems.append(
                f"none of the {len(got)} answers was a replay, though the route marks them "
                f"({REPLAY_HEADERS[0]}: false): its {got[0].status} answers are not stored "
                "(should_store?), so every duplicate ran as a first request"
            )
        elif len(fresh) == len(got):
            problems.append(
                f"none of the {len(got)} answers was a replay (no "
                f"{' / '.join(h + ': true' for h in REPLAY_HEADERS)}): every duplicate was "
                f"answered as a first request. Is the route decorated with "
                f"@idempotency.required / @idempotency.optional, and is the key sent in "
                f"{key_header!r}?"
            )
        elif not fresh:
            problems.append(
                f"all {len(got)} answers were replays: the key was used before this check; "
                "pass a fresh key= (or none)"
            )
        else:
            problems.append(
                f"{len(fresh)} of {len(got)} answers were not replays; expected exactly one"
            )

    bodies = Counter(a.body for a in got)
    if len(bodies) > 1:
        (common, _), (other, _) = bodies.most_common(2)
        problems.append(
            f"the answers are not byte-identical: {len(bodies)} distinct bodies, "
            f"e.g. {preview(common)} and {preview(other)}"
        )

    if known is not None and database_url is not None:
        new = [state for k, state in _record_snapshot(database_url).items() if k not in known]
        if len(new) != 1:
            problems.append(
                f"idempotency_records gained {len(new)} records during the check; expected "
                "exactly one (is database_url the app's database?)"
            )
        elif new != ["completed"]:
            problems.append(
                f"the new idempotency record is {new[0]!r}, not 'completed': "
                f"the answer ({got[0].status}) was not stored"
            )

    before_probe = executions() if executions is not None else 0
    probe = _send(dataclasses.replace(sent, body=_mismatched(sent.body)))
    if probe.status != 422:
        problems.append(
            f"the same key with a different body answered {probe.status}, expected 422 "
            f"(key reused); body: {preview(probe.body)}"
        )
    probe_ran = executions() - before_probe if executions is not None else 0
    if probe_ran:
        problems.append(f"the view ran {_times(probe_ran)} for the mismatched request")

    if atomicity_drill:
        if executions is None:
            raise ValueError("atomicity_drill needs executions= to see the view's writes")
        problems.extend(_atomicity_drill(sent, key_header, executions))

    if problems:
        raise AssertionError(
            f"{sent.method} {urlsplit(url).path or '/'} is not idempotent under "
            f"{duplicates} concurrent duplicates:\n  - " + "\n  - ".join(problems)
        )
    return IdempotencyReport(
        status=fresh[0].status,
        body=fresh[0].body,
        answers=tuple(got),
        in_progress_retries=sum(a.in_progress_retries for a in got),
        executions=ran,
        mismatch_status=probe.status,
    )


def _atomicity_drill(sent: _Request, key_header: str, executions: Callable[[], int]) -> list[str]:
    """Fail one attempt after its view returned; check nothing of it was kept and
    that the retry runs the view once, then replays."""
    key = f"assert-idempotent-drill-{secrets.token_hex(16)}"
    drilled = dataclasses.replace(sent, headers={**sent.headers, key_header: key})
    before = executions()
    failing = {**drilled.headers, DRILL_HEADER: DRILL_FAIL_AFTER_VIEW}
    failed = _send(dataclasses.replace(drilled, headers=failing))
    if failed.status != DrillFailure.code or DrillFailure.error_code.encode() not in failed.body:
        return [
            f"the atomicity drill did not run (answered {failed.status}: "
            f"{preview(failed.body)}): set IDEMPOTENCY_TESTING_DRILLS = True on the app under test"
        ]
    problems = []
    survived = executions() - before
    if survived:
        problems.append(
            f"an attempt that failed after its view returned kept {_times(survived)} of its "
            "writes: they do not commit with the stored answer (write on "
            "idempotency.connection(), or give the extension your db: Idempotency(app, db=db))"
        )
    retry = _send(drilled)
    ran = executions() - before - survived
    if retry.replayed or ran != 1:
        problems.append(
            f"the retry after the failed attempt ran the view {_times(ran)} "
            f"({retry.status}, replayed={retry.replayed}); expected once"
        )
    again = _send(drilled)
    if not again.replayed or executions() - before - survived != 1:
        problems.append("the request after the retry was not a replay of it")
    return problems
