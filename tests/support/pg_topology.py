"""PostgreSQL topologies for the deployment tests: read-only servers, multi-host DSNs,
a streaming standby and its promotion.

Everything here acts on throwaway servers the tests start themselves
(``ThrowawayPostgres``), never on the run's shared server: switching a server
read-only, promoting a standby or stopping a primary would break every other
test using it.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import psycopg2

from ._procs import log_tail, spawn, stop_process
from .postgres_install import server_env
from .postgres_server import ThrowawayPostgres

#: A primary that can feed a streaming standby. These are PostgreSQL 16's
#: defaults already; spelled out so that a server built with other defaults, or a
#: later change of BASE_SETTINGS, cannot quietly leave the standby nothing to stream.
PRIMARY_SETTINGS = {
    "wal_level": "replica",
    "max_wal_senders": "4",
    "max_replication_slots": "4",
}
#: The standby answers reads while it replays (and so reports itself read-only
#: to ``target_session_attrs``), and tells the primary promptly how far it got.
STANDBY_SETTINGS = {
    "hot_standby": "on",
    "wal_receiver_status_interval": "1s",
}


def multi_host_dsn(
    servers: Sequence[ThrowawayPostgres],
    dbname: str = "postgres",
    *,
    target_session_attrs: str = "read-write",
    connect_timeout: int = 2,
) -> str:
    """A libpq keyword DSN naming every server, as a deployment behind a failover
    names its primary and standbys: libpq tries them in order and keeps the first
    whose session matches ``target_session_attrs``."""
    hosts = ",".join(server.host for server in servers)
    ports = ",".join(str(server.port) for server in servers)
    return (
        f"host={hosts} port={ports} dbname={dbname} user=postgres "
        f"target_session_attrs={target_session_attrs} connect_timeout={connect_timeout}"
    )


def _autocommit(dsn: str) -> psycopg2.extensions.connection:
    conn = psycopg2.connect(dsn, connect_timeout=5)
    conn.autocommit = True  # ALTER SYSTEM cannot run in a transaction block
    return conn


def set_read_only(dsn: str, read_only: bool, *, timeout: float = 10.0) -> None:
    """Fence the server at ``dsn`` (``default_transaction_read_only = on``, ALTER SYSTEM
    and a reload) or lift the fence; returns once a new session sees the change.

    Sessions already open see it from their next statement on: a backend applies
    a reload before it runs the next command it reads.
    """
    conn = _autocommit(dsn)
    try:
        with conn.cursor() as cur:
            if read_only:
                cur.execute("ALTER SYSTEM SET default_transaction_read_only = on")
            else:
                cur.execute("ALTER SYSTEM RESET default_transaction_read_only")
            cur.execute("SELECT pg_reload_conf()")
    finally:
        conn.close()
    wanted = "on" if read_only else "off"
    deadline = time.monotonic() + timeout
    while session_read_only(dsn) != wanted:
        if time.monotonic() > deadline:
            raise TimeoutError(f"transaction_read_only never became {wanted} at {dsn}")
        time.sleep(0.05)


def session_read_only(dsn: str) -> str:
    """``SHOW transaction_read_only`` in a new session: ``on`` or ``off``."""
    conn = psycopg2.connect(dsn, connect_timeout=5)
    try:
        with conn.cursor() as cur:
            cur.execute("SHOW transaction_read_only")
            row = cur.fetchone()
            assert row is not None
            return str(row[0])
    finally:
        conn.close()


def backend_pids(dsn: str, application_name: str) -> set[int]:
    """Backends of sessions that named themselves ``application_name``."""
    conn = psycopg2.connect(dsn, connect_timeout=5)
    try:
        with conn.cursor() as cur:
            cur.execute(
                "SELECT pid FROM pg_stat_activity WHERE application_name = %s", (application_name,)
            )
            return {int(pid) for (pid,) in cur.fetchall()}
    finally:
        conn.close()


class StandbyPostgres(ThrowawayPostgres):
    """A hot standby of ``primary``, streaming from it: its data directory is a
    ``pg_basebackup -R`` of the primary (same binaries, a physical replication slot
    so the primary keeps every WAL segment the standby has not received yet).

    Start the primary first. Promotion (``promote()``) turns it into a primary of
    its own; it keeps its port, so a DSN naming it stays valid.
    """

    ready_states = ("ready", "standby")

    def __init__(
        self,
        primary: ThrowawayPostgres,
        *,
        slot: str = "standby",
        settings: dict[str, str] | None = None,
        startup_timeout: float = 60.0,
    ) -> None:
        super().__init__(
            settings=STANDBY_SETTINGS | (settings or {}),
            bindir=primary.bindir,
            startup_timeout=startup_timeout,
        )
        self.primary = primary
        self.slot = slot

    def _make_data_dir(self, bindir: Path, data: Path) -> None:
        # As ourselves (root in a container): _create_cluster then hands the files
        # to the server's account, as it does with a copy of the template.
        # --no-sync, as initdb for the template: only a crash of the machine
        # would lose what the page cache holds, and then the whole run is lost.
        log_path = data.parent / "basebackup.log"
        proc = spawn(
            [str(bindir / "pg_basebackup"), "-h", self.primary.host,
             "-p", str(self.primary.port), "-U", "postgres", "-D", str(data),
             "--write-recovery-conf", "--wal-method=stream", "--checkpoint=fast",
             "--create-slot", "--slot", self.slot, "--no-sync"],
            log_path=log_path, env=server_env(), cwd=data.parent,
        )  # fmt: skip
        try:
            returncode = proc.wait(timeout=max(60.0, self.startup_timeout))
        except subprocess.TimeoutExpired:
            stop_process(proc, [])
            returncode = -1
        if returncode != 0:
            raise RuntimeError(f"pg_basebackup failed ({returncode}):\n{log_tail(log_path)}")


def _one_value(dsn: str, query: str, params: Sequence[object] = ()) -> object:
    conn = _autocommit(dsn)
    try:
        with conn.cursor() as cur:
            cur.execute(query, params)
            row = cur.fetchone()
            return row[0] if row is not None else None
    finally:
        conn.close()


def replication_state(primary: ThrowawayPostgres) -> tuple[str, str] | None:
    """(state, sync_state) of the primary's one walsender, as pg_stat_replication
    shows it ("streaming", "async"), or None while no standby is connected."""
    conn = _autocommit(primary.dsn)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT state, sync_state FROM pg_stat_replication ORDER BY pid LIMIT 1")
            row = cur.fetchone()
            return (str(row[0]), str(row[1])) if row is not None else None
    finally:
        conn.close()


def wait_streaming(
    primary: ThrowawayPostgres, *, sync: bool = False, timeout: float = 60.0
) -> None:
    """Return once the primary streams to its standby (as a synchronous standby if
    ``sync``): pg_stat_replication says ``streaming`` (and ``sync``)."""
    wanted = ("streaming", "sync") if sync else ("streaming",)
    deadline = time.monotonic() + timeout
    while True:
        state = replication_state(primary)
        if state is not None and state[: len(wanted)] == wanted:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the standby never reached {wanted} (last: {state})")
        time.sleep(0.1)


def make_synchronous(
    primary: ThrowawayPostgres, *, level: str = "on", timeout: float = 60.0
) -> None:
    """Make every commit on ``primary`` wait for its standby
    (``synchronous_standby_names = '*'``): until the standby has flushed it with
    ``synchronous_commit`` at its default ``on``, until it has replayed it with
    ``level="remote_apply"``. Returns once the standby is synchronous.

    Set with ALTER SYSTEM after the standby was cloned, so the standby does not
    inherit it: promoted, it must not wait for a standby of its own that does not
    exist. (Not in ``settings=``: a command-line setting beats ALTER SYSTEM.)
    """
    conn = _autocommit(primary.dsn)
    try:
        with conn.cursor() as cur:
            cur.execute("ALTER SYSTEM SET synchronous_standby_names = '*'")
            cur.execute("ALTER SYSTEM SET synchronous_commit = %s", (level,))
            cur.execute("SELECT pg_reload_conf()")
    finally:
        conn.close()
    wait_streaming(primary, sync=True, timeout=timeout)


def wait_replayed(
    primary: ThrowawayPostgres, standby: ThrowawayPostgres, *, timeout: float = 60.0
) -> None:
    """Return once ``standby`` has replayed everything ``primary`` had written when called."""
    target = _one_value(primary.dsn, "SELECT pg_current_wal_lsn()::text")
    deadline = time.monotonic() + timeout
    query = "SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn"
    while not _one_value(standby.dsn, query, (target,)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the standby never replayed up to {target}")
        time.sleep(0.05)


def pause_replay(standby: ThrowawayPostgres) -> None:
    """Stop ``standby`` applying WAL (``pg_wal_replay_pause()``); it still receives and
    flushes it. A primary committing with ``remote_apply`` then keeps every COMMIT
    waiting, flushed on the standby but not acknowledged to its client. Promotion
    ends the pause and replays it all."""
    _one_value(standby.dsn, "SELECT pg_wal_replay_pause()")


def promote(standby: ThrowawayPostgres, *, timeout: float = 60.0) -> None:
    """Promote ``standby`` (``pg_promote()``: ``pg_ctl promote`` will not run as root)
    and return once it accepts writes. It first replays every WAL record it has
    received, so all a synchronous primary acknowledged is there."""
    done = _one_value(standby.dsn, "SELECT pg_promote(true, %s)", (max(1, round(timeout)),))
    if done is not True:
        raise TimeoutError(f"{standby!r} was not promoted within {timeout:g} s")
    deadline = time.monotonic() + timeout
    while session_read_only(standby.dsn) != "off":
        if time.monotonic() > deadline:
            raise TimeoutError(f"{standby!r} still read-only after its promotion")
        time.sleep(0.05)


def is_in_recovery(server: ThrowawayPostgres) -> bool:
    """``pg_is_in_recovery()``: whether ``server`` is (still) a standby."""
    return bool(_one_value(server.dsn, "SELECT pg_is_in_recovery()"))
