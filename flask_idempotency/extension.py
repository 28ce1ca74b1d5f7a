"""The Flask layer: ``Idempotency``, what an application calls.

``init_app`` reads the settings once, puts the extension's state on the app
(``state.py`` owns it) and registers the request hooks (``runtime.py``) and
the ``flask idempotency`` commands, which are imported only when a command
runs. The decorators are ``decorators.py``'s.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar, cast

import click
from flask import Flask
from flask.cli import AppGroup, FlaskGroup

from . import digests, phases, runtime
from .cache import cache_from_settings
from .decorators import RouteDecorator
from .engine import current_attempt
from .errors import StoreUnavailable, from_store_error
from .events import outbox
from .lease import LeaseKeeper
from .metrics import Metrics
from .profiles import PROFILES
from .settings import settings_from_config
from .state import AppState, app_state, find_app_state, install
from .store.base import StoreUnavailableError
from .store.errors import is_unreachable
from .store.memory import MemoryStore, is_memory_url
from .store.postgres import PostgresStore

if TYPE_CHECKING:
    from .events.consumer import ConsumerGuard
    from .events.messages import Handler, KeyFunc

log = logging.getLogger("flask_idempotency")

T = TypeVar("T")


class CommandsOnDemand(AppGroup):
    """``flask idempotency``: the commands (the ``cli`` package) load when one runs, so an
    application that serves requests never imports them or what they use."""

    def __init__(self) -> None:
        super().__init__("idempotency", help="Maintain the idempotency records.")

    @staticmethod
    def _commands() -> click.Group:
        return cast(click.Group, importlib.import_module("flask_idempotency.cli").group)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return self._commands().list_commands(ctx)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        return self._commands().get_command(ctx, cmd_name)

    def format_help(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        self._commands().format_help(ctx, formatter)  # its help text and examples

    def invoke(self, ctx: click.Context) -> Any:
        """A PostgreSQL that does not answer ends any command in one line (exit 1)
        instead of a traceback; a command adds what it did before, if anything."""
        try:
            return super().invoke(ctx)
        except StoreUnavailableError as exc:
            raise click.ClickException(str(exc)) from exc


class Idempotency:
    """Idempotency-Key support for a Flask app, with PostgreSQL as the source of truth."""

    def __init__(
        self,
        app: Flask | None = None,
        db: Any = None,
        *,
        engine: Any = None,
        session: Any = None,
    ) -> None:
        if app is not None:
            self.init_app(app, db, engine=engine, session=session)

    def init_app(
        self,
        app: Flask,
        db: Any = None,
        *,
        engine: Any = None,
        session: Any = None,
    ) -> None:
        """Read the ``IDEMPOTENCY_*`` settings (``settings.py`` lists them), open the
        store's pool and the cache, and register the request hooks and the
        ``flask idempotency`` commands.

        ``db``: a ``flask_sqlalchemy.SQLAlchemy`` (initialised on ``app`` first). The
        records then live in its engine's database, requests use its engine's
        connections (no ``IDEMPOTENCY_DATABASE_URL``), and inside a claimed request
        ``db.session`` works on the request's transaction: the view's writes commit
        with its stored answer or not at all. Without Flask-SQLAlchemy, give the
        same as ``engine=`` (a SQLAlchemy ``Engine``) and ``session=`` (your
        ``scoped_session``).
        """
        if find_app_state(app) is not None:
            raise RuntimeError("flask_idempotency is already initialised on this app")
        joins = db is not None or engine is not None or session is not None
        max_overflow: int | None = None
        if joins:
            from . import sqlalchemy_session  # SQLAlchemy is imported only by its users

            engine, session, max_overflow = sqlalchemy_session.from_app(app, db, engine, session)
        elif "sqlalchemy" in app.extensions:
            log.warning(
                "idempotency: this app uses Flask-SQLAlchemy, but the extension was not "
                "given it: writes through db.session in a decorated view do not commit "
                "with the stored answer. Use Idempotency(app, db=db)."
            )
        settings = settings_from_config(
            app.config.get_namespace("IDEMPOTENCY_"), engine_given=joins
        )
        store: PostgresStore | MemoryStore
        sessions = None
        if is_memory_url(settings.database_url):
            store = MemoryStore()
        else:
            store = PostgresStore.from_settings(settings, engine, max_overflow=max_overflow)
            if session is not None:
                sessions = sqlalchemy_session.SessionJoin(session, store.pool)
        state = AppState(
            settings=settings,
            store=store,
            cache=cache_from_settings(settings, app.config, store),
            keeper=LeaseKeeper(store, settings.renew_interval),
            metrics=Metrics(),
            profile=PROFILES[settings.profile],
            sessions=sessions,
        )
        install(app, state)
        app.after_request(runtime.after_request)
        app.teardown_request(runtime.teardown_request)
        app.cli.add_command(CommandsOnDemand())
        if settings.auto_migrate:
            state.migrations_pending = True
            try:
                state.migrate_if_pending()
            except StoreUnavailableError as exc:
                if exc.__cause__ is None or not is_unreachable(exc.__cause__):
                    raise  # a migration that fails on a live database must stop the start
                # Under gunicorn a worker that raises here makes the master halt every
                # worker: a database outage while one worker restarts would take the
                # whole API down for good. Start anyway; requests answer 503 until the
                # database is back, and the first one that reaches it migrates.
                state.migration_deferred = True
                log.error(
                    "idempotency: PostgreSQL unreachable at start (%s); migrating once it answers",
                    exc,
                )
        if _loaded_by_a_flask_command():
            # The ``flask`` command loads the app to find one of its commands
            # (``flask idempotency migrate``, ``flask db upgrade``): those are how the
            # schema gets made, and an ERROR before them would name the very command
            # being run. ``flask run`` and ``flask shell`` load it from their own command.
            return
        if not settings.auto_migrate:
            # Name a forgotten ``migrate`` at start-up, where the database answers (one
            # small query; ``schema.py`` logs the problem). Where it does not, the first
            # request that reaches it reads the ledger instead.
            try:
                store.schema.check()
            except StoreUnavailableError as exc:
                log.warning("idempotency: schema not checked at start, PostgreSQL failed (%s)", exc)
        state.cache.prepare()

    # -- decorators ---------------------------------------------------------

    #: ``@idempotency.required`` or ``@idempotency.required(ttl=...)``: require an
    #: Idempotency-Key (400 ``missing_key`` without one).
    required = RouteDecorator(required=True)
    #: ``@idempotency.optional``: deduplicate when the client sends a key, run
    #: normally when it does not.
    optional = RouteDecorator(required=False)

    # -- what views and applications use -------------------------------------

    def connection(self) -> Any:
        """The psycopg2 connection of the current idempotent request, inside the
        transaction that will also store the response: write your business rows
        here and they commit together with the idempotency record, or not at all.

        Do not commit or roll back yourself; the extension does, after the view.
        On an ``optional`` route called without a key there is no record, and the
        transaction is settled by the same rule: committed when the answer is one
        that would have been stored, rolled back otherwise (or if the view raised).
        """
        attempt = current_attempt()
        if attempt is None or (attempt.record_key is not None and attempt.token is None):
            raise RuntimeError("idempotency.connection() needs a running idempotent request")
        try:
            return attempt.connection()
        except StoreUnavailableError as exc:
            raise StoreUnavailable(retry_after=attempt.app_state.settings.retry_after) from exc

    @contextmanager
    def transaction(self) -> Iterator[Any]:
        """A pooled connection in a transaction for routes outside idempotency;
        committed on success, rolled back on an exception; 503 if unreachable."""
        state = app_state()
        try:
            state.migrate_if_pending()
            with state.store.transaction() as conn, outbox.bind(conn, state.settings.ttl):
                yield conn  # emit() in the block writes on this transaction
        except StoreUnavailableError as exc:
            raise StoreUnavailable(retry_after=state.settings.retry_after) from exc

    def emit(self, event_type: str, payload: Any, *, ttl: float | timedelta | None = None) -> str:
        """Write an event to the outbox in the current transaction; return its id.

        Inside ``transaction()``, on that transaction; inside an idempotent request
        or a consumer's handler, on ``connection()``, so the event commits with the
        stored answer or not at all (released, rolled back, fenced: no event; a
        replay runs no view and emits nothing). On an ``optional`` route without a
        key it joins the keyless transaction, under a random id. ``payload`` must
        be JSON; a published event is kept ``ttl`` seconds (default: the record's
        TTL). ``flask idempotency relay`` publishes it (``events/outbox.py``).
        """
        bound = outbox.bound_transaction.get()
        if bound is not None:
            conn, scope = bound
        else:
            conn = self.connection()  # RuntimeError outside an idempotent request
            attempt = current_attempt()
            assert attempt is not None
            scope = outbox.request_scope(attempt.record_key, attempt.token, attempt.route.ttl)
        return scope.emit(conn, event_type, payload, ttl)

    def consumer(
        self,
        name: str,
        *,
        key: KeyFunc | None = None,
        max_attempts: int = 5,
        lease: float | timedelta | None = None,
        ttl: float | timedelta | None = None,
        retry_delay: float | timedelta = 1.0,
        max_retry_delay: float | timedelta = 60.0,
        busy_delay: float | timedelta = 1.0,
    ) -> Callable[[Handler], ConsumerGuard]:
        """``@idempotency.consumer("receipts")``: run a message handler once in effect
        per message (keyed by message id, or ``key(delivery)``), with the HTTP
        route's claim, lease and fencing; dead-letter after ``max_attempts``.
        See ``events/consumer.py``."""
        from .events import consumer as events_consumer  # the events layer, on first use
        from .events.messages import consumer_options

        options = consumer_options(
            name,
            key=key,
            max_attempts=max_attempts,
            lease=lease,
            ttl=ttl,
            retry_delay=retry_delay,
            max_retry_delay=max_retry_delay,
            busy_delay=busy_delay,
            # A message that kills its consumer every time raises nothing: its
            # attempts show only as takeovers, and count against the same limit.
            max_worker_losses=max_attempts,
        )
        return functools.partial(events_consumer.ConsumerGuard, options=options)

    def derived_key(self, purpose: str) -> str:
        """A key for a downstream call, derived from this request's record (scope
        and client key): a retry after a crash sends the same key again."""
        attempt = current_attempt()
        if attempt is None or attempt.record_key is None:
            raise RuntimeError("derived_key() needs a running idempotent request with a key")
        return digests.derived_key(attempt.record_key, purpose)

    def phase(self, name: str, step: Callable[[], T]) -> Any:
        """Run ``step`` as the recovery point ``name`` and return what it recorded.

        ``step`` does one external call and writes what came of it on
        ``connection()``; its return value (JSON) is committed with those writes
        and the record's progress, fenced by the lock token. When a takeover (a
        retry after the holder died, or ``flask idempotency recover``) reaches a
        phase an earlier attempt committed, ``step`` does not run again: its
        recorded value is returned. See ``phases.py``.
        """
        return phases.run(current_attempt(), name, step)

    def metrics(self) -> dict[str, int]:
        """This process's counters (see ``metrics.NAMES``) for the current app."""
        return app_state().metrics.snapshot()

    def ping(self) -> None:
        """Check that PostgreSQL answers, under the extension's own timeouts, and has
        the extension's schema: for a health check. Raises
        :class:`~flask_idempotency.StoreUnavailable` (a 503 with ``Retry-After`` if
        it reaches Flask) when it does not answer, and
        :class:`~flask_idempotency.SchemaMissing` (``500 schema_missing``, or its
        subclass ``SchemaOutdated``, no ``Retry-After``) when ``flask idempotency
        migrate`` is still to run: a deployment step to take, not an outage to
        wait out."""
        state = app_state()
        try:
            state.store.ping()
            state.store.schema.ensure()
        except StoreUnavailableError as exc:
            raise from_store_error(exc, state.settings.retry_after) from exc


def _loaded_by_a_flask_command() -> bool:
    """Whether the ``flask`` command is loading the app to find one of its commands
    (``flask idempotency migrate``...), not to serve it."""
    ctx = click.get_current_context(silent=True)
    return ctx is not None and isinstance(ctx.command, FlaskGroup)
