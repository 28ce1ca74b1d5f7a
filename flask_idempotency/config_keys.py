"""How the extension's settings are spelled in an app's config: the option groups
(``IDEMPOTENCY_DATABASE_OPTIONS``...), and the keys of the unpublished 0.2 line
that are refused with what to write instead. What the settings mean, their
defaults and their checks are ``settings.py``'s."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: Options that belong together are set as one mapping each, as Flask-Limiter's
#: ``STORAGE_URI`` goes with ``STORAGE_OPTIONS``: the database's
#: (``IDEMPOTENCY_DATABASE_OPTIONS``, beside ``IDEMPOTENCY_DATABASE_URL``), the Redis
#: cache's (``IDEMPOTENCY_REDIS_OPTIONS``) and the broker's
#: (``IDEMPOTENCY_BROKER_OPTIONS``). Group -> option -> the :class:`Settings` field:
#: the option's own name, or with the prefix its group gives it.
_DATABASE = ("pool_size", "pool_timeout", "connect_timeout", "statement_timeout", "lock_timeout")
_BREAKER = ("breaker_threshold", "breaker_cooldown")
OPTION_GROUPS: dict[str, dict[str, str]] = {
    "database_options": {option: option for option in (*_DATABASE, "async_claim_commit")}
    | {option: f"store_{option}" for option in _BREAKER},
    "redis_options": {
        option: f"redis_{option}" for option in ("prefix", "timeout", *_BREAKER, "fill")
    },
    "broker_options": {"exchange": "events_exchange"},
}
#: Field -> (group, option) of every grouped field. ``connect_kwargs`` is the
#: database group's other options (libpq parameters).
GROUPED: dict[str, tuple[str, str | None]] = {
    field: (group, option)
    for group, options in OPTION_GROUPS.items()
    for option, field in options.items()
}
GROUPED["connect_kwargs"] = ("database_options", None)


#: Keys of the 0.2 line that are gone, and what to do instead; any other unknown key
#: is a typo and is refused as one.
REMOVED_KEYS: dict[str, str] = {
    "wait_poll_interval": "a waiting duplicate checks every 50 ms; set IDEMPOTENCY_WAIT",
    "problem_type_base": "problem types are urn:flask-idempotency:error:<code>",
    "redis_compress_over": "bodies over 4 kB are compressed",
    "pool": "pass engine= (a SQLAlchemy Engine; its pool is the one pool) to Idempotency",
    "prepare_statements": "the extension prepares no statements",
}
#: Options of a group that are gone, as ``(group, option)`` -> what to do instead.
REMOVED_OPTIONS: dict[tuple[str, str], str] = {
    ("redis_options", "compress_over"): "bodies over 4 kB are compressed",
    ("database_options", "prepare_statements"): "the extension prepares no statements",
}


def config_key(name: str) -> str:
    """How a field is spelled in the app's config (for messages and the docs)."""
    group, option = GROUPED.get(name, (None, None))
    if group is None:
        return f"IDEMPOTENCY_{name.upper()}"
    if option is None:
        return f"IDEMPOTENCY_{group.upper()}"
    return f'IDEMPOTENCY_{group.upper()}["{option}"]'


def ungroup(config: Mapping[str, Any]) -> dict[str, Any]:
    """The config namespace with each option group spread into its fields.

    A grouped option set as a flat key (``IDEMPOTENCY_POOL_SIZE``, the spelling of
    the unpublished 0.2 line) fails here with its new spelling: ignoring it would
    silently run with the default, and a warning is easy to miss in a deploy log.
    """
    flat: dict[str, Any] = {}
    for raw_name, value in config.items():
        group = raw_name.lower()
        if group in GROUPED:
            raise ValueError(f"IDEMPOTENCY_{raw_name.upper()} was removed: use {config_key(group)}")
        if group in REMOVED_KEYS:
            raise ValueError(f"IDEMPOTENCY_{raw_name.upper()} was removed: {REMOVED_KEYS[group]}")
        if group not in OPTION_GROUPS:
            flat[group] = value  # a setting's own key
            continue
        if value is None:
            continue
        if not isinstance(value, Mapping):
            raise ValueError(f"IDEMPOTENCY_{group.upper()} must be a mapping, got {value!r}")
        for option, option_value in value.items():
            field = OPTION_GROUPS[group].get(str(option))
            gone = REMOVED_OPTIONS.get((group, str(option)))
            if gone is not None:
                raise ValueError(f"IDEMPOTENCY_{group.upper()}[{option!r}] was removed: {gone}")
            if field is not None:
                flat[field] = option_value
            elif group == "database_options":  # a libpq connection parameter
                flat.setdefault("connect_kwargs", {})[str(option)] = option_value
            else:
                raise ValueError(
                    f"Unknown option {option!r} in IDEMPOTENCY_{group.upper()} "
                    f"(known: {', '.join(sorted(OPTION_GROUPS[group]))})"
                )
    return flat
