"""How the payments app calls its card processor, over HTTP or in process.

The app sees a closed set of outcomes, not HTTP: ``Charged``, ``Declined`` or
``ProcessorUnavailable``. Everything that is not a clear protocol answer (5xx, 409, a
400 mismatch, a timeout, a refused connection, a body the protocol does not define) is
"unavailable", because the app must then answer 502 and store nothing (CONTRACT §3).
"""

from __future__ import annotations

import http.client
import json
import threading
from collections.abc import Callable, Mapping
from typing import Protocol
from urllib.parse import urlencode, urlsplit

from example_app.processor_core import FakeProcessor
from example_app.processor_protocol import (
    Charged,
    ChargeOutcome,
    Declined,
    LookupOutcome,
    NoPayment,
    ProcessorAnswer,
    ProcessorUnavailable,
    lookup_from_answer,
    outcome_from_answer,
)

__all__ = [
    "DEFAULT_TIMEOUT_SECONDS",
    "ChargeOutcome",
    "Charged",
    "Declined",
    "HttpProcessorClient",
    "InProcessProcessorClient",
    "LookupOutcome",
    "NoPayment",
    "ProcessorClient",
    "ProcessorUnavailable",
    "outcome_from_answer",
    "processor_client_from_env",
    "shared_processor",
]

# CONTRACT §2: one processor call may take this long; it stays below the lease (30 s)
# so that a record is never taken over while its holder still waits on the processor.
DEFAULT_TIMEOUT_SECONDS = 10.0

# A protocol answer is a few dozen bytes; reading more would only let a broken
# upstream make the app buffer a large page.
MAX_ANSWER_BYTES = 64 * 1024


class ProcessorClient(Protocol):
    """One idempotent charge call; the same key must always be sent for the same charge.
    ``lookup`` asks which payment, if any, was made under a key (recovery)."""

    def charge(
        self, idempotency_key: str, amount: int, currency: str, customer: str, source: str
    ) -> ChargeOutcome: ...

    def lookup(self, idempotency_key: str) -> LookupOutcome: ...


def _charge_body(amount: int, currency: str, customer: str, source: str) -> dict[str, object]:
    return {"amount": amount, "currency": currency, "customer": customer, "source": source}


class HttpProcessorClient:
    """The processor over HTTP with the standard library, one connection per call.

    A fresh connection per call keeps a client safe to share between threads and
    never reuses a socket that a timed-out call left in an unknown state.
    """

    def __init__(self, base_url: str, timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"processor URL must be http(s)://host[:port][/path]: {base_url!r}")
        if timeout_seconds <= 0:
            raise ValueError("processor timeout must be > 0")
        self.base_url = base_url
        self.timeout_seconds = timeout_seconds
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port  # None: the scheme's default
        self._path = parts.path.rstrip("/") + "/v1/charges"

    def charge(
        self, idempotency_key: str, amount: int, currency: str, customer: str, source: str
    ) -> ChargeOutcome:
        body = json.dumps(_charge_body(amount, currency, customer, source)).encode()
        headers = {
            "Content-Type": "application/json",
            "Accept": "application/json",
            "Idempotency-Key": idempotency_key,
        }
        answer = self._exchange("POST", self._path, body, headers)
        if isinstance(answer, ProcessorUnavailable):
            return answer
        return outcome_from_answer(*answer)

    def lookup(self, idempotency_key: str) -> LookupOutcome:
        path = self._path + "?" + urlencode({"idempotency_key": idempotency_key})
        answer = self._exchange("GET", path, None, {"Accept": "application/json"})
        if isinstance(answer, ProcessorUnavailable):
            return answer
        return lookup_from_answer(*answer)

    def _exchange(
        self, method: str, path: str, body: bytes | None, headers: dict[str, str]
    ) -> tuple[int, bytes] | ProcessorUnavailable:
        connection_class = (
            http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        )
        connection = connection_class(self._host, self._port, timeout=self.timeout_seconds)
        try:
            connection.request(method, path, body=body, headers=headers)
            response = connection.getresponse()
            data = response.read(MAX_ANSWER_BYTES + 1)
        except TimeoutError:
            return ProcessorUnavailable(f"no answer within {self.timeout_seconds} s")
        except (OSError, http.client.HTTPException) as exc:
            return ProcessorUnavailable(f"{type(exc).__name__}: {exc}")
        finally:
            connection.close()
        if len(data) > MAX_ANSWER_BYTES:
            return ProcessorUnavailable(f"processor answered {response.status} with a huge body")
        return response.status, data


class InProcessProcessorClient:
    """The fake processor called directly, with the HTTP client's behaviour.

    The call runs in a daemon thread that the client waits on for at most the timeout:
    as over HTTP, a slow call the client gave up on still completes (and may charge),
    which is exactly the case a retry under the same key must recover from.
    """

    def __init__(
        self, processor: FakeProcessor, timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS
    ) -> None:
        if timeout_seconds <= 0:
            raise ValueError("processor timeout must be > 0")
        self.processor = processor
        self.timeout_seconds = timeout_seconds

    def charge(
        self, idempotency_key: str, amount: int, currency: str, customer: str, source: str
    ) -> ChargeOutcome:
        body = _charge_body(amount, currency, customer, source)
        answer = self._call(lambda: self.processor.handle_charge(idempotency_key, body))
        if isinstance(answer, ProcessorUnavailable):
            return answer
        return outcome_from_answer(answer.status, answer.body)

    def lookup(self, idempotency_key: str) -> LookupOutcome:
        answer = self._call(lambda: self.processor.handle_lookup(idempotency_key))
        if isinstance(answer, ProcessorUnavailable):
            return answer
        return lookup_from_answer(answer.status, answer.body)

    def _call(
        self, handle: Callable[[], ProcessorAnswer]
    ) -> ProcessorAnswer | ProcessorUnavailable:
        answers: list[ProcessorAnswer] = []
        errors: list[Exception] = []

        def call() -> None:
            try:
                answers.append(handle())
            except Exception as exc:  # a bug in the fake must look like a 500, not a hang
                errors.append(exc)

        worker = threading.Thread(target=call, name="fake-processor-call", daemon=True)
        worker.start()
        worker.join(self.timeout_seconds)
        if errors:
            return ProcessorUnavailable(f"processor raised {errors[0]!r}")
        if not answers:
            return ProcessorUnavailable(f"no answer within {self.timeout_seconds} s")
        return answers[0]


_SHARED_PROCESSOR = FakeProcessor()


def shared_processor() -> FakeProcessor:
    """The process-wide fake used when PROCESSOR_URL is unset; tests may inspect or reset it."""
    return _SHARED_PROCESSOR


def processor_client_from_env(environ: Mapping[str, str]) -> ProcessorClient:
    """Build the client from PROCESSOR_URL and PROCESSOR_TIMEOUT_SECONDS; bad values raise.

    Raising ``ValueError`` at start-up beats discovering a typo on the first charge.
    """
    raw_timeout = environ.get("PROCESSOR_TIMEOUT_SECONDS", "").strip()
    try:
        timeout = float(raw_timeout) if raw_timeout else DEFAULT_TIMEOUT_SECONDS
    except ValueError:
        raise ValueError(f"PROCESSOR_TIMEOUT_SECONDS is not a number: {raw_timeout!r}") from None
    if not timeout > 0 or timeout == float("inf"):
        raise ValueError(f"PROCESSOR_TIMEOUT_SECONDS must be a positive number: {raw_timeout!r}")
    url = environ.get("PROCESSOR_URL", "").strip()
    if not url:
        return InProcessProcessorClient(shared_processor(), timeout)
    return HttpProcessorClient(url, timeout)
