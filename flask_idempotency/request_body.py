"""Reading the request body before it is fingerprinted: a client's framing is a 4xx.

The fingerprint needs the whole body. A body the server cannot deliver (broken
chunked framing, a client gone mid-body) raises from the WSGI server's own
parser, which Flask would turn into a 500, or arrives silently cut short of
its Content-Length; and a chunked body over
``MAX_CONTENT_LENGTH`` is cut at the limit by Werkzeug without an error, which
would fingerprint (and let the view act on) only its first part.
"""

from __future__ import annotations

import logging

from flask import Request
from werkzeug.exceptions import RequestEntityTooLarge

from .errors import MalformedBody

log = logging.getLogger("flask_idempotency.requests")


def read_body(request: Request) -> bytes:
    """The whole body (cached on the request for the view), or a 4xx."""
    try:
        data = request.get_data(cache=True)
    except RequestEntityTooLarge:
        raise  # a declared length over the limit: the app's 413
    except Exception as exc:  # the server's parser refused the framing, or a disconnect
        log.info("idempotency: unreadable request body (%s)", type(exc).__name__)
        raise MalformedBody() from None
    declared = request.content_length
    if declared is not None and len(data) < declared:
        # The client went away mid-body. Servers that mark their input as terminated
        # (gunicorn sets wsgi.input_terminated) hand over the short body without an
        # error, so the view would act on part of a request.
        log.info("idempotency: request body shorter than its Content-Length")
        raise MalformedBody()
    if declared is None:  # chunked: Werkzeug cut it at the limit without saying so
        limit = request.max_content_length
        if limit is not None and len(data) >= limit:
            raise RequestEntityTooLarge()
    return data
