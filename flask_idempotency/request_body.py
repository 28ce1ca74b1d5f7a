"""Reading the request body to fingerprint it, and leaving it whole for the view.

The fingerprint needs the whole body, the view must still see all of it through
whichever API it uses (``get_data()``, ``get_json()``, ``form``, ``files``,
``request.stream``), and the extension's memory must not grow with the body's
size. So the body is read once, through ``request.stream`` (which enforces
``Content-Length`` and ``MAX_CONTENT_LENGTH``), and then put back as the
request's stream:

- a non-JSON body is hashed chunk by chunk as it arrives and spooled the way
  Werkzeug spools uploads (in memory up to 500 KiB, then a temporary file);
- a JSON body compares after parsing, so it is held whole: up to
  ``MAX_CONTENT_LENGTH`` when the app sets one, else :data:`MAX_JSON_BODY`,
  refused with ``413`` beyond.

A body the server cannot deliver (broken chunked framing, a client gone
mid-body) raises from the WSGI server's own parser, which Flask would turn into
a 500, or arrives silently cut short of its Content-Length; and a chunked body
over ``MAX_CONTENT_LENGTH`` is cut at the limit by Werkzeug without an error,
which would fingerprint (and let the view act on) only its first part. Each is
a 4xx here, before anything is claimed.
"""

from __future__ import annotations

import io
import itertools
import logging
import tempfile
import weakref
from collections.abc import Callable, Iterator
from typing import IO

from flask import Request
from werkzeug.exceptions import RequestEntityTooLarge

from .errors import MalformedBody
from .fingerprint import FINGERPRINT_ENVIRON_KEY, Fingerprinter, canonical_body, is_json_mimetype

log = logging.getLogger("flask_idempotency.requests")

#: Bytes read from the client at a time: the most of a non-JSON body in memory at once.
CHUNK_SIZE = 64 * 1024
#: A non-JSON body stays in memory up to this size, then moves to a temporary file:
#: Werkzeug's own threshold for spooling uploads (``default_stream_factory``).
SPOOL_IN_MEMORY = 500 * 1024
#: The largest JSON body read when the app sets no ``MAX_CONTENT_LENGTH``. A JSON
#: body is compared after parsing, so it is held whole, with its parsed form; 10 MiB
#: is the payload limit of common API gateways, far above what an API request
#: carries. A larger body is refused with ``413`` (before it is read when its length
#: is declared). An app that accepts larger JSON sets ``MAX_CONTENT_LENGTH``, which
#: is then the bound.
MAX_JSON_BODY = 10 * 1024 * 1024


def read_body(request: Request) -> None:
    """Fingerprint the body and leave it for the view as if unread, or answer a 4xx.

    The fingerprint goes into the request's environ for the default fingerprint
    function (``fingerprint.request_fingerprint``).
    """
    digest = Fingerprinter(request.method, request.path, request.query_string)
    json = is_json_mimetype(request.mimetype)
    held: list[bytes] = []  # a JSON body, compared after parsing
    bound = None
    if json:
        bound = MAX_JSON_BODY if request.max_content_length is None else request.max_content_length
        if (request.content_length or 0) > bound:
            # Werkzeug's own 413 for a declared length over MAX_CONTENT_LENGTH, earlier.
            raise RequestEntityTooLarge()
    try:
        size = _spool(request, request.stream, held.append if json else digest.update, bound)
    except RequestEntityTooLarge:
        raise  # a declared length over the limit, or a chunked body that reached it: 413
    except Exception as exc:  # the server's parser refused the framing, or a disconnect
        log.info("idempotency: unreadable request body (%s)", type(exc).__name__)
        raise MalformedBody() from None
    declared = request.content_length
    if declared is not None and size < declared:
        # The client went away mid-body. Servers that mark their input as terminated
        # (gunicorn sets wsgi.input_terminated) hand over the short body without an
        # error, so the view would act on part of a request.
        log.info("idempotency: request body shorter than its Content-Length")
        raise MalformedBody()
    if json:
        digest.update(canonical_body(request.mimetype, b"".join(held)))
    request.environ[FINGERPRINT_ENVIRON_KEY] = digest.finish(request.mimetype)


def _spool(
    request: Request, stream: IO[bytes], feed: Callable[[bytes], object], bound: int | None
) -> int:
    """Feed the body to ``feed`` as it arrives, keep a copy for the view; its size.
    Over ``bound`` bytes (a JSON body, held whole) it is refused with ``413``."""
    chunks = _chunks(stream, request.content_length)
    first = next(chunks, b"")
    if not first:
        # Empty, or read before the view (a before_request that called get_data() or
        # get_json(), which Werkzeug cached; one that parsed form leaves nothing, as
        # without us).
        body = request.get_data(cache=True)
        feed(body)
        return len(body)
    spool: IO[bytes]
    declared = request.content_length
    if declared is not None and declared <= SPOOL_IN_MEMORY:
        spool = io.BytesIO()  # (what the spooled file would hold anyway, for less work)
    else:
        spool = tempfile.SpooledTemporaryFile(max_size=SPOOL_IN_MEMORY)
        # Closed with the request, however it ends (a streamed response still reading
        # it keeps the request alive); a temporary file left to the collector warns.
        weakref.finalize(request, spool.close)
    size = 0
    for chunk in itertools.chain((first,), chunks):
        size += len(chunk)
        if bound is not None and size > bound:
            raise RequestEntityTooLarge()  # chunked, so only known now
        feed(chunk)
        spool.write(chunk)
    spool.seek(0)
    # Documented by Werkzeug: setting ``stream`` sets the cached value. get_data(),
    # get_json() and form then read it as they would have read the client's.
    request.stream = spool
    return size


def _chunks(stream: IO[bytes], declared: int | None) -> Iterator[bytes]:
    """The body in chunks, up to its declared length: a read past it would raise
    ``413`` from Werkzeug's stream when that length is exactly ``MAX_CONTENT_LENGTH``.
    A chunked body is read to its end (a read past ``MAX_CONTENT_LENGTH`` is 413)."""
    remaining = declared
    while remaining is None or remaining > 0:
        chunk = stream.read(CHUNK_SIZE if remaining is None else min(CHUNK_SIZE, remaining))
        if not chunk:
            return  # the end, or a client gone: a short body is refused by its caller
        if remaining is not None:
            remaining -= len(chunk)
        yield chunk


def whole_body(request: Request) -> bytes:
    """The whole body as bytes, for code that must keep it (a route's recovery
    record), leaving ``request.stream`` readable from its start for the view."""
    body = request.get_data(cache=True)
    request.stream = io.BytesIO(body)
    return body
