"""The doctor's checks of what the routes declare: their leases and their scopes.

The routes are found the way ``flask idempotency recover`` finds them: each
view of the app's ``url_map`` that carries the decorator's options.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

from flask.sessions import SecureCookieSessionInterface

from ...errors import ScopeUnavailable
from ...keys import resolve_scope
from ...recovery import route_options_of
from ...route_options import RouteOptions, check_against_settings
from ...scopes import authorization_scope, default_scope, global_scope
from ...store.sql import CLIENT_DEADLINE_GRACE
from .base import Check, Context, fail, ok, seconds, warn, worst


@dataclasses.dataclass(frozen=True)
class Route:
    #: ``POST /pay``: how the messages name it.
    label: str
    path: str
    method: str
    options: RouteOptions


def idempotent_routes(ctx: Context) -> list[Route]:
    def find() -> Iterator[Route]:
        for rule in ctx.app.url_map.iter_rules():
            options = route_options_of(ctx.app.view_functions.get(rule.endpoint))
            if options is None:
                continue
            methods = sorted((rule.methods or set()) - {"HEAD", "OPTIONS"}) or ["GET"]
            path = rule.rule if not rule.arguments else "/"
            yield Route(f"{'|'.join(methods)} {rule.rule}", path, methods[0], options)

    return ctx.once("routes", lambda: list(find()))


def leases(ctx: Context) -> list[float]:
    """The leases requests run with: the app's, and each route's own."""
    settings = ctx.state.settings
    return [settings.lease, *(r.options.effective(settings).lease for r in idempotent_routes(ctx))]


def lease(ctx: Context) -> Check:
    """renewal interval < lease <= TTL, app-wide and per route; a renewal that takes
    its whole deadline still lands inside the lease; the processor's timeout fits."""
    settings = ctx.state.settings
    renew = settings.renew_interval
    deadline = settings.statement_timeout + CLIENT_DEADLINE_GRACE
    processor = ctx.options.processor_timeout
    findings: list[Check] = []
    scopes: list[tuple[str, float, float]] = [("the app", settings.lease, settings.ttl)]
    for route in idempotent_routes(ctx):
        try:
            effective = check_against_settings(route.options, settings)
        except ValueError as exc:
            findings.append(fail(f"{route.label}: {exc}", "fix the route's lease= / ttl="))
            continue
        scopes.append((route.label, effective.lease, effective.ttl))

    def findings_at(where: str, lease_s: float, ttl: float) -> Iterator[Check]:
        if renew > 0 and renew + deadline >= lease_s:
            yield warn(
                f"{where}: lease {seconds(lease_s)} but a renewal may start "
                f"{seconds(renew)} after the last and take {seconds(deadline)} (statement "
                "timeout + 1 s): on a slow database the lease lapses between renewals",
                "raise the lease, or lower IDEMPOTENCY_LEASE_RENEW_INTERVAL",
            )
        if processor is not None and renew == 0 and lease_s <= processor:
            yield fail(
                f"{where}: lease {seconds(lease_s)} is not renewed and a view may wait "
                f"{seconds(processor)} on the processor: a retry takes the record over "
                "while the first attempt still runs (the processor is called twice)",
                f"raise the lease above {seconds(processor)}, or turn renewal back on",
            )
        if processor is not None and ttl <= processor:
            yield fail(
                f"{where}: TTL {seconds(ttl)} is not longer than the processor timeout "
                f"{seconds(processor)}: purge may delete a record whose view still runs",
                f"raise the TTL well above {seconds(processor)}",
            )

    findings += [finding for scope in scopes for finding in findings_at(*scope)]
    renewal = f"renewed every {seconds(renew)}" if renew > 0 else "never renewed"
    shortest, longest = min(s[1] for s in scopes), max(s[1] for s in scopes)
    spread = seconds(shortest) + (f" to {seconds(longest)}" if longest != shortest else "")
    processor_note = f", processor timeout {seconds(processor)}" if processor is not None else ""
    detail = f"lease {spread} ({renewal}) < TTL over the app and {len(scopes) - 1} route(s)"
    return worst(findings, ok(detail + processor_note))


