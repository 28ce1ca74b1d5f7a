"""Recovery: ``flask idempotency recover``, ``recover=`` routes and recovery points.

In process, on real PostgreSQL, with the example app and its fakes. A dead
worker is a request thread held at a gate (the lease keeper is off, so its
lease lapses as a dead one's would); the lease is then ended by moving the
record's clock back rather than by sleeping. The crash drills with real
processes are in ``tests/reliability/test_recovery.py``.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import psycopg2
import pytest
from flask import Flask, Request
from werkzeug.test import TestResponse

from example_app import create_app
from example_app.auth import owner_of
from example_app.fulfilment import FakeFulfilment, FulfilmentUnavailable, InProcessFulfilmentClient
from example_app.processor_client import (
    ChargeOutcome,
    InProcessProcessorClient,
    LookupOutcome,
    ProcessorUnavailable,
)
from example_app.processor_core import FakeProcessor
from flask_idempotency import Abandoned, Idempotency, digests
from flask_idempotency.recovery import capture
from flask_idempotency.route_options import route_options

TOKEN = "sk_test_recovery"
CHARGE: dict[str, Any] = {
    "amount": 1500,
    "currency": "usd",
    "customer": "cus_r",
    "source": "tok_visa",
}
ORDER: dict[str, Any] = {
    "sku": "sku_1",
    "quantity": 2,
    "amount": 2500,
    "currency": "eur",
    "customer": "cus_o",
    "source": "tok_visa",
}
#: The gate's longest wait: a test that forgets to open it fails instead of hanging.
GATE_TIMEOUT = 20.0


class Gate:
    """Holds the caller (a request thread) until opened: a worker frozen at a point."""

    def __init__(self) -> None:
        self.reached = threading.Event()
        self.opened = threading.Event()

    def hold(self) -> None:
        self.reached.set()
        assert self.opened.wait(GATE_TIMEOUT), "the gate was never opened"


class GatedProcessor(InProcessProcessorClient):
    """The in-process processor, with the charge call held before or after it acts.

    Once opened, a held call answers "unavailable": the worker it stands for died.
    """

    def __init__(self, processor: FakeProcessor, *, after_charge: bool) -> None:
        super().__init__(processor, 2.0)
        self.after_charge = after_charge
        self.gate: Gate | None = None
        self.lookup_down = False
        self.lookup_delay = 0.0

    def charge(
        self, idempotency_key: str, amount: int, currency: str, customer: str, source: str
    ) -> ChargeOutcome:
        gate, self.gate = self.gate, None
        if gate is None:
            return super().charge(idempotency_key, amount, currency, customer, source)
        if self.after_charge:
            super().charge(idempotency_key, amount, currency, customer, source)
        gate.hold()
        return ProcessorUnavailable("the worker died")

    def lookup(self, idempotency_key: str) -> LookupOutcome:
        time.sleep(self.lookup_delay)
        if self.lookup_down:
            return ProcessorUnavailable("lookup down")
        return super().lookup(idempotency_key)


class GatedFulfilment(InProcessFulfilmentClient):
    """The in-process warehouse and mailer; ``gates[kind]`` holds that call first."""

    def __init__(self, fake: FakeFulfilment) -> None:
        super().__init__(fake)
        self.gates: dict[str, Gate] = {}
        self.down: set[str] = set()

    def _send(self, kind: str, key: str, body: dict[str, Any]) -> tuple[int, Any]:
        gate = self.gates.pop(kind, None)
        if gate is not None:
            gate.hold()
            raise FulfilmentUnavailable("the worker died")
        if kind in self.down:
            raise FulfilmentUnavailable(f"{kind} down")
        return super()._send(kind, key, body)


@pytest.fixture
def processor() -> FakeProcessor:
    return FakeProcessor()


@pytest.fixture
def fulfilment() -> FakeFulfilment:
    return FakeFulfilment()


Build = Callable[..., Flask]


@pytest.fixture
def build(clean_db: str, processor: FakeProcessor, fulfilment: FakeFulfilment) -> Iterator[Build]:
    apps: list[Flask] = []

    def make(**config: Any) -> Flask:
        base: dict[str, Any] = {
            "DATABASE_URL": clean_db,
            "REDIS_URL": None,
            "PROCESSOR_URL": None,
            "PROCESSOR_CLIENT": GatedProcessor(processor, after_charge=True),
            "FULFILMENT_CLIENT": GatedFulfilment(fulfilment),
            # A frozen holder's lease must lapse, as a dead one's does.
            "IDEMPOTENCY_LEASE_RENEW_INTERVAL": 0,
        }
        app = create_app(base | config)
        apps.append(app)
        return app

    yield make
    for app in apps:
        app.extensions["idempotency"].close()


def headers(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKEN}", "Idempotency-Key": key}


def post(app: Flask, path: str, key: str, body: dict[str, Any]) -> TestResponse:
    return app.test_client().post(path, json=body, headers=headers(key))


def query(database_url: str, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    with psycopg2.connect(database_url) as conn, conn.cursor() as cur:
        cur.execute(sql, params)
        rows = cur.fetchall() if cur.description else []
    conn.close()
    return rows


def end_leases(database_url: str, seconds_ago: float = 1.0) -> None:
    """What a dead holder's lease does with time: it ends."""
    query(
        database_url,
        "UPDATE idempotency_records SET lease_expires_at = now() - make_interval(secs => %s)"
        " WHERE state = 'processing'",
        (seconds_ago,),
    )


