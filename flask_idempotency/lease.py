"""Keeps the leases of in-flight requests alive while their views run.

One daemon thread per process renews every claim this process holds in a
single statement, every ``interval`` seconds. A slow but live request is
never taken over; a dead worker's thread dies with it, so its claims expire
on time. The thread starts lazily on the first claim, which under gunicorn is
after the fork, and restarts if the process forks again.

It renews on a database connection of its own (``Store.renew``), never one of
the request slots: when every slot is held by a slow view, those are exactly
the leases that need renewing. Each renewal is bounded by the store's
statement timeout and client-side deadline, so a database that stops
answering fails one round (logged) instead of hanging the thread.
"""

from __future__ import annotations

import logging
import os
import threading

from .observer import Observer
from .store.base import LeaseHold, Store, StoreUnavailableError

log = logging.getLogger("flask_idempotency.lease")


class LeaseKeeper:
    def __init__(self, store: Store, interval: float) -> None:
        self._store = store
        self._interval = interval
        self._lock = threading.Lock()
        self._pid = -1
        self._holds: dict[tuple[bytes, int], LeaseHold] = {}
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()
        #: Told how each round went once the app is observed (``observability.attach``).
        self.observer: Observer | None = None

    def hold(self, hold: LeaseHold) -> None:
        if self._interval <= 0:
            return
        with self._lock:
            if self._pid != os.getpid():
                # Forked: the parent's holds and thread are not ours.
                self._pid = os.getpid()
                self._holds = {}
                self._thread = None
                self._stopped = threading.Event()
            self._holds[(hold.record_key, hold.token)] = hold
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="idempotency-lease-keeper", daemon=True
                )
                self._thread.start()

    def drop(self, record_key: bytes, token: int) -> None:
        with self._lock:
            self._holds.pop((record_key, token), None)

    def held(self) -> list[LeaseHold]:
        with self._lock:
            return list(self._holds.values())

    def _run(self) -> None:
        stopped = self._stopped
        self._store.prepare_renewals()
        while not stopped.wait(self._interval):
            holds = self.held()
            if not holds:
                continue
            observer = self.observer
            try:
                renewed = self._store.renew(holds)
            except StoreUnavailableError as exc:
                # The lease still runs; if the database stays away the claim expires,
                # and the holder's completion will then be refused (fencing).
                log.warning("idempotency: lease renewal failed: %s", exc)
                if observer is not None:
                    observer.lease_renewal_failed()
                continue
            if observer is not None:
                observer.leases_renewed(renewed)

    def stop(self) -> None:
        self._stopped.set()
