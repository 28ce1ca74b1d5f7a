"""Configuration from the environment (CONTRACT §2), checked once at start-up.

A typo in a number, or a lease no longer than the processor timeout, stops the
start with a ``ValueError`` naming the variable, rather than surfacing on the
first charge (or, worse, as a takeover of a request still waiting on the processor).
"""

from __future__ import annotations

import math
import os
import secrets
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any

from example_app.processor_client import DEFAULT_TIMEOUT_SECONDS

#: The app's own migrations (the charges table), applied after the extension's schema.
MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"

#: Long enough to cover one processor call (10 s) with room for the database work;
#: the extension renews it while the worker lives, so only a dead worker lets it lapse.
DEFAULT_LEASE_SECONDS = 30.0
#: Stripe keeps idempotency keys for 24 hours; clients retry within that window.
DEFAULT_TTL_SECONDS = 86400.0
#: A charge body is a few hundred bytes; a megabyte leaves room and caps abuse.
DEFAULT_MAX_CONTENT_LENGTH = 1024 * 1024


def config_from_env(environ: Mapping[str, str]) -> dict[str, Any]:
    """Flask config keys from the process environment; unset variables get defaults."""
    config: dict[str, Any] = {
        "DATABASE_URL": _text(environ, "DATABASE_URL"),
        "REDIS_URL": _text(environ, "REDIS_URL"),
        "PROCESSOR_URL": _text(environ, "PROCESSOR_URL"),
        "PROCESSOR_TIMEOUT_SECONDS": _seconds(
            environ, "PROCESSOR_TIMEOUT_SECONDS", DEFAULT_TIMEOUT_SECONDS
        ),
        "IDEMPOTENCY_LEASE": _seconds(environ, "IDEMPOTENCY_LEASE_SECONDS", DEFAULT_LEASE_SECONDS),
        "IDEMPOTENCY_TTL": _seconds(environ, "IDEMPOTENCY_TTL_SECONDS", DEFAULT_TTL_SECONDS),
        "MAX_CONTENT_LENGTH": _positive_int(
            environ, "MAX_CONTENT_LENGTH", DEFAULT_MAX_CONTENT_LENGTH
        ),
        # ``stripe`` (default) or ``ietf``; the extension refuses anything else at start.
        "IDEMPOTENCY_PROFILE": _text(environ, "IDEMPOTENCY_PROFILE") or "stripe",
        # ``row`` (default) or ``transaction``: the README's "Claim modes".
        "IDEMPOTENCY_CLAIM_MODE": _text(environ, "IDEMPOTENCY_CLAIM_MODE") or "row",
        # The warehouse and mailer of POST /v1/orders; unset: an in-process fake.
        "FULFILMENT_URL": _text(environ, "FULFILMENT_URL"),
        # Seconds a charge lingers between the processor's answer and its commit, and
        # an order after each phase, so crash drills can land a SIGKILL there. 0
        # anywhere real.
        "CRASH_DRILL_DELAY_SECONDS": _seconds_or_zero(environ, "CRASH_DRILL_DELAY_SECONDS"),
    }
    # Connections per worker: at least gunicorn's --threads (gunicorn.conf.py warns
    # when fewer). Unset, the extension's own default applies.
    if environ.get("IDEMPOTENCY_POOL_SIZE", "").strip():
        config["IDEMPOTENCY_DATABASE_OPTIONS"] = {
            "pool_size": _positive_int(environ, "IDEMPOTENCY_POOL_SIZE", default=0)
        }
    return config


def apply_defaults(config: MutableMapping[str, Any], scope_func: Any) -> None:
    """Fill in the extension's keys from the app's own, unless a caller set them."""
    config.setdefault("IDEMPOTENCY_SCOPE_FUNC", scope_func)
    config.setdefault("IDEMPOTENCY_MIGRATION_DIRS", (str(MIGRATIONS_DIR),))
    config.setdefault("IDEMPOTENCY_AUTO_MIGRATE", True)
    if config.get("IDEMPOTENCY_REDIS_URL") is None and config.get("IDEMPOTENCY_REDIS") is None:
        config["IDEMPOTENCY_REDIS_URL"] = config.get("REDIS_URL") or None
    if config.get("IDEMPOTENCY_DATABASE_URL") is None:
        config["IDEMPOTENCY_DATABASE_URL"] = config.get("DATABASE_URL") or None


def secret_key(environ: Mapping[str, str], instance_path: str) -> str:
    """``SECRET_KEY`` from the environment, else one generated once into the instance
    folder and read by every worker: the extension signs its Redis entries with a
    key derived from it, so all workers must share it (CONTRACT §2 and §7)."""
    given = _text(environ, "SECRET_KEY")
    if given:
        return given
    path = Path(instance_path) / "secret_key"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        draft = path.with_name(f".secret_key.{os.getpid()}")
        draft.write_text(secrets.token_hex(32))
        draft.chmod(0o600)
        try:
            os.link(draft, path)  # atomic, and refused if a worker starting beside us won
        except FileExistsError:
            pass
        finally:
            draft.unlink()
    return path.read_text().strip()


def check_timeouts(config: Mapping[str, Any]) -> float:
    """Return the processor timeout, refusing a lease that does not outlast it.

    If the lease could end while a worker still waits on the processor, a retry
    would take the record over and call the processor concurrently.
    """
    timeout = _as_seconds("PROCESSOR_TIMEOUT_SECONDS", config.get("PROCESSOR_TIMEOUT_SECONDS"))
    lease = _as_seconds(
        "IDEMPOTENCY_LEASE_SECONDS", config.get("IDEMPOTENCY_LEASE", DEFAULT_LEASE_SECONDS)
    )
    if lease <= timeout:
        raise ValueError(
            f"IDEMPOTENCY_LEASE_SECONDS ({lease:g}) must be greater than "
            f"PROCESSOR_TIMEOUT_SECONDS ({timeout:g}): a record must never be taken over "
            "while its request is still waiting on the processor"
        )
    return timeout


def _text(environ: Mapping[str, str], name: str) -> str | None:
    value = environ.get(name, "").strip()
    return value or None


def _seconds(environ: Mapping[str, str], name: str, default: float) -> float:
    raw = environ.get(name, "").strip()
    return _as_seconds(name, raw) if raw else default


def _seconds_or_zero(environ: Mapping[str, str], name: str) -> float:
    raw = environ.get(name, "").strip()
    return 0.0 if raw in ("", "0") else _as_seconds(name, raw)


def _as_seconds(name: str, value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a number of seconds, not {value!r}")
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number of seconds, not {value!r}") from None
    if not seconds > 0 or math.isinf(seconds):
        raise ValueError(f"{name} must be a positive number of seconds, not {value!r}")
    return seconds


def _positive_int(environ: Mapping[str, str], name: str, default: int) -> int:
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name} must be a whole number, not {raw!r}") from None
    if value < 1:
        raise ValueError(f"{name} must be at least 1, not {raw!r}")
    return value
