"""Flask responses to stored data and back: status, headers and body bytes only.

Never a pickled object: whoever can write the store must not be able to run
code in the application.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import re
from collections.abc import Callable

from flask import Response
from werkzeug.http import is_hop_by_hop_header, parse_set_header

from .profiles import IETF, OMITTED_HEADER, OMITTED_VALUE, SHOULD_RETRY_HEADER, STRIPE, Profile
from .store.base import StoredResponse

#: Not replayed: hop-by-hop headers (Werkzeug's ``is_hop_by_hop_header`` list of
#: RFC 2616's, and these two spellings outside it), per-answer headers the server
#: sets again, the length (recomputed), cookies (a replay must never hand out a
#: session), and our own markers.
NOT_STORED_HEADERS = frozenset(
    h.lower()
    for h in (
        "Proxy-Connection",
        "Trailers",
        "Date",
        "Server",
        "Content-Length",
        "Set-Cookie",
        STRIPE.replayed_header,
        IETF.replayed_header,
        OMITTED_HEADER,
    )
)

#: Dropped from every replay, whatever the store or the cache holds (a row written
#: before a header joined the list, an entry planted in Redis): all of the above
#: but the marker of an omitted body, which the stored answer carries on purpose.
NOT_REPLAYED_HEADERS = NOT_STORED_HEADERS - {OMITTED_HEADER.lower()}

#: Every response header the extension may set, for ``Access-Control-Expose-Headers``
#: (with the key header, which the ``stripe`` profile echoes).
EXPOSED_HEADERS = (
    STRIPE.replayed_header,
    IETF.replayed_header,
    OMITTED_HEADER,
    "Retry-After",
    SHOULD_RETRY_HEADER,
)

#: PostgreSQL's ``smallint``, the column of a stored status.
_STATUS_RANGE = range(-32768, 32768)
#: What ``jsonb`` text cannot hold: a NUL, or a surrogate (in a ``str`` every one is
#: lone, and UTF-8 has no encoding for it).
_UNSTORABLE_TEXT = re.compile("[\x00\ud800-\udfff]")


def _kept(name: str, dropped: frozenset[str]) -> bool:
    """Whether a header may be stored or replayed: not hop-by-hop, nor in ``dropped``."""
    return name.lower() not in dropped and not is_hop_by_hop_header(name)


class NotStorable(Exception):
    """The body is larger than the most that may be stored (and the route rejects such)."""


@functools.lru_cache(maxsize=16)
def per_request(patterns: tuple[str, ...]) -> Callable[[str], bool]:
    """Whether a header name is one of ``patterns`` (``IDEMPOTENCY_NOT_REPLAYED_HEADERS``:
    names, or prefixes ending in ``*``), case-insensitively. Made once per list."""
    exact = frozenset(p.lower() for p in patterns if not p.endswith("*"))
    prefixes = tuple(p[:-1].lower() for p in patterns if p.endswith("*"))

    def matches(name: str) -> bool:
        lowered = name.lower()
        return lowered in exact or lowered.startswith(prefixes)

    return matches


def answer_only(stored: StoredResponse, not_replayed: tuple[str, ...]) -> StoredResponse:
    """``stored`` without the headers that belong to the request rather than the
    answer (CORS's, by default): the app's own layers add this request's on a replay,
    so a retry from a second allowed origin is not handed the first one's."""
    matches = per_request(not_replayed)
    headers = tuple(pair for pair in stored.headers if not matches(pair[0]))
    return dataclasses.replace(stored, headers=headers)


def storable(stored: StoredResponse) -> bool:
    """Whether PostgreSQL can hold the answer: headers go into ``jsonb``, which has
    no NUL (``\\u0000``) and no unpaired surrogate, and a lone surrogate is no text
    at all (nor could a WSGI server send it); the status goes into a ``smallint``.

    Checked before the completion, so such an answer (a header echoing a client's
    ``"\\u0000"`` or ``"\\ud800"`` from a JSON body) is refused as itself, not as
    an outage that a client would retry, running the view each time.
    """
    text = "".join(name + value for name, value in stored.headers)
    return stored.status in _STATUS_RANGE and not _UNSTORABLE_TEXT.search(text)


def capture(response: Response, max_body: int, *, omit_oversize: bool) -> StoredResponse:
    """The response as data; a streamed body (a generator, ``stream_with_context``,
    ``send_file``) is read into memory first and then served from the buffer.

    Streaming routes are buffered rather than refused: a stored answer must be
    replayable byte for byte. A body over ``max_body`` is stored without its body
    (``omit_oversize``; the client still gets all of it, the rest of a stream
    flowing on untouched) or refused with :class:`NotStorable`.
    """
    headers = tuple([pair for pair in response.headers if _kept(pair[0], NOT_STORED_HEADERS)])
    if response.is_sequence and not response.direct_passthrough:
        body: bytes | None = response.get_data()
        if body is not None and len(body) > max_body:
            if not omit_oversize:
                raise NotStorable(f"body of {len(body)} bytes is over the limit of {max_body}")
            body = None
    else:
        body = _buffer_stream(response, max_body, omit_oversize)
    if body is None:
        headers, body = (*headers, (OMITTED_HEADER, OMITTED_VALUE)), b""
    return StoredResponse(response.status_code, headers, body)


def _buffer_stream(response: Response, max_body: int, omit_oversize: bool) -> bytes | None:
    """The whole streamed body, now served from memory; ``None`` when it was over
    ``max_body`` and goes on streaming (``omit_oversize``)."""
    source = response.response
    encoded = iter(response.iter_encoded())
    chunks: list[bytes] = []
    size = 0
    try:
        for chunk in encoded:
            chunks.append(chunk)
            size += len(chunk)
            if size > max_body:
                if not omit_oversize:
                    raise NotStorable(f"streamed body over the limit of {max_body} bytes")
                # The chunks already read, then the rest of the stream; its source is
                # closed when the response is (Werkzeug's documented call_on_close).
                response.response = itertools.chain(chunks, encoded)
                response.call_on_close(lambda: _close(source))
                response.direct_passthrough = False
                return None
    except BaseException:
        _close(source)
        raise
    _close(source)  # the generator or the file: read to its end
    body = b"".join(chunks)
    # Served from the buffer from now on; Content-Length becomes exact.
    response.direct_passthrough = False
    response.set_data(body)
    return body


def _close(source: object) -> None:
    close = getattr(source, "close", None)
    if close is not None:
        close()


def replay(
    stored: StoredResponse, profile: Profile = STRIPE, not_replayed: tuple[str, ...] = ()
) -> Response:
    """The stored answer as a response, without what no replay may carry
    (``Set-Cookie``, hop-by-hop headers, ``not_replayed``), whatever was stored."""
    answer = answer_only(stored, not_replayed)
    headers = [pair for pair in answer.headers if _kept(pair[0], NOT_REPLAYED_HEADERS)]
    response = Response(stored.body, status=stored.status, headers=headers)
    response.headers[profile.replayed_header] = "true"
    return response


def mark_original(response: Response, profile: Profile) -> None:
    """Mark an answer the view produced, where the profile does (Stripe's ``false``)."""
    if profile.stripe:
        response.headers[profile.replayed_header] = "false"


def echo_key(response: Response, key_header: str, raw_key: str) -> None:
    """Send the request's key back, as Stripe does and its SDKs read: as the client
    sent it (it was checked to be visible ASCII), on any answer to a keyed request.
    Never stored: a replay gets the key of the request it answers."""
    response.headers[key_header] = raw_key.strip(" \t")


def expose_headers(response: Response, key_header: str) -> None:
    """Add the extension's headers to ``Access-Control-Expose-Headers`` (CORS)."""
    exposed = response.headers.get_all("Access-Control-Expose-Headers")
    present = parse_set_header(", ".join(exposed))  # (its `in` ignores case)
    missing = [h for h in (*EXPOSED_HEADERS, key_header) if h not in present]
    if missing:
        response.headers.add("Access-Control-Expose-Headers", ", ".join(missing))