def scope(ctx: Context) -> Check:
    """Does a request that carries no credentials get a scope of its own?

    The doctor asks each route's scope function about a request with no
    ``Authorization`` header and no cookie, built from the route's URL (no
    ``before_request`` hook runs). ``None`` (or ``ScopeUnavailable``) is right:
    such a request is refused, ``400 missing_scope``. A scope means every caller
    without credentials shares one set of records, and one is replayed another's
    answer: chosen explicitly with ``global_scope`` (one-principal apps) that is
    a warning, from any other function it is a failure.
    """
    settings = ctx.state.settings
    pooled_global: list[str] = []
    pooled: list[str] = []
    unknown, on_authorization = [], []
    routes = idempotent_routes(ctx)
    # No decorated route yet (blueprints registered later?): judge the app's setting.
    candidates = routes or [Route("IDEMPOTENCY_SCOPE_FUNC", "/", "POST", _APP_WIDE)]
    for route in candidates:
        func = route.options.scope_func or settings.scope_func
        if func in (default_scope, authorization_scope):
            on_authorization.append(route.label)
        outcome = _anonymous_scope(ctx, route, func)
        if outcome is _UNKNOWN:
            unknown.append(route.label)
        elif outcome is not None:
            (pooled_global if func is global_scope else pooled).append(route.label)
    if pooled:
        return fail(
            f"a request without credentials gets a scope on {_some(pooled)}: callers "
            "who send none share one set of records and can be replayed each other's answers",
            "make the scope function return None when the request names no principal "
            "(docs: Scoping)",
        )
    if pooled_global:
        return warn(
            f"global_scope on {_some(pooled_global)}: every caller shares one scope, "
            "right only for an app with a single principal",
            "set IDEMPOTENCY_SCOPE_FUNC to one naming your principals (user_scope(...)) "
            "unless one client calls this app",
        )
    sessions = _browser_sessions(ctx.app)
    if on_authorization and sessions:
        return warn(
            f"the scope of {_some(on_authorization)} rests on the Authorization header in an "
            f"app with {sessions}: behind a gateway or proxy that sends one shared "
            "credential, every user is in one scope and can be replayed another's answer",
            "set IDEMPOTENCY_SCOPE_FUNC to a scope function naming the user, e.g. "
            "user_scope(lambda: session.get('user_id')) (docs: Security)",
        )
    detail = (
        f"requests without credentials are refused (400 missing_scope) on {len(routes)} route(s)"
    )
    if unknown:
        detail += f"; {len(unknown)} scope function(s) need more than headers to tell"
    return ok(detail)


def _browser_sessions(app: Any) -> str | None:
    """What says that users reach the app with a session rather than their own
    credentials: flask-login, or a session interface of its own (Flask-Session's
    server-side sessions); ``None`` otherwise. Flask's own signed-cookie session
    is there in every app and a ``SECRET_KEY`` is set for the cache's keys too, so
    neither tells that users log in through it."""
    if getattr(app, "login_manager", None) is not None:
        return "flask-login"
    if type(app.session_interface) is not SecureCookieSessionInterface:
        return f"server-side sessions ({type(app.session_interface).__name__})"
    return None


_UNKNOWN: Any = object()
_APP_WIDE = RouteOptions(required=True)


def _anonymous_scope(ctx: Context, route: Route, func: Any) -> Any:
    with ctx.app.test_request_context(route.path, method=route.method):
        from flask import request

        try:
            return resolve_scope(func, request)
        except ScopeUnavailable:
            return None
        except Exception:  # the function needs what only a real request has
            return _UNKNOWN


def _some(labels: list[str]) -> str:
    return ", ".join(labels[:3]) + (f" and {len(labels) - 3} more" if len(labels) > 3 else "")