def recover(app: Flask, *args: str) -> Any:
    result = app.test_cli_runner().invoke(
        args=["idempotency", "recover", "--once", "--older-than", "0", *args]
    )
    assert result.exit_code == 0, result.output
    return result


def processor_key(key: str, purpose: str = "processor") -> str:
    return digests.derived_key(digests.record_key(owner_of(TOKEN), key), purpose)


def frozen_request(
    pool: ThreadPoolExecutor, gate: Gate, send: Callable[[], TestResponse]
) -> Future[TestResponse]:
    """Start a request that freezes at ``gate`` (a worker that died there)."""
    future = pool.submit(send)
    assert gate.reached.wait(GATE_TIMEOUT), "the request never reached the gate"
    return future


# -- recover= on the charges route ---------------------------------------------------


def test_recover_records_the_charge_a_dead_worker_left_and_retries_replay_it(
    build: Build, processor: FakeProcessor, clean_db: str
) -> None:
    app = build()
    client: GatedProcessor = app.extensions["processor_client"]
    client.gate = gate = Gate()
    with ThreadPoolExecutor(1) as pool:
        dead = frozen_request(pool, gate, lambda: post(app, "/v1/charges", "k1", CHARGE))
        assert processor.charges_for(processor_key("k1")) == 1  # charged, not recorded
        assert query(clean_db, "SELECT count(*) FROM charges") == [(0,)]
        end_leases(clean_db)

        assert "recovered 1, released 0" in recover(app).output

        rows = query(clean_db, "SELECT id, payment_id, customer, owner FROM charges")
        assert len(rows) == 1
        payment = processor.ledger()[0].payment_id
        assert rows[0][1:] == (payment, "cus_r", owner_of(TOKEN))
        events = query(clean_db, "SELECT event_type FROM idempotency_outbox")
        assert events == [("charge.succeeded",)]
        state, recovery_left = query(
            clean_db, "SELECT state, recovery IS NOT NULL FROM idempotency_records"
        )[0]
        assert (state, recovery_left) == ("completed", False)  # the request is not kept

        retry = post(app, "/v1/charges", "k1", CHARGE)
        assert retry.status_code == 201 and retry.headers["Idempotent-Replayed"] == "true"
        assert retry.get_json()["id"] == rows[0][0]
        assert post(app, "/v1/charges", "k1", CHARGE).data == retry.data
        assert retry.headers["Location"] == f"/v1/charges/{rows[0][0]}"

        # The frozen worker wakes up: its attempt was taken over, and is fenced.
        gate.opened.set()
        assert dead.result(GATE_TIMEOUT).status_code in (409, 502)
    assert processor.charges_for(processor_key("k1")) == 1
    assert query(clean_db, "SELECT count(*) FROM charges") == [(1,)]
    stats = app.test_cli_runner().invoke(args=["idempotency", "stats"]).output
    assert "abandoned: 0" in stats and "recovered: 1" in stats


