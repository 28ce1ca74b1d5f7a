"""PostgreSQL topologies for the deployment tests: read-only servers, multi-host DSNs.

Everything here acts on throwaway servers the tests start themselves
(``ThrowawayPostgres``), never on the run's shared server: switching a server
read-only, promoting a standby or stopping a primary would break every other
test using it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import psycopg2

from .postgres_server import ThrowawayPostgres


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
