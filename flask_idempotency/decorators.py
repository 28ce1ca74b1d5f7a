"""``@idempotency.required`` and ``@idempotency.optional``, bare or with options.

A decorator needs no app: the app's state is resolved when the view is called
(``runtime.run_view``), the way Flask-Limiter's decorators work.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ParamSpec, TypedDict, TypeVar, overload

from flask import Response
from flask.typing import ResponseReturnValue

from . import recovery
from .route_options import RecoverFunc, RecoveryDataFunc, route_options
from .runtime import run_view
from .settings import FingerprintFunc, ScopeFunc, ShouldStore

P = ParamSpec("P")
R = TypeVar("R", bound=ResponseReturnValue)
View = Callable[P, R]

if TYPE_CHECKING:
    from typing_extensions import Unpack

    class RouteKeywords(TypedDict, total=False):
        """A route's options (``route_options``), each ``None`` for the app's setting."""

        ttl: float | timedelta | None
        lease: float | timedelta | None
        wait: float | timedelta | None
        should_store: ShouldStore | None
        scope_func: ScopeFunc | None
        fingerprint_func: FingerprintFunc | None
        oversize: str | None
        recover: RecoverFunc | None
        recovery_data: RecoveryDataFunc | None


class RouteDecorator:
    """The decorator behind ``required`` and ``optional``, usable bare or with
    per-route options. It needs no app: state is resolved when the view is called."""

    def __init__(self, required: bool) -> None:
        self._required = required

    @overload
    def __call__(self, view: View[P, R], /) -> View[P, R | Response]: ...

    @overload
    def __call__(
        self, **options: Unpack[RouteKeywords]
    ) -> Callable[[View[P, R]], View[P, R | Response]]: ...

    def __call__(self, view: Any = None, **keywords: Unpack[RouteKeywords]) -> Any:
        """``recover=f`` (row mode): how ``flask idempotency recover`` finishes an
        attempt whose holder died; ``recovery_data=g``: JSON it needs beyond the
        request, kept with the claim. See ``recovery.py``."""
        options = route_options(self._required, **keywords)

        def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
            # Flask's ensure_sync asks this on every call; a view's kind never changes.
            is_async = inspect.iscoroutinefunction(fn)

            @functools.wraps(fn)
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                return run_view(options, fn, is_async, args, kwargs)

            # How the recover command finds the route (decorators above copy it).
            setattr(wrapper, recovery.ROUTE_ATTRIBUTE, options)
            return wrapper

        return decorator(view) if view is not None else decorator
