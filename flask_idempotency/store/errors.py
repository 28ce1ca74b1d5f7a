"""One answer to "is the database unreachable?", used wherever the store decides
between a ``503 store_unavailable`` and letting an error through.

Unreachable means the statement's outcome says nothing about the statement: the
connection broke, the server is shutting down or refuses sessions. Those are
worth a retry later (503 with ``Retry-After``) and make the connection, and
probably its idle peers, unusable. Anything else (a constraint, a syntax error,
a cancelled statement, a lock timeout) is an answer from a live server.

A server that refuses writes counts as unreachable too (SQLSTATE 25006,
``read_only_sql_transaction``): a hot standby, a former primary demoted by a
failover, or one fenced with ``default_transaction_read_only``. Its connections
are no use for claims, and only new ones can find the writable server (libpq's
``target_session_attrs=read-write`` over a multi-host DSN).
"""

from __future__ import annotations

import logging
from typing import Any

from . import driver
from .base import SchemaMismatchError
from .driver import sqlstate

#: SQLSTATEs outside class 08 that mean the session is gone or cannot start:
#: admin_shutdown, crash_shutdown, cannot_connect_now, too_many_connections.
UNREACHABLE_SQLSTATES = frozenset({"57P01", "57P02", "57P03", "53300"})

#: ``read_only_sql_transaction``: the server (a standby, or one with
#: ``default_transaction_read_only = on``) refused a write. psycopg2 raises it as
#: an ``InternalError``, so it is matched by SQLSTATE whatever the class.
READ_ONLY_SQLSTATE = "25006"


def is_unreachable(exc: BaseException, conn: Any = None) -> bool:
    """Whether ``exc`` (raised on ``conn``, if given) means PostgreSQL cannot be reached.

    ``InterfaceError`` (the connection is closed on our side); an
    ``OperationalError`` without an SQLSTATE (libpq lost the socket: reset,
    timeout, EOF) or of class 08 (connection exception) or one of
    :data:`UNREACHABLE_SQLSTATES`; a read-only server's refusal
    (:data:`READ_ONLY_SQLSTATE`); or any error on a connection that is now closed.
    """
    if conn is not None and getattr(conn, "closed", False):
        return True
    code = sqlstate(exc)
    if code == READ_ONLY_SQLSTATE or isinstance(exc, driver.INTERFACE_ERRORS):
        return True
    if isinstance(exc, driver.OPERATIONAL_ERRORS):
        return not code or code.startswith("08") or code in UNREACHABLE_SQLSTATES
    return False


#: The most of libpq's message that goes into a log line.
MAX_REASON_LENGTH = 200


def reason_of(exc: BaseException) -> str:
    """A driver error, for a log line or an error's detail: the exception's class
    and the first line of libpq's message (for a connect, the host and port it
    tried, and what failed: refused, timed out, a certificate not verified,
    authentication; for a statement, the object it named and did not find).

    libpq's messages name hosts, ports and users, never a password; the class
    alone ("OperationalError") left an operator guessing at start-up.
    """
    first_line = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    if len(first_line) > MAX_REASON_LENGTH:
        first_line = first_line[: MAX_REASON_LENGTH - 1] + "…"
    name = type(exc).__name__
    return f"{name}: {first_line}" if first_line else name


def store_failure(exc: BaseException) -> tuple[int, str]:
    """How a worker that waits out outages (the completer, the relay, a consumer)
    logs a store failure: a missing or outdated schema is an ERROR named as such,
    a skipped deploy step that waiting will not fix (its message names the
    command); anything else is a WARNING, an outage it retries."""
    if isinstance(exc, SchemaMismatchError):
        return logging.ERROR, "schema missing"
    return logging.WARNING, "store unavailable"
