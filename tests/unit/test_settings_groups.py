"""Grouped settings: IDEMPOTENCY_DATABASE_OPTIONS, _REDIS_OPTIONS, _BROKER_OPTIONS.

Connection options go with their URL, as Flask-Limiter's STORAGE_OPTIONS with
STORAGE_URI; the flat keys they replace still work for a release, with a
DeprecationWarning that names the new spelling.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest

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


@pytest.mark.parametrize(
    ("flat", "value", "grouped"),
    [
        ("POOL_SIZE", 20, 'IDEMPOTENCY_DATABASE_OPTIONS["pool_size"]'),
        ("REDIS_FILL", "completion", 'IDEMPOTENCY_REDIS_OPTIONS["fill"]'),
        ("EVENTS_EXCHANGE", "x", 'IDEMPOTENCY_BROKER_OPTIONS["exchange"]'),
        ("CONNECT_KWARGS", {"sslmode": "require"}, "IDEMPOTENCY_DATABASE_OPTIONS"),
    ],
)
def test_the_old_flat_keys_still_work_and_name_the_new_spelling(
    flat: str, value: object, grouped: str
) -> None:
    with pytest.warns(DeprecationWarning, match=rf"IDEMPOTENCY_{flat} is deprecated: use "):
        settings = settings_from_config({**BASE, flat: value})
    field = {"POOL_SIZE": "pool_size", "REDIS_FILL": "redis_fill"}.get(flat)
    if field is not None:
        assert getattr(settings, field) == value
    with pytest.warns(DeprecationWarning) as caught:
        settings_from_config({**BASE, flat: value})
    assert grouped in str(caught[0].message)


def test_mistakes_in_a_group_are_refused_with_its_key() -> None:
    with pytest.raises(ValueError, match=r"Unknown option 'fil' in IDEMPOTENCY_REDIS_OPTIONS"):
        settings_from_config({**BASE, "REDIS_OPTIONS": {"fil": "replay"}})
    with pytest.raises(ValueError, match=r"IDEMPOTENCY_BROKER_OPTIONS must be a mapping"):
        settings_from_config({**BASE, "BROKER_OPTIONS": "payments.events"})
    with pytest.raises(ValueError, match=r'IDEMPOTENCY_DATABASE_OPTIONS\["pool_size"\] must be'):
        settings_from_config({**BASE, "DATABASE_OPTIONS": {"pool_size": "many"}})
    with pytest.raises(ValueError, match="also set by its deprecated flat key"):
        with pytest.warns(DeprecationWarning):
            settings_from_config({**BASE, "POOL_SIZE": 5, "DATABASE_OPTIONS": {"pool_size": 6}})


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"POOL": object()}, "engine="),
        ({"DATABASE_OPTIONS": {"prepare_statements": False}}, "no longer prepares"),
    ],
)
def test_a_setting_removed_in_0_3_fails_naming_what_to_do(
    config: dict[str, Any], named: str
) -> None:
    with pytest.raises(ValueError, match="removed in 0.3.0") as raised:
        settings_from_config({**BASE, **config})
    assert named in str(raised.value)
