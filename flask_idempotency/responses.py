"""Flask responses to stored data and back: status, headers and body bytes only.

Never a pickled object: whoever can write the store must not be able to run
code in the application.
"""

from __future__ import annotations

from flask import Response

from .store.base import StoredResponse

REPLAYED_HEADER = "Idempotent-Replayed"

#: Not replayed: hop-by-hop headers, per-answer headers the server sets again,
#: the length (recomputed), cookies (a replay must never hand out a session),
#: and our own marker.
NOT_STORED_HEADERS = frozenset(
    h.lower()
    for h in (
        "Connection",
        "Keep-Alive",
        "Proxy-Authenticate",
        "Proxy-Authorization",
        "Proxy-Connection",
        "TE",
        "Trailer",
        "Trailers",
        "Transfer-Encoding",
        "Upgrade",
        "Date",
        "Server",
        "Content-Length",
        "Set-Cookie",
        REPLAYED_HEADER,
    )
)


class NotStorable(Exception):
    """The response streams a file or cannot be buffered."""


def capture(response: Response) -> StoredResponse:
    if response.direct_passthrough:
        raise NotStorable("direct passthrough responses (files) cannot be stored")
    try:
        body = response.get_data()
    except RuntimeError as exc:
        raise NotStorable(str(exc)) from exc
    headers = tuple(
        (name, value)
        for name, value in response.headers.items()
        if name.lower() not in NOT_STORED_HEADERS
    )
    return StoredResponse(response.status_code, headers, body)


def replay(stored: StoredResponse) -> Response:
    response = Response(stored.body, status=stored.status, headers=list(stored.headers))
    response.headers[REPLAYED_HEADER] = "true"
    return response
