"""Grouped settings: IDEMPOTENCY_DATABASE_OPTIONS, _REDIS_OPTIONS, _BROKER_OPTIONS.

Connection options go with their URL, as Flask-Limiter's STORAGE_OPTIONS with
STORAGE_URI; the flat keys of the unpublished 0.2 line fail at init_app with a
message that names the new spelling.
"""

from __future__ import annotations

import re
import warnings
from typing import Any

import pytest
from flask import Flask

from flask_idempotency import Idempotency
from flask_idempotency.config_keys import GROUPED
from flask_idempotency.settings import settings_from_config

BASE = {"DATABASE_URL": "postgresql://localhost/x"}


def test_each_group_sets_its_fields() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the grouped spelling warns about nothing
        settings = settings_from_config(
            {
                **BASE,
                "DATABASE_OPTIONS": {
                    "pool_size": "20",
                    "statement_timeout": 1.5,
                    "async_claim_commit": "false",
                    "sslmode": "require",
                    "application_name": "payments",
                },
                "REDIS_OPTIONS": {"prefix": "pay", "timeout": 0.1, "fill": "completion"},
                "BROKER_OPTIONS": {"exchange": "payments.events"},
            }
        )
    assert (settings.pool_size, settings.statement_timeout) == (20, 1.5)
    assert settings.async_claim_commit is False
    # Any other database option is a libpq connection parameter.
    assert dict(settings.connect_kwargs) == {"sslmode": "require", "application_name": "payments"}
    assert (settings.redis_prefix, settings.redis_timeout, settings.redis_fill) == (
        "pay",
        0.1,
        "completion",
    )
    assert settings.events_exchange == "payments.events"


#: Every removed flat key, and the spelling its message must name.
REMOVED_FLAT_KEYS = {
    "POOL_SIZE": 'IDEMPOTENCY_DATABASE_OPTIONS["pool_size"]',
    "POOL_TIMEOUT": 'IDEMPOTENCY_DATABASE_OPTIONS["pool_timeout"]',
    "CONNECT_TIMEOUT": 'IDEMPOTENCY_DATABASE_OPTIONS["connect_timeout"]',
    "STATEMENT_TIMEOUT": 'IDEMPOTENCY_DATABASE_OPTIONS["statement_timeout"]',
    "LOCK_TIMEOUT": 'IDEMPOTENCY_DATABASE_OPTIONS["lock_timeout"]',
    "ASYNC_CLAIM_COMMIT": 'IDEMPOTENCY_DATABASE_OPTIONS["async_claim_commit"]',
    "STORE_BREAKER_THRESHOLD": 'IDEMPOTENCY_DATABASE_OPTIONS["breaker_threshold"]',
    "STORE_BREAKER_COOLDOWN": 'IDEMPOTENCY_DATABASE_OPTIONS["breaker_cooldown"]',
    "CONNECT_KWARGS": "IDEMPOTENCY_DATABASE_OPTIONS",
    "REDIS_PREFIX": 'IDEMPOTENCY_REDIS_OPTIONS["prefix"]',
    "REDIS_TIMEOUT": 'IDEMPOTENCY_REDIS_OPTIONS["timeout"]',
    "REDIS_BREAKER_THRESHOLD": 'IDEMPOTENCY_REDIS_OPTIONS["breaker_threshold"]',
    "REDIS_BREAKER_COOLDOWN": 'IDEMPOTENCY_REDIS_OPTIONS["breaker_cooldown"]',
    "REDIS_FILL": 'IDEMPOTENCY_REDIS_OPTIONS["fill"]',
    "EVENTS_EXCHANGE": 'IDEMPOTENCY_BROKER_OPTIONS["exchange"]',
}


@pytest.mark.parametrize(("flat", "grouped"), sorted(REMOVED_FLAT_KEYS.items()))
def test_a_removed_flat_key_fails_at_init_app_naming_its_new_spelling(
    flat: str, grouped: str
) -> None:
    """Not a warning nor a silent default: the app does not start, and the message
    says what to write instead (``IDEMPOTENCY_POOL_SIZE was removed: use ...``)."""
    app = Flask(__name__)
    app.config.update(IDEMPOTENCY_DATABASE_URL="memory://", **{f"IDEMPOTENCY_{flat}": 1})
    with pytest.raises(ValueError) as refused:
        Idempotency(app)
    assert str(refused.value) == f"IDEMPOTENCY_{flat} was removed: use {grouped}"
    assert "idempotency" not in app.extensions  # nothing was set up


def test_mistakes_in_a_group_are_refused_with_its_key() -> None:
    with pytest.raises(ValueError, match=r"Unknown option 'fil' in IDEMPOTENCY_REDIS_OPTIONS"):
        settings_from_config({**BASE, "REDIS_OPTIONS": {"fil": "replay"}})
    with pytest.raises(ValueError, match=r"IDEMPOTENCY_BROKER_OPTIONS must be a mapping"):
        settings_from_config({**BASE, "BROKER_OPTIONS": "payments.events"})
    with pytest.raises(ValueError, match=r'IDEMPOTENCY_DATABASE_OPTIONS\["pool_size"\] must be'):
        settings_from_config({**BASE, "DATABASE_OPTIONS": {"pool_size": "many"}})
    with pytest.raises(ValueError, match="IDEMPOTENCY_POOL_SIZE was removed"):
        settings_from_config({**BASE, "POOL_SIZE": 5, "DATABASE_OPTIONS": {"pool_size": 6}})


def test_every_grouped_field_has_its_removed_flat_key_pinned() -> None:
    """A grouped option added later is refused as a flat key too; this list names it."""
    assert {name.upper() for name in GROUPED} == set(REMOVED_FLAT_KEYS)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"WAIT_POLL_INTERVAL": 0.01}, "IDEMPOTENCY_WAIT_POLL_INTERVAL was removed: a waiting"),
        ({"PROBLEM_TYPE_BASE": "https://x/"}, "IDEMPOTENCY_PROBLEM_TYPE_BASE was removed: problem"),
        ({"REDIS_COMPRESS_OVER": 1}, "IDEMPOTENCY_REDIS_COMPRESS_OVER was removed: bodies over"),
        (
            {"REDIS_OPTIONS": {"compress_over": 1}},
            "IDEMPOTENCY_REDIS_OPTIONS['compress_over'] was removed: bodies over",
        ),
    ],
)
def test_a_removed_setting_fails_saying_what_replaced_it(
    config: dict[str, object], message: str
) -> None:
    """Settings folded into fixed values: refused with what now holds, not as a typo."""
    with pytest.raises(ValueError, match=re.escape(message)):
        settings_from_config({**BASE, **config})


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"POOL": object()}, "engine="),
        ({"DATABASE_OPTIONS": {"prepare_statements": False}}, "prepares no statements"),
    ],
)
def test_what_the_single_pool_replaced_fails_naming_what_to_do(
    config: dict[str, Any], named: str
) -> None:
    with pytest.raises(ValueError, match="was removed") as raised:
        settings_from_config({**BASE, **config})
    assert named in str(raised.value)
