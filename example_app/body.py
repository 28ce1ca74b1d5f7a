"""Reading the request body once, before the extension fingerprints it.

The extension reads the body to fingerprint the request; a body the server cannot
deliver (a broken chunked encoding, a client gone mid-body) would then surface as
a 500 from inside it. Reading it here first turns every such failure into a 4xx,
and the extension and the view then use the cached bytes.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from flask import Request, request
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

from example_app.errors import invalid_request

log = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")


def read_body(req: Request) -> bytes:
    """The whole body, or a 4xx: a client's framing never becomes a 500."""
    try:
        data = req.get_data(cache=True)
    except HTTPException:
        raise  # 413 for a Content-Length over the limit, 400 for a client gone mid-body
    except Exception as exc:  # the server's parser refused the framing
        log.info("unreadable request body: %s", type(exc).__name__)
        raise invalid_request("malformed_body", "The request body could not be read.") from None
    limit = req.max_content_length
    if limit is not None and req.content_length is None and len(data) >= limit:
        # A streamed (chunked) body is cut at the limit without an error: refuse it
        # rather than act on its first megabyte.
        raise RequestEntityTooLarge()
    return data


def body_read_first(view: Callable[P, R]) -> Callable[P, R]:
    """Read the body before the decorators below (put it under the authentication)."""

    @functools.wraps(view)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        read_body(request)
        return view(*args, **kwargs)

    return wrapper
