"""The doctor's checks of the background workers: the relay and the completer.

Each run of either reports itself in ``idempotency_heartbeats``
(``store/heartbeat.py``). One that has stopped is only worth a warning where
it is needed: the relay where events are used (a broker is configured, or the
outbox holds events), the completer where a route declares ``recover=``.
"""

from __future__ import annotations

from ...events import outbox
from ...recovery import recoverable_routes
from .base import Check, Context, ok, warn


def _seen(ctx: Context, worker: str, needed_because: str, command: str) -> Check:
    stale_after = ctx.options.stale_after
    # (age in seconds, host) of each worker's last run, read once for both checks
    last = ctx.once("last runs", ctx.store.last_runs).get(worker)
    if last is None:
        return warn(f"never seen, and {needed_because}", f"run `{command}` (a service, or cron)")
    age, seen_on = last
    where = f" on {seen_on}" if seen_on else ""
    if age > stale_after:
        return warn(
            f"last seen {age:.0f} s ago{where} (over {stale_after:g} s), and {needed_because}",
            f"check that `{command}` still runs",
        )
    return ok(f"last seen {age:.0f} s ago{where}")


def relay(ctx: Context) -> Check:
    counts = outbox.counts(ctx.store)
    pending = int(counts["pending"])
    if not ctx.state.settings.broker_url and not pending and not counts["published"]:
        return ok("no events in the outbox and no broker: not needed")
    reason = (
        f"{pending} event(s) wait in the outbox (oldest {counts['oldest_pending_seconds']:.0f} s)"
        if pending
        else "events are published through it"
    )
    return _seen(ctx, "relay", reason, "flask idempotency relay")


def completer(ctx: Context) -> Check:
    routes = recoverable_routes(ctx.app)
    if not routes or ctx.state.settings.claim_mode != "row":
        return ok("no route declares recover=: not needed")
    return _seen(
        ctx,
        "completer",
        f"{len(routes)} route(s) declare recover=",
        "flask idempotency recover",
    )
