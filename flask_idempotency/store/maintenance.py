"""The store's maintenance: everything that is not one request's claim.

Purge, inspection and unlock for the CLI; the completer's takeover of
abandoned records and its settlements; the consumer guard's attempt counting.
Each runs on a pooled connection of its own, under the same ``SET LOCAL``
statement and lock timeouts and client-side deadline as the request path, so
a PostgreSQL that stops answering fails these with ``StoreUnavailableError``
instead of hanging an operator's command, a completer or a consumer.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any

from . import sql
from .base import RecordInfo, Taken, phases_of
from .driver import Driver
from .pool import Connection
from .runner import watched


class Maintenance:
    """Mixed into :class:`~.postgres.PostgresStore`, which provides the pool's
    connections, the ``SET LOCAL`` prefix and the deadline."""

    timeouts: str
    deadline: float
    driver: Driver

    def autocommit(self) -> AbstractContextManager[Connection]:
        raise NotImplementedError

    def _run(self, statement: str, params: Any = None) -> tuple[int, list[tuple[Any, ...]]]:
        """``sql`` as one implicit transaction, under the store's timeouts (sent in
        the same round trip) and the watchdog's deadline: the number of rows it
        touched, and those it returned."""
        with self.autocommit() as conn:
            with watched(conn, self.deadline), self.driver.cursor(conn) as cur:
                self.driver.execute(cur, self.timeouts + statement, params)
                return cur.rowcount, cur.fetchall() if cur.description is not None else []

    def _figures(self, statement: str, names: str) -> dict[str, float]:
        """The one row of ``sql``, as floats under ``names`` (space-separated)."""
        return dict(zip(names.split(), map(float, self.read(statement)[0]), strict=True))

    def count_expired(self) -> int:
        return int(self.read(sql.COUNT_EXPIRED)[0][0])

    def purge(self, batch_size: int) -> Iterator[list[bytes]]:
        """Delete expired rows a batch at a time (each its own transaction), yielding
        the deleted keys so a cache can evict them too."""
        while True:
            keys = [bytes(r[0]) for r in self.read(sql.PURGE_BATCH, (batch_size,))]
            if keys:
                yield keys
            if len(keys) < batch_size:
                return

    def info(self, record_key: bytes) -> RecordInfo | None:
        rows = self.read(sql.INFO, (record_key,))
        if not rows:
            return None
        state, created, expires, completed, lease, status, body, headers, age, expired = rows[0]
        body = None if body is None else bytes(body)
        headers = sql.headers_from_json(headers)
        return RecordInfo(
            state, created, expires, completed, lease, status, body, headers, float(age), expired
        )

    def stats(self) -> dict[str, float]:
        names = "processing completed expired lease_expired oldest_processing_seconds takeovers"
        return self._figures(sql.STATS, names)

    def unlock(self, record_key: bytes) -> bool:
        return self._run(sql.UNLOCK, (record_key,))[0] > 0

    # -- the completer (``completer.py``) ----------------------------------------

    def recovery_cutoff(self, older_than: float) -> Any:
        """The server's ``now() - older_than``: a pass recovers what was abandoned
        before it (measured on one clock, the database's)."""
        return self.read(sql.PASS_CUTOFF, (older_than,))[0][0]

    def take_over(self, cutoff: Any, limit: int, lease: float) -> list[Taken]:
        """Take up to ``limit`` records abandoned before ``cutoff`` over, each under
        a new lock token and a fresh ``lease``, committed at once."""
        params = {
            "cutoff": cutoff,
            "limit": limit,
            "tokens": [sql.new_token() for _ in range(limit)],
            "lease": lease,
        }
        return [
            Taken(
                bytes(key),
                bytes(fp),
                int(token),
                bytes(recovery),
                phases_of(phases),
                max(0.0, float(s)),
            )
            for key, fp, token, recovery, phases, s in self.read(sql.TAKE_OVER, params)
        ]

    def hand_back(self, record_key: bytes, token: int) -> bool:
        """End our lease on a record at once, keeping it ("cannot tell yet"); False
        if it is no longer ours."""
        return self._run(sql.END_LEASE, (record_key, token))[0] == 1

    def release_abandoned(self, record_key: bytes, token: int, *, keep_phases: bool) -> bool:
        """ "Nothing happened": delete the record (or, with committed recovery points,
        give it back to its client) and count the release; False if no longer ours."""
        statement = sql.RELEASE_TO_CLIENT if keep_phases else sql.RELEASE
        with self.autocommit() as conn, watched(conn, self.deadline):
            # (A failure leaves the transaction open: the pool rolls it back.)
            with self.driver.cursor(conn) as cur:
                text = "BEGIN;\n" + self.timeouts + statement
                self.driver.execute(cur, text, (record_key, token))
                released: bool = cur.rowcount == 1
                if released:
                    cur.execute(sql.BUMP_RECOVERY_TOTAL, ("released",))
                cur.execute("COMMIT")
        return released

    def recovery_stats(self) -> dict[str, float]:
        """Abandoned records now (``abandoned``: processing, lease ended, not taken
        over; ``recoverable``: those of ``recover=`` routes; how long the oldest has
        waited) and the completer's totals (``recovered``, ``recovery_released``)."""
        names = "abandoned recoverable oldest_abandoned_seconds recovered recovery_released"
        return self._figures(sql.RECOVERY_STATS, names)

    # -- the consumer guard (``events/consumer.py``) ------------------------------

    def attempts_so_far(self, record_key: bytes, token: int) -> int | None:
        """Earlier attempts at a message we hold (its takeovers); ``None`` if the
        record is no longer ours."""
        rows = self.read(sql.ATTEMPTS_SO_FAR, (record_key, token))
        return int(rows[0][0]) if rows else None

    def fail_attempt(self, record_key: bytes, token: int) -> None:
        """End a failed attempt's lease now and keep the record, so the next
        delivery takes it over (and counts one more attempt)."""
        self._run(sql.FAIL_ATTEMPT, (record_key, token))

    def release_claim(self, record_key: bytes, token: int) -> None:
        """Delete a record we hold, so the next delivery starts afresh."""
        self._run(sql.RELEASE, (record_key, token))

    # -- the background workers' heartbeats (``heartbeat.py``) and the doctor --------

    def heartbeat(self, worker: str, seen_on: str) -> None:
        """Record that a ``worker`` (``"relay"``, ``"completer"``) ran just now."""
        self._run(sql.HEARTBEAT, (worker, seen_on))

    def last_runs(self) -> dict[str, tuple[float, str | None]]:
        """Seconds since each kind of worker last reported (the server's clock), and
        the ``host:pid`` that did."""
        return {worker: (float(ago), seen_on) for worker, ago, seen_on in self.read(sql.LAST_RUNS)}

    def read(self, statement: str, params: Any = None) -> list[tuple[Any, ...]]:
        """The rows ``statement`` returns, under the store's timeouts and deadline
        (also ``flask idempotency doctor``'s look at the server's settings and
        statistics)."""
        return self._run(statement, params)[1]