def test_recover_releases_an_attempt_the_processor_never_saw(
    build: Build, processor: FakeProcessor, clean_db: str
) -> None:
    app = build(PROCESSOR_CLIENT=GatedProcessor(processor, after_charge=False))
    client: GatedProcessor = app.extensions["processor_client"]
    client.gate = gate = Gate()
    with ThreadPoolExecutor(1) as pool:
        dead = frozen_request(pool, gate, lambda: post(app, "/v1/charges", "k2", CHARGE))
        end_leases(clean_db)
        stats = app.test_cli_runner().invoke(args=["idempotency", "stats"]).output
        assert "abandoned: 1" in stats and "recoverable: 1" in stats

        assert "recovered 0, released 1" in recover(app).output
        assert query(clean_db, "SELECT count(*) FROM idempotency_records") == [(0,)]
        gate.opened.set()
        dead.result(GATE_TIMEOUT)

    retry = post(app, "/v1/charges", "k2", CHARGE)
    assert retry.status_code == 201 and retry.headers["Idempotent-Replayed"] == "false"
    assert processor.charges_for(processor_key("k2")) == 1
    assert query(clean_db, "SELECT count(*) FROM charges") == [(1,)]
    stats = app.test_cli_runner().invoke(args=["idempotency", "stats"]).output
    assert "recovery_released: 1" in stats


def test_an_unknown_outcome_is_handed_back_for_the_next_pass(
    build: Build, processor: FakeProcessor, clean_db: str
) -> None:
    app = build()
    client: GatedProcessor = app.extensions["processor_client"]
    client.gate = gate = Gate()
    with ThreadPoolExecutor(1) as pool:
        dead = frozen_request(pool, gate, lambda: post(app, "/v1/charges", "k3", CHARGE))
        end_leases(clean_db)
        client.lookup_down = True
        assert "deferred 1" in recover(app).output
        # Abandoned again at once, for the next pass or the client's own retry.
        left = query(clean_db, "SELECT state, lease_expires_at <= now() FROM idempotency_records")
        assert left == [("processing", True)]
        client.lookup_down = False
        assert "recovered 1" in recover(app).output
        gate.opened.set()
        dead.result(GATE_TIMEOUT)
    assert query(clean_db, "SELECT count(*) FROM charges") == [(1,)]


def test_live_and_recent_attempts_are_left_to_their_holder(build: Build, clean_db: str) -> None:
    app = build()
    client: GatedProcessor = app.extensions["processor_client"]
    client.gate = gate = Gate()
    with ThreadPoolExecutor(1) as pool:
        dead = frozen_request(pool, gate, lambda: post(app, "/v1/charges", "k4", CHARGE))
        assert "recovered 0, released 0, deferred 0" in recover(app).output  # lease live
        end_leases(clean_db, seconds_ago=5)
        runner = app.test_cli_runner()
        later = runner.invoke(args=["idempotency", "recover", "--once", "--older-than", "60"])
        assert "recovered 0, released 0" in later.output  # its client may still retry
        gate.opened.set()
        dead.result(GATE_TIMEOUT)


def test_a_client_retry_and_the_completer_never_make_two_charges(
    build: Build, processor: FakeProcessor, clean_db: str
) -> None:
    app = build()
    client: GatedProcessor = app.extensions["processor_client"]
    count = 8
    with ThreadPoolExecutor(count * 2 + 1) as pool:
        frozen = []
        for n in range(count):
            client.gate = gate = Gate()
            send = functools.partial(post, app, "/v1/charges", f"r{n}", CHARGE)
            frozen.append((gate, frozen_request(pool, gate, send)))
        end_leases(clean_db)
        client.lookup_delay = 0.03  # each recovery takes a while: the retries interleave
        completer = pool.submit(recover, app, "--batch-size", "2")
        retries = []
        for n in reversed(range(count)):  # the completer starts at the other end
            retries.append(pool.submit(post, app, "/v1/charges", f"r{n}", CHARGE))
            time.sleep(0.03)
        answers = [future.result(GATE_TIMEOUT) for future in retries]
        recovered = completer.result(GATE_TIMEOUT).output.strip()
        for gate, dead in frozen:
            gate.opened.set()
            dead.result(GATE_TIMEOUT)
    # A retry that found the completer holding the record got a 409; once more, a replay.
    final = [post(app, "/v1/charges", f"r{n}", CHARGE) for n in range(count)]
    assert {a.status_code for a in answers} <= {201, 409}
    assert all(answer.status_code == 201 for answer in final)
    rows = query(clean_db, "SELECT id, payment_id FROM charges")
    assert len(rows) == count and len({payment for _, payment in rows}) == count
    assert sorted(a.get_json()["id"] for a in final) == sorted(r[0] for r in rows)
    assert all(processor.charges_for(processor_key(f"r{n}")) == 1 for n in range(count))
    ran = sum(1 for a in answers if a.headers.get("Idempotent-Replayed") == "false")
    print(f"race: completer: {recovered}; retries that ran the view: {ran} of {count}")


