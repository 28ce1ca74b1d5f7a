"""Fixtures of the documentation tests: a working directory, a port and servers.

PostgreSQL is the run's (``fresh_database_url``: a database of the test's own).
RabbitMQ comes from ``AMQP_URL``, as for tests/events: unset, the events page's
test skips, except under CI, where it fails.
"""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def amqp_url() -> str:
    url = os.environ.get("AMQP_URL")
    if not url:
        if os.environ.get("CI"):
            pytest.fail("AMQP_URL is unset under CI: the events page's snippets need RabbitMQ")
        pytest.skip("AMQP_URL is unset: no RabbitMQ for the events page's snippets")
    import kombu

    try:
        with kombu.Connection(url, connect_timeout=5) as conn:
            conn.connect()
    except Exception as exc:
        pytest.fail(f"AMQP_URL is set but unusable: {type(exc).__name__}: {exc}", pytrace=False)
    return url
