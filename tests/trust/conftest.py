"""Fixtures of the trust-boundary tests: the app of ``trust_app.py`` on a clean database."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from flask import Flask

from . import trust_app

MakeTrustApp = Callable[..., Flask]


@pytest.fixture
def make_trust_app(clean_db: str) -> Iterator[MakeTrustApp]:
    """Factory: ``make_trust_app(**config)`` -> the trust app, closed at teardown."""
    apps: list[Flask] = []

    def make(**config: Any) -> Flask:
        app = trust_app.create_app(clean_db, config)
        apps.append(app)
        return app

    yield make
    for app in apps:
        app.extensions["idempotency"].close()
