"""The one way the extension runs a statement of its own.

Every statement the store sends (a request's claim and completion, the
keeper's renewal, a health check, the schema's inspection) goes through
:func:`watched`, which owns the three things they share:

* the client-side deadline (``watchdog.py``): a server that stopped answering
  costs one deadline, never a hung thread;
* the store's circuit breaker (``breaker.py``): how the statement ended is
  counted once, here;
* the classification of "unreachable" (``errors.py``): a statement cut at its
  deadline raises :class:`NoAnswer`, so a caller tells a server that is not
  answering from a connection that died while idle (worth one more try on a
  fresh one).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg2

from . import driver
from .breaker import StoreBreaker
from .driver import sqlstate
from .errors import READ_ONLY_SQLSTATE, is_unreachable
from .watchdog import WATCHDOG


class NoAnswer(psycopg2.OperationalError):
    """The statement had no answer before its deadline; its connection was shut down."""


@contextmanager
def watched(
    conn: Any,
    deadline: float,
    breaker: StoreBreaker | None = None,
    *,
    counts: bool = True,
    retried_if_lost: bool = False,
) -> Iterator[None]:
    """The block's statements on ``conn`` under one client-side deadline. A
    connection the watchdog shut down is closed, and the block raises ``NoAnswer``
    (from the driver's error, or even if its statement returned: an answer as the
    socket was shut down is not to be trusted).

    How they ended goes to ``breaker`` (unless ``None``), once: a statement the
    watchdog cut is counted as it fires (``breaker.no_answer``), unless ``counts``
    is false (cut short because its request waited elsewhere). Any answer from the
    server counts as one, a refusal to write (a standby), a constraint or a
    timeout of the server's included; among errors only a lost connection is a
    failure, and not when the caller retries it on a fresh connection
    (``retried_if_lost``: a pooled connection that died while idle says nothing
    about the server now; the retry counts instead)."""
    ticket = WATCHDOG.watch(conn, deadline, breaker.no_answer if breaker and counts else None)
    error: BaseException | None = None
    try:
        yield
    except BaseException as exc:
        error = exc
        raise
    finally:
        fired = WATCHDOG.unwatch(ticket)
        if breaker and not fired and (error is None or isinstance(error, driver.ERRORS)):
            if (
                error is None
                or not is_unreachable(error, conn)
                or sqlstate(error) == READ_ONLY_SQLSTATE
            ):
                breaker.answered()
            elif not retried_if_lost:
                breaker.failed(type(error).__name__)
        if fired:
            conn.close()
            if error is None or isinstance(error, driver.ERRORS):
                raise NoAnswer("no answer from PostgreSQL before the deadline") from error
