"""Serve a Flask app on a real, threaded HTTP server inside the test process.

The Flask test client runs one request at a time in the calling thread, so it
can never show what concurrent duplicates do. :func:`serve_app` puts the app
behind werkzeug's threaded WSGI server on a free loopback port instead: every
request gets a thread of its own, as under gunicorn's ``gthread`` workers,
without starting another process.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flask import Flask
    from werkzeug.serving import BaseWSGIServer


#: Loopback only: a test server is nobody else's business.
_HOST = "127.0.0.1"


class LiveServer:
    """A Flask app served over HTTP on ``127.0.0.1`` from a thread of this process.

    ``url`` is ``http://127.0.0.1:PORT`` on a free port (no trailing slash). Use it
    as a context manager, or call ``start()`` and ``stop()``.
    """

    def __init__(self, app: Flask) -> None:
        self.app = app
        self._server: BaseWSGIServer | None = None

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("the live server is not running")
        return int(self._server.server_port)

    @property
    def url(self) -> str:
        return f"http://{_HOST}:{self.port}"

    def start(self) -> LiveServer:
        if self._server is not None:
            return self
        from werkzeug.serving import WSGIRequestHandler, make_server

        class QuietHandler(WSGIRequestHandler):
            """No access log line per request (a duplicate storm is dozens of them);
            errors are still logged."""

            def log_request(self, *args: Any, **kwargs: Any) -> None:
                pass

        self._server = make_server(_HOST, 0, self.app, threaded=True, request_handler=QuietHandler)
        threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name=f"flask-idempotency live server :{self.port}",
            daemon=True,
        ).start()
        return self

    def stop(self) -> None:
        """Stop accepting requests and close the listening socket. ``shutdown()``
        returns once the serving thread's ``serve_forever`` loop has ended."""
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        self._server = None

    def __enter__(self) -> LiveServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        where = self.url if self._server is not None else "stopped"
        return f"<LiveServer {self.app.name} {where}>"


def serve_app(app: Flask) -> LiveServer:
    """``with serve_app(app) as server:`` the app answers at ``server.url`` until the
    block ends (a :class:`~flask_idempotency.testing.live_server.LiveServer`, not
    started until the block begins)."""
    return LiveServer(app)
