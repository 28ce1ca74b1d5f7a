"""The one way the extension runs a statement of its own.

Every statement the store sends (a request's claim and completion, the
keeper's renewal, a health check, the schema's inspection) goes through
:func:`run`, which owns the three things they share:

* the client-side deadline (``watchdog.py``): a server that stopped answering
  costs one deadline, never a hung thread;
* the store's circuit breaker (``breaker.py``): how the statement ended is
  counted once, here;
* the classification of "unreachable" (``errors.py``): the caller learns
  whether the connection is lost (and must be dropped) from the result.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg2

from . import driver
from .breaker import StoreBreaker
from .driver import Driver
from .errors import is_unreachable
from .watchdog import WATCHDOG


@dataclasses.dataclass
class Outcome:
    """How a statement ended when it did not return normally."""

    #: The watchdog cut the statement at its deadline: PostgreSQL did not answer.
    fired: bool = False
    #: The connection is lost (closed, reset, a server shutting down): drop it.
    lost: bool = False


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
    outcome: Outcome | None = None,
) -> Iterator[None]:
    """The block's statements on ``conn`` under one client-side deadline; how they
    ended goes to ``outcome`` (if given) and to ``breaker`` (unless ``None``). A
    connection the watchdog shut down is closed, and the block raises ``NoAnswer``
    even if its statement returned."""
    outcome = outcome if outcome is not None else Outcome()
    on_fire = breaker.no_answer if breaker is not None and counts else None
    ticket = WATCHDOG.watch(conn, deadline, on_fire)
    error: BaseException | None = None
    try:
        yield
    except BaseException as exc:
        error = exc
        raise
    finally:
        outcome.fired = WATCHDOG.unwatch(ticket)
        outcome.lost = outcome.fired or (
            isinstance(error, driver.ERRORS) and is_unreachable(error, conn)
        )
        if breaker is not None:
            breaker.outcome(conn, error, fired=outcome.fired, retried_if_lost=retried_if_lost)
        if outcome.fired:
            conn.close()
    if outcome.fired:  # answered just as the socket was shut down: not to be trusted
        raise NoAnswer("no answer from PostgreSQL before the deadline")


def run(
    conn: Any,
    drv: Driver,
    sql: str,
    params: Any = None,
    *,
    deadline: float,
    breaker: StoreBreaker | None,
    fetch: bool = False,
    counts: bool = True,
    retried_if_lost: bool = False,
    outcome: Outcome | None = None,
) -> Any:
    """Run ``sql`` on ``conn`` within ``deadline`` seconds (:func:`watched`); the first
    row if ``fetch``, else the number of rows the last statement touched.

    Raises the driver's errors. The breaker hears of the outcome unless ``breaker``
    is ``None``: a statement cut with ``counts`` false (cut short because its
    request waited elsewhere) is not counted, nor a lost connection the caller
    retries on a fresh one (``retried_if_lost``: a pooled connection that died
    while idle says nothing about the server now; the retry counts instead).
    """
    with (
        watched(
            conn,
            deadline,
            breaker,
            counts=counts,
            retried_if_lost=retried_if_lost,
            outcome=outcome,
        ),
        drv.cursor(conn) as cur,
    ):
        drv.execute(cur, sql, params)
        return cur.fetchone() if fetch else cur.rowcount
