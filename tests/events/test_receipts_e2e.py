"""Events end to end, as deployed: gunicorn, ``flask idempotency relay``, receipts consumers.

Real processes against the run's PostgreSQL and the machine's RabbitMQ (under
names of the test's own). Charges are created through gunicorn while the test
SIGKILLs receipts consumers mid-handler, or cuts the broker connection of the
relay and the consumers (a proxy of the test's own): every charge must end with
exactly one receipt, nothing in the dead-letter queue, nothing left pending.
"""

from __future__ import annotations

import os
import random
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from flask_idempotency import digests
from support._files import make_workdir, remove_tree
from support._procs import spawn, stop_process
from support.pg_query import query
from support.servers import GunicornFactory, GunicornServer, ProxyFactory, http_request
from support.waiting import wait_until

from .conftest import BrokerNames, take_all

pytestmark = [
    pytest.mark.reliability,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="signals and /proc"),
]

REPO_ROOT = Path(__file__).resolve().parents[2]
TOKEN = "sk_test_events_e2e"
#: Short, so a killed consumer's claim is taken over in seconds; the app insists
#: that the lease outlast the processor timeout.
LEASE_SECONDS = "2"
PROCESSOR_TIMEOUT_SECONDS = "1"
#: Long enough that a kill lands inside the handler's transaction most times.
HANDLER_DELAY_SECONDS = "0.25"


class Services:
    """The relay and the receipts consumers as processes of the test's own."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.root = make_workdir("events-e2e")
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.logs: dict[str, Path] = {}

    def start(self, name: str, *argv: str) -> subprocess.Popen[bytes]:
        log = self.logs.setdefault(name, self.root / f"{name}.log")
        proc = spawn([sys.executable, *argv], log_path=log, env=self.env, cwd=REPO_ROOT)
        self.procs[name] = proc
        return proc

    def relay(self) -> None:
        args = ("-m", "flask", "--app", "example_app", "idempotency", "relay")
        self.start("relay", *args, "--poll-interval", "0.05")

    def consumer(self, name: str) -> None:
        self.start(name, "-m", "example_app.receipts")

    def kill(self, name: str) -> None:
        os.kill(self.procs[name].pid, signal.SIGKILL)
        self.procs[name].wait(10)

    def log(self, name: str) -> str:
        return self.logs[name].read_text(errors="replace")

    def close(self) -> None:
        for name, proc in self.procs.items():
            stop_process(proc, [(signal.SIGTERM, 5.0)])
            print(f"--- {name} log (tail) ---\n{self.log(name)[-3000:]}")
        remove_tree(self.root)


@pytest.fixture
def stack_env(clean_db: str, amqp_url: str, broker_names: BrokerNames) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GUNICORN", "REDIS"))}
    env.update(
        {
            "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "tests")]),
            "PYTHONUNBUFFERED": "1",
            "DATABASE_URL": clean_db,
            "AMQP_URL": amqp_url,
            "EVENTS_EXCHANGE": broker_names.exchange(),
            "RECEIPTS_QUEUE": broker_names.queue("receipts"),
            "IDEMPOTENCY_LEASE_SECONDS": LEASE_SECONDS,
            "PROCESSOR_TIMEOUT_SECONDS": PROCESSOR_TIMEOUT_SECONDS,
            "RECEIPTS_DELAY_SECONDS": HANDLER_DELAY_SECONDS,
            # No Redis: a replay from an earlier run's cache would create no charge.
            "REDIS_URL": "",
        }
    )
    for name in ("PROCESSOR_URL", "EVENTS_EMBEDDED"):
        env.pop(name, None)
    return env


@pytest.fixture
def services(stack_env: dict[str, str]) -> Iterator[Callable[[dict[str, str]], Services]]:
    made: list[Services] = []

    def make(env: dict[str, str]) -> Services:
        made.append(Services(env))
        return made[-1]

    yield make
    for service in made:
        service.close()


def start_api(gunicorn_server: GunicornFactory, env: dict[str, str]) -> GunicornServer:
    return gunicorn_server(
        "wsgi:app", env=env, workers=2, threads=4, worker_class="gthread", health_path="/healthz"
    )


def create_charges(url: str, count: int, run: str, pace: float) -> list[str]:
    """``count`` charges, a few at a time; retried on a 5xx or a dropped connection."""

    def one(n: int) -> str:
        headers = {"Authorization": f"Bearer {TOKEN}", "Idempotency-Key": f"{run}-{n}"}
        body = {"amount": 100 + n, "currency": "eur", "customer": run, "source": "tok_visa"}
        for _ in range(50):
            try:
                answer = http_request("POST", url + "/v1/charges", headers, json=body)
            except OSError:
                time.sleep(0.1)
                continue
            if answer.status == 201:
                charge_id: str = answer.json()["id"]
                return charge_id
            time.sleep(0.1)
        raise AssertionError(f"charge {n} never succeeded")

    with ThreadPoolExecutor(4) as pool:
        futures = []
        for n in range(count):
            futures.append(pool.submit(one, n))
            time.sleep(pace)
        return [f.result() for f in futures]


def settle(database_url: str, charges: int, timeout: float = 60.0) -> None:
    """Wait until every charge has its receipt and nothing is pending or processing."""
    seen: dict[str, int] = {}

    def settled() -> bool:
        seen["receipts"] = query(database_url, "SELECT count(*) FROM receipts")[0][0]
        seen["pending"] = query(
            database_url, "SELECT count(*) FROM idempotency_outbox WHERE published_at IS NULL"
        )[0][0]
        seen["processing"] = query(
            database_url, "SELECT count(*) FROM idempotency_records WHERE state = 'processing'"
        )[0][0]
        return seen["receipts"] >= charges and seen["pending"] == seen["processing"] == 0

    wait_until(
        settled, timeout, f"{charges} receipts, nothing pending", describe=lambda: f"last: {seen}"
    )


def consumer_claims_in_flight(database_url: str) -> int:
    """Receipts claims held right now: a consumer is inside its handler's transaction."""
    events = [r[0] for r in query(database_url, "SELECT id FROM idempotency_outbox")]
    claims = [digests.record_key("consumer:receipts", e) for e in events]
    return int(
        query(
            database_url,
            "SELECT count(*) FROM idempotency_records"
            " WHERE state = 'processing' AND lease_expires_at > now() AND record_key = ANY(%s)",
            (claims,),
        )[0][0]
    )


