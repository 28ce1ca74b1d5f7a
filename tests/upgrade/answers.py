"""Comparing answers across releases: what a client sees, byte for byte."""

from __future__ import annotations

from typing import Any

from support.http_client import HttpResponse

#: Headers that differ between two answers of one stored response by design: the
#: server's clock and name, whether this one was a replay, and the request's own
#: key, which 0.3.0 echoes (never stored) and 0.2.x does not.
PER_ANSWER = frozenset({"connection", "date", "server", "idempotent-replayed", "idempotency-key"})


def seen(answer: HttpResponse) -> tuple[int, list[tuple[str, str]], bytes]:
    """Status, headers (sorted, names lower-cased, ``PER_ANSWER`` left out) and body."""
    headers = sorted(
        (name.lower(), value)
        for name, value in answer.headers.items()
        if name.lower() not in PER_ANSWER
    )
    return answer.status, headers, answer.body


def assert_replays(replay: HttpResponse, first: HttpResponse) -> None:
    """``replay`` is ``first`` replayed: same status, headers and body bytes."""
    assert replay.headers.get("Idempotent-Replayed") == "true", replay
    assert first.headers.get("Idempotent-Replayed") == "false", first
    assert seen(replay) == seen(first)


def assert_error(answer: HttpResponse, status: int, code: str) -> dict[str, Any]:
    """``answer`` is the extension's own error ``status``/``code``; its JSON body."""
    assert answer.status == status, answer
    body: dict[str, Any] = answer.json()
    assert body["error"]["code"] == code, body
    assert "Idempotent-Replayed" not in answer.headers
    return body
