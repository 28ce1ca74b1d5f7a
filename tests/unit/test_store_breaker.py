"""The store's circuit breaker as a state machine, on a clock the tests move.

What it must do under a frozen PostgreSQL is shown end to end by
tests/core/test_store_breaker.py and tests/reliability/test_pg_frozen.py;
here: which outcomes count, when it opens, the one probe, the transitions it
logs and reports, and the settings that configure it.
"""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace
from typing import Any

import psycopg2
import pytest

from flask_idempotency.circuit import BreakerState
from flask_idempotency.observer import Observer
from flask_idempotency.settings import settings_from_config
from flask_idempotency.store import StoreUnavailableError, pool
from flask_idempotency.store.base import BreakerOpenError
from flask_idempotency.store.breaker import StoreBreaker
from flask_idempotency.store.pool import Checkout
from flask_idempotency.store.runner import NoAnswer, watched
from flask_idempotency.store.watchdog import WATCHDOG
from support.clock import FakeClock


class Transitions(Observer):
    def __init__(self) -> None:
        self.states: list[str] = []

    def store_breaker_changed(self, state: str) -> None:
        self.states.append(state)


def coded(base: type[psycopg2.Error], code: str) -> psycopg2.Error:
    """A driver error carrying the SQLSTATE a server would have sent."""
    error_class = type(f"Coded{code}", (base,), {"sqlstate": code})
    error: psycopg2.Error = error_class(code)
    return error


class Conn:
    closed = 0

    def close(self) -> None:
        pass


def state(breaker: StoreBreaker) -> BreakerState:
    """The breaker's state, read through a call (mypy would narrow the attribute)."""
    return breaker.state


def make(threshold: int = 3, cooldown: float = 2.0) -> tuple[StoreBreaker, FakeClock, Transitions]:
    clock, seen = FakeClock(), Transitions()
    return StoreBreaker(threshold, cooldown, observer=lambda: seen, clock=clock), clock, seen


def test_it_opens_after_threshold_failures_in_a_row_and_answers_at_once_while_open() -> None:
    breaker, clock, seen = make()
    for _ in range(3):  # an answer in between resets the count
        breaker.no_answer()
        breaker.no_answer()
        breaker.answered()
    assert state(breaker) is BreakerState.CLOSED
    before = breaker.admit()
    breaker.no_answer()
    breaker.failed("OperationalError")
    assert not breaker.opened_since(before)
    breaker.no_answer()
    assert state(breaker) is BreakerState.OPEN
    assert breaker.opened_since(before), "a request admitted before must give up its wait"
    with pytest.raises(StoreUnavailableError, match="circuit breaker open"):
        breaker.admit()
    clock.advance(1.9)
    with pytest.raises(StoreUnavailableError):
        breaker.admit()
    assert seen.states == ["open"]


def test_after_the_cooldown_exactly_one_probe_and_its_answer_closes() -> None:
    breaker, clock, seen = make(threshold=1, cooldown=2.0)
    breaker.no_answer()
    clock.advance(2.0)
    probe = breaker.admit()
    assert state(breaker) is BreakerState.HALF_OPEN
    for _ in range(3):
        with pytest.raises(StoreUnavailableError):
            breaker.admit()  # everyone else still answers at once
    breaker.answered()
    assert state(breaker) is BreakerState.CLOSED
    assert not breaker.opened_since(probe)
    breaker.admit()
    assert seen.states == ["open", "closed"]


def test_a_failed_probe_opens_it_for_another_cooldown() -> None:
    breaker, clock, seen = make(threshold=2, cooldown=2.0)
    breaker.no_answer()
    breaker.no_answer()
    clock.advance(2.0)
    probe = breaker.admit()
    breaker.failed("OperationalError")
    assert state(breaker) is BreakerState.OPEN
    assert breaker.opened_since(probe)
    clock.advance(1.0)
    with pytest.raises(StoreUnavailableError):
        breaker.admit()
    clock.advance(1.0)
    breaker.admit()
    assert seen.states == ["open", "open"]


def test_a_probe_that_never_reports_is_replaced_after_another_cooldown() -> None:
    breaker, clock, _ = make(threshold=1, cooldown=2.0)
    breaker.no_answer()
    clock.advance(2.0)
    breaker.admit()  # its request died before any statement (a pool timeout, say)
    clock.advance(1.0)
    with pytest.raises(StoreUnavailableError):
        breaker.admit()
    clock.advance(1.0)
    breaker.admit()