def check_exactly_one_receipt_per_charge(
    database_url: str, charge_ids: list[str], amqp_url: str, env: dict[str, str]
) -> dict[str, Any]:
    receipts = query(database_url, "SELECT charge, count(*) FROM receipts GROUP BY charge")
    events = [r[0] for r in query(database_url, "SELECT id FROM idempotency_outbox")]
    consumer_keys = [digests.record_key("consumer:receipts", e) for e in events]
    takeovers, completed = query(
        database_url,
        "SELECT coalesce(sum(takeovers), 0), count(*) FILTER (WHERE state = 'completed')"
        " FROM idempotency_records WHERE record_key = ANY(%s)",
        (consumer_keys,),
    )[0]
    dead = take_all(amqp_url, env["RECEIPTS_QUEUE"] + ".dlq", timeout=0.2)
    attempts = query(database_url, "SELECT coalesce(sum(attempts), 0) FROM idempotency_outbox")
    figures = {
        "charges": len(charge_ids),
        "events": len(events),
        "publish_attempts": int(attempts[0][0]),
        "receipts": sum(n for _, n in receipts),
        "consumer_records_completed": int(completed),
        "consumer_takeovers": int(takeovers),
        "dead_lettered": len(dead),
    }
    assert sorted(c for c, _ in receipts) == sorted(charge_ids)
    assert all(n == 1 for _, n in receipts)
    assert len(events) == len(charge_ids) and dead == []
    return figures


