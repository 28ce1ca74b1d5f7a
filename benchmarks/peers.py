"""Other idempotency layers from the package index, wired into the benchmark's app.

Each peer gets the business work of ``bare`` (parse the JSON body, BEGIN /
INSERT / COMMIT on a connection from the same small pool, answer 201 with a
small JSON body) and is added to it the way its own documentation shows:

``idemkit-pg`` (idemkit 1.0.2, ``PostgresBackend``)
    ``WSGIIdempotencyMiddleware`` around ``app.wsgi_app``, as idemkit's README
    shows for Flask, with ``PostgresBackend.from_url`` (asyncpg) on the
    benchmark's database. Its core is async: the middleware runs each backend
    call on one background event loop per process and waits for it. A first
    request is the claim (``INSERT ... ON CONFLICT DO NOTHING``, autocommit),
    the view's own transaction, then the completion in a transaction of its
    own (``UPDATE`` and ``pg_notify``). Concurrent duplicates wait for the
    first and replay it (``LISTEN``). It wraps the whole app, so the no-op
    route pays its pass-through too (idemkit decides that a ``GET`` is not its
    business on the event loop).
``flask-once-redis`` (flask-once 0.0.2)
    ``flask_once.attach(app, cache)`` and ``@idempotent()`` on the view, as its
    README shows. Its cache is "a dict interface": here a small adapter over
    Redis (``RedisDict``; one ``GET`` per request, one ``SET`` per answer, JSON).
    No in-flight claim: concurrent duplicates all run the view, and the
    after-request hook rewrites the cache entry on every answer, replays
    included. It reads ``Idempotent-Key`` rather than ``Idempotency-Key``; a
    one-line WSGI shim copies the benchmark's header across.
``powertools-redis`` (aws-lambda-powertools 3.x, ``CachePersistenceLayer``)
    ``@idempotent_function`` around the business function, called from a
    Flask view, with the Redis persistence layer given a ``redis.Redis``
    client (``decode_responses=True``, as its docs' example). The function's
    payload is the header's key and the body's fields; the key alone is hashed
    into the record's name (``event_key_jmespath``). First request: ``SET NX``
    (in progress), the function, ``SET`` (completed); a replay: ``SET NX``
    fails, then ``GET``. In progress answers 409 through a Flask error
    handler. No check that a replay's body matches: with
    ``payload_validation_jmespath`` every replay answered 422, because this
    layer's completion ``SET`` (``_update_record``) drops the stored payload
    hash that the in-progress record had. Outside Lambda it warns on every
    claim that it cannot tell the remaining time; that warning is filtered.

The peers are benchmark-only dependencies (``benchmarks/requirements-peers.txt``)
and are imported here by name at run time, so neither the library nor its tests
need them installed.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Iterable
from importlib import import_module
from typing import TYPE_CHECKING, Any

import redis
from flask import Flask, Response, jsonify, request

from .charge import (
    CHARGES_PATH,
    POOL_SIZE,
    REDIS_PREFIX,
    BarePool,
    application_name,
    created,
    insert_charge,
    read_charge,
)

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIApplication, WSGIEnvironment

#: Seconds a stored response is kept, where a peer lets us say (a day).
TTL = 86_400


def register(subject: str, app: Flask, dsn: str, redis_url: str) -> None:
    """Add ``subject``'s ``POST /charges`` (and whatever the peer wraps) to ``app``."""
    wire: dict[str, Callable[[Flask, str, str], None]] = {
        "idemkit-pg": _idemkit,
        "flask-once-redis": _flask_once,
        "powertools-redis": _powertools,
    }
    wire[subject](app, dsn, redis_url)


def _problem(status: int, detail: str) -> Response:
    return Response(json.dumps({"detail": detail}), status=status, mimetype="application/json")


# -- idemkit -------------------------------------------------------------------


async def idemkit_init_pg(dsn: str) -> None:
    """Create idemkit's table, as ``idemkit init-pg <url>`` does (idempotent)."""
    postgres: Any = import_module("idemkit.backends.postgres")
    await postgres.init_pg(dsn)


def _idemkit(app: Flask, dsn: str, redis_url: str) -> None:
    subject = "idemkit-pg"
    idemkit: Any = import_module("idemkit")
    backend = idemkit.PostgresBackend.from_url(
        dsn,
        max_size=POOL_SIZE,  # as the other subjects' pools (idemkit's default: 20)
        server_settings={"application_name": application_name(subject)},
    )
    # One principal, as the extension's global_scope: the load sends no credentials.
    config = idemkit.HttpConfig(scope=lambda _request: "global", require_key_for_mutations=True)
    app.wsgi_app = idemkit.WSGIIdempotencyMiddleware(  # type: ignore[method-assign]
        app.wsgi_app, backend=backend, config=config
    )
    pool = BarePool(dsn, label=application_name(subject))

    @app.post(CHARGES_PATH)
    def idemkit_charge() -> Response:
        amount, currency = read_charge()
        return created(insert_charge(pool, amount, currency), amount, currency)