def test_recover_refuses_under_transaction_mode(build: Build) -> None:
    app = build(IDEMPOTENCY_CLAIM_MODE="transaction")
    result = app.test_cli_runner().invoke(args=["idempotency", "recover", "--once"])
    assert result.exit_code != 0
    assert "IDEMPOTENCY_CLAIM_MODE = 'row'" in result.output
    # The route itself still serves (a mode switch must not take payments down).
    assert post(app, "/v1/charges", "t1", CHARGE).status_code == 201
    assert post(app, "/v1/orders", "t2", ORDER).status_code == 201


# -- recovery points (idempotency.phase) ---------------------------------------------


def calls(fulfilment: FakeFulfilment, processor: FakeProcessor, key: str) -> dict[str, int]:
    """External calls per step of the order under ``key``."""
    counted = {"reserve": 0, "charge": processor.calls_for(processor_key(key))}
    counted["notify"] = 0
    for call in fulfilment.calls():
        if call.key == processor_key(key, "reserve"):
            counted["reserve"] += 1
        elif call.key == processor_key(key, "notify"):
            counted["notify"] += 1
    return counted


def test_a_takeover_resumes_after_the_last_committed_phase(
    build: Build, processor: FakeProcessor, fulfilment: FakeFulfilment, clean_db: str
) -> None:
    app = build()
    mailer: GatedFulfilment = app.extensions["fulfilment_client"]
    mailer.gates["notification"] = gate = Gate()
    with ThreadPoolExecutor(1) as pool:
        dead = frozen_request(pool, gate, lambda: post(app, "/v1/orders", "o1", ORDER))
        phases = query(clean_db, "SELECT phases FROM idempotency_records")[0][0]
        assert [name for name, _ in phases] == ["reserve", "charge"]
        assert query(clean_db, "SELECT status FROM orders") == [("paid",)]  # committed
        end_leases(clean_db)

        retry = post(app, "/v1/orders", "o1", ORDER)  # the client's retry takes it over
        assert retry.status_code == 201, retry.data
        order = retry.get_json()
        assert order["status"] == "confirmed" and order["payment"] == phases[1][1]["payment"]
        gate.opened.set()
        assert dead.result(GATE_TIMEOUT).status_code == 502  # its release touched nothing
    assert calls(fulfilment, processor, "o1") == {"reserve": 1, "charge": 1, "notify": 1}
    assert query(clean_db, "SELECT count(*), min(status) FROM orders") == [(1, "confirmed")]
    assert post(app, "/v1/orders", "o1", ORDER).data == retry.data


def test_the_completer_resumes_an_order_after_its_last_phase(
    build: Build, processor: FakeProcessor, fulfilment: FakeFulfilment, clean_db: str
) -> None:
    app = build()
    client: GatedProcessor = app.extensions["processor_client"]
    client.gate = gate = Gate()  # dies in the charge step, after the processor acted
    with ThreadPoolExecutor(1) as pool:
        dead = frozen_request(pool, gate, lambda: post(app, "/v1/orders", "o2", ORDER))
        end_leases(clean_db)
        assert "recovered 1" in recover(app).output
        gate.opened.set()
        dead.result(GATE_TIMEOUT)
    # The charge step ran again, but under its derived key: one payment, replayed.
    assert processor.charges_for(processor_key("o2")) == 1
    assert calls(fulfilment, processor, "o2") == {"reserve": 1, "charge": 2, "notify": 1}
    replay = post(app, "/v1/orders", "o2", ORDER)
    assert replay.status_code == 201 and replay.headers["Idempotent-Replayed"] == "true"
    assert replay.get_json()["status"] == "confirmed"


def test_a_failed_step_keeps_the_committed_ones_for_the_retry(
    build: Build, processor: FakeProcessor, fulfilment: FakeFulfilment, clean_db: str
) -> None:
    app = build()
    mailer: GatedFulfilment = app.extensions["fulfilment_client"]
    mailer.down.add("notification")
    failed = post(app, "/v1/orders", "o3", ORDER)
    assert failed.status_code == 502
    # Not deleted: its phases' writes stand. Its lease ended at once, so the retry
    # needs no wait; a different request under the key is refused meanwhile.
    left = query(
        clean_db, "SELECT state, lease_expires_at <= now(), phases FROM idempotency_records"
    )
    assert [(s, ended, [p[0] for p in ph]) for s, ended, ph in left] == [
        ("processing", True, ["reserve", "charge"])
    ]
    assert post(app, "/v1/orders", "o3", ORDER | {"quantity": 3}).status_code == 422
    mailer.down.clear()
    retry = post(app, "/v1/orders", "o3", ORDER)
    assert retry.status_code == 201
    # (The mailer that was down never saw the first try.)
    assert calls(fulfilment, processor, "o3") == {"reserve": 1, "charge": 1, "notify": 1}


