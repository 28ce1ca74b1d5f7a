"""A user's retrying client, run with the installed wheel's ``[client]`` extra.

``tests/tooling/test_install.py`` starts it against the Flask-SQLAlchemy app
under gunicorn and SIGKILLs workers while it runs: every call keeps its key
across whatever its attempts meet (a dropped connection, a ``409`` while the
killed worker's claim runs out, a ``503``), the way a user's client would.
Prints one JSON line: the final statuses, attempts and replays.

Usage: ``python wheel_client_storm.py URL KEYS COPIES THREADS``.
"""

from __future__ import annotations

import json
import random
import sys
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

from flask_idempotency.client import IdempotentSession, RetryPolicy

#: Generous: a killed worker's claims wait out their lease before a retry runs.
POLICY = RetryPolicy(max_attempts=20, deadline=90.0, backoff_base=0.1, backoff_max=1.0)


def main(url: str, keys: int, copies: int, threads: int) -> None:
    calls = [f"wheel-{n}" for n in range(keys) for _ in range(copies)]
    random.shuffle(calls)
    local = threading.local()

    def call(key: str) -> tuple[int, int, bool | None]:
        if not hasattr(local, "session"):  # a requests Session per thread
            local.session = IdempotentSession(POLICY)
        try:
            answer = local.session.post(
                f"{url}/transfers", json={"amount": 1}, headers={"Idempotency-Key": key}, timeout=10
            )
        except Exception as error:  # the call gave up: say why on stderr, count it
            print(f"gave up: {type(error).__name__}: {error}", file=sys.stderr)
            return -1, 0, None
        outcome = answer.idempotency
        return answer.status_code, outcome.attempts, outcome.replayed

    with ThreadPoolExecutor(threads) as pool:
        results = list(pool.map(call, calls))
    print(
        json.dumps(
            {
                "statuses": Counter(status for status, _, _ in results),
                "attempts": sum(attempts for _, attempts, _ in results),
                "retried_calls": sum(1 for _, attempts, _ in results if attempts > 1),
                "replays": sum(1 for _, _, replayed in results if replayed),
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1], *(int(arg) for arg in sys.argv[2:5]))