@pytest.mark.parametrize(
    ("error", "counts"),
    [
        (psycopg2.OperationalError("server closed the connection unexpectedly"), True),
        (psycopg2.InterfaceError("connection already closed"), True),
        (coded(psycopg2.OperationalError, "57P01"), True),  # admin_shutdown
        (coded(psycopg2.OperationalError, "08006"), True),  # connection_failure
        (coded(psycopg2.IntegrityError, "23505"), False),  # unique violation: an answer
        (coded(psycopg2.OperationalError, "57014"), False),  # statement_timeout: an answer
        (coded(psycopg2.OperationalError, "55P03"), False),  # lock_timeout
        (coded(psycopg2.InternalError, "25006"), False),  # a standby refusing writes
        (ValueError("an application error"), False),
    ],
)
def test_only_errors_that_mean_no_answer_count(error: BaseException, counts: bool) -> None:
    breaker, _, _ = make(threshold=1)
    with pytest.raises(type(error)), watched(Conn(), 60.0, breaker):
        raise error
    assert (state(breaker) is BreakerState.OPEN) is counts


def test_a_statement_the_watchdog_cut_is_counted_once_by_the_watchdog() -> None:
    breaker, _, _ = make(threshold=2)
    with pytest.raises(NoAnswer), watched(Conn(), 0.0, breaker):
        WATCHDOG._check(time.monotonic() + 1.0)  # the watchdog's sweep counts it
        raise psycopg2.OperationalError("shut down")  # as its caller sees it
    assert state(breaker) is BreakerState.CLOSED


def test_the_transitions_are_logged_without_keys(caplog: pytest.LogCaptureFixture) -> None:
    breaker, clock, _ = make(threshold=1, cooldown=1.0)
    caplog.set_level(logging.INFO, logger="flask_idempotency.store")
    breaker.failed("OperationalError")
    clock.advance(1.0)
    breaker.admit()
    breaker.answered()
    messages = [r.getMessage() for r in caplog.records]
    assert any("store circuit breaker open" in m and "OperationalError" in m for m in messages)
    assert any("store circuit breaker closed" in m for m in messages)
    assert [r.levelno for r in caplog.records] == [logging.WARNING, logging.INFO]


def test_no_observer_is_fine() -> None:
    breaker = StoreBreaker(1, 1.0)
    breaker.no_answer()
    assert state(breaker) is BreakerState.OPEN


# -- a checkout's time -----------------------------------------------------------


def test_a_connect_gets_what_is_left_of_the_deadline_in_whole_seconds() -> None:
    """The ``do_connect`` hook on the store's checkouts: libpq's connect timeout cut to
    what is left of the request's deadline (whole seconds, at least what the driver
    honours), none started with under half a second left or once the breaker opened,
    and an application's own connects left as they are."""
    dialect = SimpleNamespace(driver="psycopg2")
    floor = pool.MIN_CONNECT_TIMEOUT

    def connect_timeout(left: float, given: Any, *, abandoned: bool = False) -> Any:
        cparams: dict[str, Any] = {} if given is None else {"connect_timeout": given}
        pool._CHECKOUT.terms = Checkout(time.monotonic() + left, lambda: abandoned)
        try:
            pool._bound_connect(dialect, None, [], cparams)
        finally:
            pool._CHECKOUT.terms = None
        return cparams.get("connect_timeout")

    assert connect_timeout(5.6, 3) == 3
    assert connect_timeout(5.6, None) == 6
    assert connect_timeout(5.6, "0") == 6  # 0: libpq would wait for ever
    assert connect_timeout(0.8, 3) == max(floor, 1)
    with pytest.raises(StoreUnavailableError, match="no time left"):
        connect_timeout(0.2, 3)
    with pytest.raises(BreakerOpenError):
        connect_timeout(5, 3, abandoned=True)
    untouched = {"connect_timeout": 30}
    pool._bound_connect(dialect, None, [], untouched)  # not a store's checkout
    assert untouched == {"connect_timeout": 30}


# -- settings ----------------------------------------------------------------------


def settings(**options: Any) -> Any:
    return settings_from_config({"DATABASE_URL": "postgresql://x/y", "DATABASE_OPTIONS": options})


def test_the_settings_and_their_defaults() -> None:
    default = settings()
    assert (default.store_breaker_threshold, default.store_breaker_cooldown) == (3, 1.0)
    tuned = settings(breaker_threshold="5", breaker_cooldown=0.25)
    assert (tuned.store_breaker_threshold, tuned.store_breaker_cooldown) == (5, 0.25)
    assert "breaker_threshold" not in tuned.connect_kwargs  # not taken for a libpq parameter


@pytest.mark.parametrize(
    "options",
    [{"breaker_threshold": 0}, {"breaker_cooldown": 0}, {"breaker_cooldown": "soon"}],
)
def test_bad_settings_fail_at_start_up(options: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="IDEMPOTENCY_DATABASE_OPTIONS"):
        settings(**options)