# -- flask-once ----------------------------------------------------------------


class RedisDict:
    """The "same interface as a python dict" with a TTL that flask-once asks of
    its cache, on Redis: ``get`` and item assignment, the two it uses."""

    def __init__(self, client: redis.Redis[bytes], prefix: str, ttl: int) -> None:
        self._client = client
        self._prefix = prefix
        self._ttl = ttl

    def get(self, key: str, default: Any = None) -> Any:
        raw = self._client.get(self._prefix + key)
        if raw is None:
            return default
        entry = json.loads(raw)
        # flask-once stores bytes (the response and request bodies).
        entry["response"] = entry["response"].encode("latin-1")
        entry["request"] = entry["request"].encode("latin-1")
        return entry

    def __setitem__(self, key: str, value: dict[str, Any]) -> None:
        entry = {
            **value,
            "response": value["response"].decode("latin-1"),
            "request": value["request"].decode("latin-1"),
        }
        self._client.set(self._prefix + key, json.dumps(entry), ex=self._ttl)


def _flask_once(app: Flask, dsn: str, redis_url: str) -> None:
    subject = "flask-once-redis"
    flask_once: Any = import_module("flask_once")
    client: redis.Redis[bytes] = redis.Redis.from_url(redis_url)
    app.cache = RedisDict(client, f"{REDIS_PREFIX}:flask-once:", TTL)  # type: ignore[attr-defined]
    flask_once.attach(app, app.cache)  # type: ignore[attr-defined]
    pool = BarePool(dsn, label=application_name(subject))

    @app.post(CHARGES_PATH)
    @flask_once.idempotent()  # type: ignore[untyped-decorator]
    def flask_once_charge() -> Response:
        amount, currency = read_charge()
        return created(insert_charge(pool, amount, currency), amount, currency)

    app.wsgi_app = _copy_header(  # type: ignore[method-assign,assignment]
        app.wsgi_app, "HTTP_IDEMPOTENCY_KEY", "HTTP_IDEMPOTENT_KEY"
    )


def _copy_header(wsgi_app: WSGIApplication, source: str, target: str) -> WSGIApplication:
    """The benchmark sends ``Idempotency-Key``; flask-once reads ``Idempotent-Key``."""

    def copying(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        if source in environ:
            environ[target] = environ[source]
        return wsgi_app(environ, start_response)

    return copying


# -- Powertools for AWS Lambda ---------------------------------------------------


def _powertools(app: Flask, dsn: str, redis_url: str) -> None:
    subject = "powertools-redis"
    idempotency: Any = import_module("aws_lambda_powertools.utilities.idempotency")
    cache: Any = import_module("aws_lambda_powertools.utilities.idempotency.persistence.cache")
    errors: Any = import_module("aws_lambda_powertools.utilities.idempotency.exceptions")
    client: redis.Redis[str] = redis.Redis.from_url(redis_url, decode_responses=True)
    with warnings.catch_warnings():
        # CachePersistenceLayer is the documented name, an alias of a class
        # marked deprecated (for its old name): instantiating it warns.
        warnings.simplefilter("ignore", DeprecationWarning)
        persistence = cache.CachePersistenceLayer(client=client)
    config = idempotency.IdempotencyConfig(
        event_key_jmespath="key", raise_on_no_idempotency_key=True, expires_after_seconds=TTL
    )
    # Without a Lambda context every claim warns that the time left is unknown.
    warnings.filterwarnings(
        "ignore", message="Couldn't determine the remaining time left", category=UserWarning
    )
    pool = BarePool(dsn, label=application_name(subject))

    @idempotency.idempotent_function(  # type: ignore[untyped-decorator]
        data_keyword_argument="charge",
        persistence_store=persistence,
        config=config,
        key_prefix=f"{REDIS_PREFIX}:powertools",
    )
    def create_charge(charge: dict[str, Any]) -> dict[str, Any]:
        amount, currency = charge["amount"], charge["currency"]
        row_id = insert_charge(pool, amount, currency)
        return {"id": row_id, "amount": amount, "currency": currency, "status": "succeeded"}

    @app.post(CHARGES_PATH)
    def powertools_charge() -> Response:
        key = request.headers.get("Idempotency-Key")
        if not key:
            return _problem(400, "Idempotency-Key is required")
        amount, currency = read_charge()
        result = create_charge(charge={"key": key, "amount": amount, "currency": currency})
        response = jsonify(result)
        response.status_code = 201
        return response

    @app.errorhandler(errors.IdempotencyAlreadyInProgressError)
    def in_progress(_error: Exception) -> Response:
        return _problem(409, "a request with this key is in progress")
