"""The doctor's checks of PostgreSQL: reachable, migrated, and set up for leases.

Every query goes through the store (its pool, its connection parameters, its
``SET LOCAL`` timeouts and deadline), so the doctor sees the server the app
sees, PgBouncer included. The session settings are read as ``reset_val``:
what a new session of this role in this database starts with, before any
``SET LOCAL`` of ours.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

from ...store.base import StoreUnavailableError
from ...store.diagnostics import (
    AUTOVACUUM,
    EXPIRED_RECORDS,
    SERVER_CLOCK,
    SERVER_SIDE,
    SESSION_TIMEOUTS,
)
from ...store.schema import FIX
from .base import Check, Context, fail, ok, ping, seconds, warn, worst
from .routes import leases

#: Dead rows over this share of the records table: autovacuum is behind its churn.
DEAD_SHARE = 0.2
#: ... and over this many rows (a small table's share means nothing).
DEAD_MIN = 10_000
#: A table this large under a scale factor above ``LARGE_SCALE_FACTOR`` waits for
#: that share of its rows to die before autovacuum comes: set a smaller one.
LARGE_TABLE = 1_000_000
LARGE_SCALE_FACTOR = 0.05
#: The records table, as the fixes name it.
RECORDS = "idempotency_records"
#: Clock skew above which the doctor warns (seconds); above half the shortest
#: lease it fails, since leases and TTLs are compared with the server's clock.
SKEW_WARN = 1.0
#: Expired records kept longer than this past their expiry mean that nobody runs
#: ``flask idempotency purge``: a day, the default TTL, leaves room for a daily job.
PURGE_LATE = 24 * 3600.0


def database(ctx: Context) -> Check:
    return ping(
        "PostgreSQL",
        lambda: ctx.store.ping(),
        reason=lambda exc: f": {exc} (the checks that need it are skipped)",
        fix="check IDEMPOTENCY_DATABASE_URL (or db's engine URL) and the server",
        errors=StoreUnavailableError,
    )


def schema(ctx: Context) -> Check:
    try:
        missing = ctx.store.pending_migrations(ctx.state.settings.migration_dirs)
    except FileNotFoundError as exc:
        return fail(str(exc), "fix IDEMPOTENCY_MIGRATION_DIRS")
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        # The fix is in the words of the ERROR that requests log (store/schema.py).
        return fail(f"{len(missing)} migration(s) not applied: {shown}", FIX)
    return ok("every migration is applied")


# -- PgBouncer ---------------------------------------------------------------------


def pgbouncer(ctx: Context) -> Check:
    """Whether the app talks to PostgreSQL through a pooler (PgBouncer), and in which
    mode. The extension prepares no statements and keeps no session state between
    transactions, so every pool mode works; this says what sits in between."""
    with ctx.store.pool.connection() as conn:
        client_port = int(getattr(conn.info, "port", 0) or 0)
    server_port, dbname, _, version = ctx.store.read(SERVER_SIDE)[0]
    if not client_port or client_port == server_port:
        return ok(f"connected straight to PostgreSQL {version} (port {server_port})")
    proxy = _ask_pgbouncer(ctx, dbname)
    where = f"port {client_port} forwards to PostgreSQL's port {server_port}"
    if proxy is None:
        return ok(f"{where}: a pooler or a port mapping (its mode unknown)")
    name, mode = proxy
    return ok(f"{name} in {mode or 'an unknown'} mode ({where})")


def _ask_pgbouncer(ctx: Context, dbname: str) -> tuple[str, str | None] | None:
    """``(version, pool mode)`` from PgBouncer's admin console on the app's host
    and port (``SHOW VERSION``, ``SHOW DATABASES``, ``SHOW CONFIG``); ``None`` when
    nothing there answers as PgBouncer (or the app's role may not ask)."""
    settings = ctx.state.settings
    if settings.database_url is None:
        return None
    import psycopg2

    try:
        conn = psycopg2.connect(
            settings.database_url, dbname="pgbouncer", connect_timeout=settings.connect_timeout
        )
        with contextlib.closing(conn), conn.cursor() as cur:
            conn.autocommit = True
            cur.execute("SHOW VERSION")
            version = str(cur.fetchone()[0])  # type: ignore[index]
            if "pgbouncer" not in version.lower():
                return None
            # The database's own pool mode, else PgBouncer's default one.
            mode = _column(cur, "SHOW DATABASES", "name", "pool_mode").get(dbname)
            mode = mode or _column(cur, "SHOW CONFIG", "key", "value").get("pool_mode")
            return version, None if mode is None else str(mode)
    except psycopg2.Error:  # no PgBouncer there, or the app's role may not ask it
        return None


def _column(cur: Any, sql: str, key: str, value: str) -> dict[Any, Any]:
    """``{key: value}`` over the rows ``sql`` answers, by column name; ``{}`` if it fails."""
    try:
        cur.execute(sql)
    except Exception:
        return {}
    names = [column.name for column in cur.description or ()]
    rows = [dict(zip(names, row, strict=True)) for row in cur.fetchall()]
    return {row.get(key): row.get(value) for row in rows}


# -- session timeouts --------------------------------------------------------------


def session_timeouts(ctx: Context) -> Check:
    """Server-side timeouts that end a request before its lease does.

    A view holds its transaction open while it waits on the processor, as long
    as its lease allows: ``idle_in_transaction_session_timeout`` shorter than
    that kills the session, and the attempt with it (fail). A
    ``statement_timeout`` shorter than the lease cancels a view's slow statement
    the lease would have covered (warn), and an ``idle_session_timeout`` shorter
    than the renewal interval closes the lease keeper's connection between two
    renewals (warn). The extension's own statements set theirs with ``SET LOCAL``.
    """
    lease_ms = max(leases(ctx)) * 1000
    renew_ms = ctx.state.settings.renew_interval * 1000
    found = {row[0]: (int(row[1]), row[2]) for row in ctx.store.read(SESSION_TIMEOUTS)}
    lease = f"the lease ({lease_ms / 1000:g} s)"
    #: (setting, its finding (fail or warn), too short below this many ms, what then, a value
    #: that fixes it)
    rules = (
        (
            "idle_in_transaction_session_timeout",
            fail,
            lease_ms,
            f"is shorter than {lease}: a view waiting on its processor inside its "
            "transaction is disconnected, its work lost",
            lease_ms * 2,
        ),
        (
            "statement_timeout",
            warn,
            lease_ms,
            f"is shorter than {lease}: a view's statement is cancelled before its lease ends",
            lease_ms,
        ),
        (
            "idle_session_timeout",
            warn,
            math.floor(renew_ms) + 1,  # whole ms: not longer than the interval
            f"is not longer than the renewal interval ({renew_ms / 1000:g} s): the lease "
            "keeper's connection is closed between renewals",
            renew_ms * 3,
        ),
    )
    findings = []
    for name, finding, below, consequence, fixed_at in rules:
        value, source = found.get(name, (0, None))
        if 0 < value < below:
            where = f" (set by {source})" if source else ""
            alter = (source or "ALTER ROLE <the app's role>").split(",")[0]
            findings.append(
                finding(
                    f"{name} {value / 1000:g} s{where} {consequence}",
                    f"{alter} SET {name} = '{fixed_at / 1000:g}s' (or RESET it)",
                )
            )
    values = ", ".join(
        f"{name} {seconds(found[name][0] / 1000) if found.get(name, (0,))[0] else 'off'}"
        for name in ("statement_timeout", "idle_in_transaction_session_timeout")
    )
    return worst(findings, ok(f"{values}: none ends a lease early"))


# -- autovacuum ----------------------------------------------------------------------


def autovacuum(ctx: Context) -> Check:
    """Every request inserts and updates a record and purge deletes them: the
    records table churns, and its dead rows must be vacuumed away as fast."""
    rows = ctx.store.read(AUTOVACUUM)
    if not rows:
        return warn("no idempotency_records table yet", "flask idempotency migrate")
    reloptions, live, dead, server_on, counts_on, scale, threshold, since = rows[0]
    options = dict(str(o).split("=", 1) for o in reloptions or ())
    scale = float(options.get("autovacuum_vacuum_scale_factor", scale))
    threshold = int(options.get("autovacuum_vacuum_threshold", threshold))
    never = "the dead rows every request and purge leave are never vacuumed (the table and its "
    never += "index bloat, claims slow down)"
    if options.get("autovacuum_enabled", "true").lower() in ("false", "off", "0"):
        return fail(
            f"autovacuum_enabled = false on idempotency_records: {never}",
            f"ALTER TABLE {RECORDS} RESET (autovacuum_enabled)",
        )
    if not (server_on and counts_on):
        return fail(
            f"autovacuum (or track_counts) is off on the server: {never}",
            "autovacuum = on and track_counts = on in postgresql.conf",
        )
    figures = f"{live} live, {dead} dead row(s)"
    last = f", last vacuumed {since:.0f} s ago" if since is not None else ""
    if dead > DEAD_MIN and dead > DEAD_SHARE * (live + dead):
        return warn(
            f"{figures}{last}: autovacuum is behind the table's churn (trigger: "
            f"{threshold} + {scale:g} x live rows)",
            f"ALTER TABLE {RECORDS} SET (autovacuum_vacuum_scale_factor = 0.01, "
            "autovacuum_vacuum_threshold = 1000); look for long transactions holding back vacuum",
        )
    if live > LARGE_TABLE and scale > LARGE_SCALE_FACTOR:
        return warn(
            f"{figures}: with autovacuum_vacuum_scale_factor {scale:g}, "
            f"{int(live * scale)} rows die before autovacuum comes",
            f"ALTER TABLE {RECORDS} SET (autovacuum_vacuum_scale_factor = 0.01)",
        )
    return ok(f"{figures}{last}; vacuumed after {threshold} + {scale:g} x live rows")


# -- purge -------------------------------------------------------------------------


def purge(ctx: Context) -> Check:
    """Expired records are treated as absent but kept, stored answers and all
    (headers and bodies, in plain text), until ``flask idempotency purge``
    deletes them: nothing else does, so it must be scheduled."""
    count, oldest = ctx.store.read(EXPIRED_RECORDS)[0]
    if not count:
        return ok("no expired record waits for purge (keep it scheduled)")
    if oldest > PURGE_LATE:
        return warn(
            f"{count} expired record(s) still hold stored answers, the oldest expired "
            f"{oldest / 3600:.0f} h ago: nothing deletes them but purge",
            "schedule `flask idempotency purge` (cron, a Kubernetes CronJob), hourly or daily",
        )
    return ok(
        f"{count} expired record(s) await purge, the oldest expired {seconds(oldest)} ago "
        "(keep `flask idempotency purge` scheduled)"
    )


# -- clocks ----------------------------------------------------------------------------


def clock(ctx: Context) -> Check:
    """This machine's clock against PostgreSQL's, halfway through one round trip.

    Leases and TTLs are decided by the server's clock alone, but an app whose
    clock is off reads ages and ``Retry-After`` wrong, and logs that cannot be
    lined up with the server's; past half a lease it is a broken host."""
    now = ctx.options.clock
    before = now()
    server = float(ctx.store.read(SERVER_CLOCK)[0][0])
    after = now()
    skew, rtt = server - (before + after) / 2, after - before
    where = "behind" if skew > 0 else "ahead of"
    figures = f"this machine is {abs(skew):.3f} s {where} PostgreSQL (± {rtt / 2:.3f} s)"
    ntp = "run NTP (chrony, systemd-timesyncd) on the app's hosts and the database's"
    limit = min(leases(ctx)) / 2
    if abs(skew) - rtt / 2 > limit:
        return fail(f"{figures}: more than half the shortest lease ({limit:g} s)", ntp)
    if abs(skew) - rtt / 2 > SKEW_WARN:
        return warn(figures, ntp)
    return ok(figures)