def test_consumers_killed_mid_handler_leave_exactly_one_receipt_per_charge(
    gunicorn_server: GunicornFactory,
    services: Callable[[dict[str, str]], Services],
    stack_env: dict[str, str],
    clean_db: str,
    amqp_url: str,
) -> None:
    started = time.monotonic()
    api = start_api(gunicorn_server, stack_env)
    svc = services(stack_env)
    svc.consumer("consumer-a")
    svc.consumer("consumer-b")
    svc.relay()
    rng = random.Random(7)
    kills = mid_handler = 0
    created: list[str] = []
    run = "kill-" + secrets.token_hex(3)
    # Charges from a helper thread; kills and restarts from this one (a process
    # spawned by a thread is sent SIGTERM when that thread ends: PR_SET_PDEATHSIG).
    client = threading.Thread(
        target=lambda: created.extend(create_charges(api.url, 100, run, pace=0.08))
    )
    client.start()
    time.sleep(1.5)  # consumers up and consuming
    until = None
    while until is None or time.monotonic() < until:
        time.sleep(rng.uniform(0.9, 1.5))
        victim = rng.choice(["consumer-a", "consumer-b"])
        in_flight = consumer_claims_in_flight(clean_db)
        svc.kill(victim)
        kills += 1
        mid_handler += in_flight > 0
        svc.consumer(victim)
        if until is None and not client.is_alive():
            until = time.monotonic() + 2.0  # keep killing while the backlog drains
    client.join(60)
    charge_ids = created
    settle(clean_db, len(charge_ids))
    figures = check_exactly_one_receipt_per_charge(clean_db, charge_ids, amqp_url, stack_env)
    figures |= {"sigkills": kills, "sigkills_with_a_claim_in_flight": mid_handler}
    print(f"{figures} in {time.monotonic() - started:.1f} s")
    assert kills >= 5 and mid_handler >= 1


def test_a_broker_connection_cut_mid_stream_loses_nothing(
    gunicorn_server: GunicornFactory,
    services: Callable[[dict[str, str]], Services],
    stack_env: dict[str, str],
    clean_db: str,
    amqp_url: str,
    tcp_proxy: ProxyFactory,
) -> None:
    started = time.monotonic()
    parts = urlsplit(amqp_url)
    proxy = tcp_proxy(parts.hostname or "127.0.0.1", parts.port or 5672)
    env = stack_env | {"AMQP_URL": proxy.url_for(amqp_url), "RECEIPTS_DELAY_SECONDS": "0.02"}
    api = start_api(gunicorn_server, stack_env)
    svc = services(env)
    svc.consumer("consumer-a")
    svc.consumer("consumer-b")
    svc.relay()

    run = "cut-" + secrets.token_hex(3)

    def relay_retries() -> int:
        return svc.log("relay").count("retrying in")

    def consumer_reconnects() -> int:
        return sum(
            svc.log(name).count("broker unavailable") for name in ("consumer-a", "consumer-b")
        )

    def outage() -> None:
        """Cut now; restore when both sides saw it, after 2 s at least and 30 s at most
        (then the assertions below fail)."""
        proxy.cut()
        cut_at = time.monotonic()
        while time.monotonic() < cut_at + 30 and not (
            time.monotonic() >= cut_at + 2.0 and relay_retries() >= 1 and consumer_reconnects() >= 2
        ):
            time.sleep(0.1)
        proxy.restore()

    # Events flow before the cut: the relay and the consumers take seconds to start on a
    # busy machine, and a cut at a fixed time raced them (nothing left to relay by then).
    charge_ids = create_charges(api.url, 10, run, pace=0.06)
    published = "SELECT count(*) FROM idempotency_outbox WHERE published_at IS NOT NULL"
    wait_until(lambda: query(clean_db, published)[0][0] > 0, 60, "a first publish")
    thread = threading.Thread(target=outage)
    thread.start()
    try:  # the other 50 during the cut
        charge_ids += create_charges(api.url, 50, run + "-cut", pace=0.06)
    finally:
        thread.join(60)
    settle(clean_db, len(charge_ids))
    figures = check_exactly_one_receipt_per_charge(clean_db, charge_ids, amqp_url, env)
    retries, reconnects = relay_retries(), consumer_reconnects()
    figures |= {"relay_retries": retries, "consumer_reconnects": reconnects}
    print(f"{figures} in {time.monotonic() - started:.1f} s")
    # Both sides saw the outage and came back by themselves (no process restarted).
    assert retries >= 1 and reconnects >= 2
    assert all(proc.poll() is None for proc in svc.procs.values())
