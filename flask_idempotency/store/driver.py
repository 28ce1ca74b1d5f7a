"""What differs between psycopg2 and psycopg 3, in one place.

The store sends its own statements as one round trip each: ``SET LOCAL``
timeouts, then the statement, with parameters. psycopg2 binds parameters on
the client and returns the last statement's result. psycopg 3 binds on the
server by default, which refuses several statements with parameters; its
``ClientCursor`` binds on the client like psycopg2, but leaves the *first*
result current, so the store moves to the last one. Errors carry their
SQLSTATE as ``pgcode`` in psycopg2 and ``sqlstate`` in psycopg 3.

Everything else the store does (``autocommit``, ``closed``,
``info.transaction_status``, ``fileno()``, ``close()``) is spelled the same
by both, so the connection objects themselves pass through unchanged.
"""

from __future__ import annotations

from typing import Any

import psycopg2
import psycopg2.extensions

#: Every driver error class the store may see. Read as ``driver.ERRORS`` at the
#: ``except``: psycopg 3's classes join when an engine first uses it
#: (:func:`for_dialect`), so an application that never does never imports it.
ERRORS: tuple[type[Exception], ...] = (psycopg2.Error,)
#: The connection is closed on our side.
INTERFACE_ERRORS: tuple[type[Exception], ...] = (psycopg2.InterfaceError,)
#: libpq reported a failure of the connection or the server.
OPERATIONAL_ERRORS: tuple[type[Exception], ...] = (psycopg2.OperationalError,)


def _speak_psycopg3() -> Any:
    """Import psycopg 3 and count its errors as the store's; returns the module."""
    global ERRORS, INTERFACE_ERRORS, OPERATIONAL_ERRORS
    try:
        import psycopg
    except ImportError:
        raise RuntimeError(
            "postgresql+psycopg needs psycopg 3: pip install 'flask-idempotency[psycopg]'"
        ) from None
    if psycopg.Error not in ERRORS:
        ERRORS += (psycopg.Error,)
        INTERFACE_ERRORS += (psycopg.InterfaceError,)
        OPERATIONAL_ERRORS += (psycopg.OperationalError,)
    return psycopg


def sqlstate(exc: BaseException) -> str | None:
    """The error's SQLSTATE, whichever driver raised it."""
    code = getattr(exc, "pgcode", None) or getattr(exc, "sqlstate", None)
    return str(code) if code else None


class Driver:
    """psycopg2: the driver's own cursor already does what the store needs."""

    def cursor(self, conn: Any) -> Any:
        """A cursor that takes several statements with parameters in one call."""
        return conn.cursor()

    def execute(self, cur: Any, sql: str, params: Any = None) -> None:
        """Run ``sql``; the cursor then holds the last statement's result."""
        cur.execute(sql, params)


class Psycopg3Driver(Driver):
    """psycopg 3: a client-side binding cursor, moved on to the last result."""

    def cursor(self, conn: Any) -> Any:
        return _speak_psycopg3().ClientCursor(conn)

    def execute(self, cur: Any, sql: str, params: Any = None) -> None:
        cur.execute(sql, params)
        while cur.nextset():
            pass


PSYCOPG2 = Driver()
PSYCOPG3 = Psycopg3Driver()


def for_dialect(dialect: Any) -> Driver:
    """The driver of a SQLAlchemy engine's ``dialect``: PostgreSQL's, through
    psycopg2 or psycopg 3."""
    name = f"{dialect.name}+{dialect.driver}"
    if name == "postgresql+psycopg2":
        return PSYCOPG2
    if name == "postgresql+psycopg":
        _speak_psycopg3()
        return PSYCOPG3
    raise ValueError(
        f"flask_idempotency needs PostgreSQL, through the postgresql+psycopg2 or "
        f"postgresql+psycopg dialect; the engine is {name}"
    )
