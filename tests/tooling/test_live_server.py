"""``serve_app``: the app on a real threaded server for the length of a block."""

from __future__ import annotations

import threading
import urllib.request

import pytest
from flask import Flask

from flask_idempotency.testing import serve_app


def test_serve_app_answers_concurrently_inside_the_block_only() -> None:
    app = Flask("served")
    both_in = threading.Barrier(2)

    @app.get("/")
    def index() -> str:
        both_in.wait(5)  # two requests in the view at once, or neither answers
        return "served"

    server = serve_app(app)
    with pytest.raises(RuntimeError, match="not running"):
        server.url  # noqa: B018 - not started before the block
    with server:
        url = server.url
        assert url.startswith("http://127.0.0.1:")
        answers: list[bytes] = []
        threads = [
            threading.Thread(target=lambda: answers.append(urllib.request.urlopen(url).read()))
            for _ in range(2)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        assert answers == [b"served", b"served"]
    assert repr(server) == "<LiveServer served stopped>"
    with pytest.raises(OSError):
        urllib.request.urlopen(url, timeout=2)
