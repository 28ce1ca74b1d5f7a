"""The one owner of the extension's per-app state.

Flask's extension guide keeps an extension's per-app state in
``app.extensions[name]`` and its per-request state in ``g._name``. This module
is the only place that spells the first: everything else (the request runtime,
the completer, the consumer guard, the CLI, the observers) asks it through
:func:`app_state`. The per-request state is the attempt (``engine.py``).

It imports nothing of the package at run time beyond the route options, so
any layer can use it without an import circle; the parts it holds are typed
for the reader only.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import TYPE_CHECKING, Any, Protocol

from flask import Flask, current_app, has_app_context

from .profiles import STRIPE, Profile
from .route_options import EffectiveOptions, RouteOptions, check_against_settings

if TYPE_CHECKING:
    from .cache.base import ResponseCache
    from .lease import LeaseKeeper
    from .metrics import Metrics
    from .settings import Settings
    from .store.memory import MemoryStore
    from .store.postgres import PostgresStore

log = logging.getLogger("flask_idempotency")


class JoinedSession(Protocol):
    """The application's session while it works on an attempt's transaction
    (``sqlalchemy_session.Joined``; named here, below both, so the attempt and the
    session module need not import each other)."""

    def keep(self) -> None: ...
    def discard(self) -> None: ...
    def leave(self) -> None: ...


class SessionJoiner(Protocol):
    """What joins the application's session to attempts (``sqlalchemy_session.SessionJoin``)."""

    def detach(self) -> None: ...
    def join(self, handle: Any) -> JoinedSession: ...


#: ``app.extensions`` key of the extension's :class:`AppState`.
EXTENSION_KEY = "idempotency"


@dataclasses.dataclass
class AppState:
    """Everything one app's extension owns; lives in ``app.extensions["idempotency"]``."""

    settings: Settings
    #: PostgreSQL, or with ``IDEMPOTENCY_DATABASE_URL = "memory://"`` this process's memory.
    store: PostgresStore | MemoryStore
    cache: ResponseCache
    keeper: LeaseKeeper
    metrics: Metrics
    #: The error format and replay headers (``IDEMPOTENCY_PROFILE``).
    profile: Profile
    #: Joins the application's SQLAlchemy session to claimed attempts (``db=``).
    sessions: SessionJoiner | None = None
    #: ``IDEMPOTENCY_AUTO_MIGRATE`` found PostgreSQL unreachable at start-up: the
    #: migrations run before the first request that reaches it instead.
    migrations_pending: bool = False
    #: The start-up migration failed for an outage and was put off (for the log).
    migration_deferred: bool = False
    _migrate_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    #: Each route's options over the app's settings, checked on its first request.
    _routes: dict[RouteOptions, EffectiveOptions] = dataclasses.field(default_factory=dict)

    def migrate_if_pending(self) -> None:
        """Apply the pending migrations once; raises ``StoreUnavailableError`` while
        PostgreSQL is still unreachable (the caller answers 503)."""
        if not self.migrations_pending:
            return
        with self._migrate_lock:
            if self.migrations_pending:
                self.store.migrate(self.settings.migration_dirs)
                self.migrations_pending = False
                if self.migration_deferred:
                    log.warning("idempotency: PostgreSQL is back; migrations applied")

    def postgres_store(self, what: str) -> PostgresStore:
        """The PostgreSQL store, for ``what`` only PostgreSQL does (recovery, table
        statistics); ``RuntimeError`` under ``memory://``."""
        from .store.memory import MemoryStore  # (light: no driver)

        if isinstance(self.store, MemoryStore):
            raise RuntimeError(f"{what} needs PostgreSQL; IDEMPOTENCY_DATABASE_URL is memory://")
        return self.store

    def options_for(self, options: RouteOptions) -> EffectiveOptions:
        """A route's effective options; ``ValueError`` on its first request if they
        break renewal interval < lease <= TTL together with the app's settings."""
        effective = self._routes.get(options)
        if effective is None:
            effective = self._routes[options] = check_against_settings(options, self.settings)
        return effective

    def close(self) -> None:
        """Stop the keeper and close the pool and cache (tests, app shutdown)."""
        self.keeper.stop()
        self.cache.close()
        self.store.close()


def app_state(app: Flask | None = None) -> AppState:
    """The extension's state on ``app`` (the current app when not given)."""
    state = find_app_state(app if app is not None else current_app)
    if state is None:
        raise RuntimeError("flask_idempotency is not initialised on this app")
    return state


def find_app_state(app: Flask | None = None) -> AppState | None:
    """The state on ``app`` (or the current app, if there is one), else ``None``."""
    if app is None and not has_app_context():
        return None
    extensions = (app if app is not None else current_app).extensions
    state: AppState | None = extensions.get(EXTENSION_KEY)
    return state


def current_profile() -> Profile:
    """The current app's profile (how its errors render); the default outside an
    app, or before ``init_app``."""
    state = find_app_state()
    return state.profile if state is not None else STRIPE


def current_retry_after() -> int:
    """The current app's ``IDEMPOTENCY_RETRY_AFTER``; 1 outside an app."""
    state = find_app_state()
    return state.settings.retry_after if state is not None else 1


def install(app: Flask, state: AppState) -> None:
    """Put ``state`` on ``app`` (``init_app`` refused a second one on its first line)."""
    app.extensions[EXTENSION_KEY] = state
