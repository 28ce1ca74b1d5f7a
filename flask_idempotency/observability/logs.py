"""The per-request log event now lives in ``flask_idempotency.request_log``."""

from ..request_log import LEVELS, TAKEOVER_LEVEL, log, log_event

__all__ = ["LEVELS", "TAKEOVER_LEVEL", "log", "log_event"]