def test_phases_run_in_the_one_transaction_under_transaction_mode(
    build: Build, processor: FakeProcessor, fulfilment: FakeFulfilment, clean_db: str
) -> None:
    app = build(IDEMPOTENCY_CLAIM_MODE="transaction")
    mailer: GatedFulfilment = app.extensions["fulfilment_client"]
    mailer.down.add("notification")
    assert post(app, "/v1/orders", "o4", ORDER).status_code == 502
    assert query(clean_db, "SELECT count(*) FROM orders") == [(0,)]  # all rolled back
    assert query(clean_db, "SELECT count(*) FROM idempotency_records") == [(0,)]
    mailer.down.clear()
    assert post(app, "/v1/orders", "o4", ORDER).status_code == 201
    # Every step ran again (replayed under its derived key): nothing was kept.
    assert calls(fulfilment, processor, "o4") == {"reserve": 2, "charge": 2, "notify": 1}
    assert processor.charges_for(processor_key("o4")) == 1


def test_phase_misuse_is_an_error(clean_db: str) -> None:
    app = Flask(__name__)
    app.config.update(
        TESTING=True, IDEMPOTENCY_DATABASE_URL=clean_db, IDEMPOTENCY_AUTO_MIGRATE=True
    )
    idempotency = Idempotency(app)

    @app.post("/twice")
    @idempotency.required
    def twice() -> str:
        idempotency.phase("a", lambda: 1)
        idempotency.phase("a", lambda: 2)
        return "never"

    @app.post("/not-json")
    @idempotency.required
    def not_json() -> str:
        idempotency.phase("a", lambda: object())
        return "never"

    try:
        client = app.test_client()
        sent = {"Authorization": "Bearer x", "Idempotency-Key": "p1"}
        with pytest.raises(RuntimeError, match="reached twice"):
            client.post("/twice", headers=sent)
        with pytest.raises(TypeError, match="must return JSON"):
            client.post("/not-json", headers=sent | {"Idempotency-Key": "p2"})
        with app.test_request_context(), pytest.raises(RuntimeError):
            idempotency.phase("a", lambda: 1)
    finally:
        app.extensions["idempotency"].close()


# -- the parts ----------------------------------------------------------------------


def test_route_options_for_recovery_are_checked_when_the_decorator_is_applied() -> None:
    common: dict[str, Any] = dict(
        ttl=None, lease=None, wait=None, should_store=None, scope_func=None, fingerprint_func=None
    )
    with pytest.raises(ValueError, match="recover= must be callable"):
        route_options(True, recover="no", **common)
    with pytest.raises(ValueError, match="only kept for recover="):
        route_options(True, recovery_data=lambda request: None, **common)
    assert route_options(True, recover=lambda a: None, **common).recover is not None


def test_the_stored_request_comes_back_as_it_was() -> None:
    app = Flask(__name__)

    def data(request: Request) -> dict[str, str]:
        return {"owner": "o"}

    options = route_options(
        True,
        ttl=None,
        lease=None,
        wait=None,
        should_store=None,
        scope_func=None,
        fingerprint_func=None,
        recover=lambda a: None,
        recovery_data=data,
    )
    app.add_url_rule("/v1/x", "x", lambda: "", methods=["POST"])
    body = b'{"amount": 1500, "note": "caf\\u00e9"}'
    with app.test_request_context(
        "/v1/x?expand=1", method="POST", data=body, content_type="application/json"
    ) as ctx:
        raw = capture(options, ctx.request)
    attempt = Abandoned.from_payload(raw, b"k" * 32, {"reserve": {"id": 1}}, 3.0)
    assert (attempt.endpoint, attempt.method, attempt.path, attempt.query) == (
        "x",
        "POST",
        "/v1/x",
        "expand=1",
    )
    assert attempt.body == body and attempt.data == {"owner": "o"}
    assert attempt.derived_key("processor") == digests.derived_key(b"k" * 32, "processor")
    with app.request_context(attempt.environ()) as rebuilt:
        assert rebuilt.request.get_json() == {"amount": 1500, "note": "café"}
        assert rebuilt.request.args["expand"] == "1"
    with pytest.raises(ValueError):
        Abandoned.from_payload(b'{"v": 99}', b"", {}, 0.0)
