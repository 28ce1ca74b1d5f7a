"""The example payments API (CONTRACT §2) through Flask's test client.

Real PostgreSQL (the run's ``clean_db``), the fake processor in process: each
route and each error of the contract, one test (or one parametrized row) each.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg2
import pytest
from flask import Flask
from flask.testing import FlaskClient
from werkzeug.test import TestResponse

from example_app import create_app
from example_app.auth import owner_of
from example_app.config import config_from_env
from example_app.processor_client import InProcessProcessorClient
from example_app.processor_core import FakeProcessor
from flask_idempotency import digests
from support.servers import ProxyFactory
from support.waiting import wait_until

BuildApp = Callable[..., Flask]
REPO_ROOT = Path(__file__).resolve().parents[2]

TOKEN = "sk_test_alice"
OTHER_TOKEN = "sk_test_bob"
BODY: dict[str, Any] = {
    "amount": 1500,
    "currency": "usd",
    "customer": "cus_1",
    "source": "tok_visa",
}


@pytest.fixture
def processor() -> FakeProcessor:
    return FakeProcessor()


@pytest.fixture
def build_app(clean_db: str, processor: FakeProcessor) -> Iterator[BuildApp]:
    """Factory: the payments app on a clean database and this test's fake processor."""
    apps: list[Flask] = []

    def build(**config: Any) -> Flask:
        base: dict[str, Any] = {
            "TESTING": True,
            "DATABASE_URL": clean_db,
            "REDIS_URL": None,
            "PROCESSOR_URL": None,
            "PROCESSOR_CLIENT": InProcessProcessorClient(processor, 2.0),
        }
        app = create_app(base | config)
        apps.append(app)
        return app

    yield build
    for app in apps:
        app.extensions["idempotency"].close()


@pytest.fixture
def client(build_app: BuildApp) -> FlaskClient:
    return build_app().test_client()


def headers(key: str | None = "key-1", token: str | None = TOKEN) -> dict[str, str]:
    sent = {}
    if token is not None:
        sent["Authorization"] = f"Bearer {token}"
    if key is not None:
        sent["Idempotency-Key"] = key
    return sent


def post_charge(
    client: FlaskClient, key: str | None = "key-1", token: str | None = TOKEN, **changes: Any
) -> TestResponse:
    return client.post("/v1/charges", json=BODY | changes, headers=headers(key, token))


def processor_key(token: str, key: str) -> str:
    """The key the app must send to the processor for (API key, Idempotency-Key)."""
    return digests.derived_key(digests.record_key(owner_of(token), key), "processor")


def error_of(response: TestResponse) -> dict[str, Any]:
    assert response.mimetype == "application/json", response.data
    error: dict[str, Any] = response.get_json()["error"]
    return error


def charge_rows(database_url: str) -> list[tuple[Any, ...]]:
    with psycopg2.connect(database_url) as conn, conn.cursor() as cur:
        cur.execute("SELECT id, customer, amount, currency, payment_id FROM charges ORDER BY seq")
        rows = cur.fetchall()
    conn.close()
    return rows


def execute(database_url: str, query: str, params: tuple[Any, ...] = ()) -> None:
    with psycopg2.connect(database_url) as conn, conn.cursor() as cur:
        cur.execute(query, params)
    conn.close()


# -- POST /v1/charges --------------------------------------------------------------


def test_charge_created_once_and_replayed(
    client: FlaskClient, processor: FakeProcessor, clean_db: str
) -> None:
    first = post_charge(client, currency="USD")
    assert first.status_code == 201
    assert first.headers["Idempotent-Replayed"] == "false"
    charge = first.get_json()
    assert set(charge) == {
        "id", "object", "amount", "currency", "customer", "status", "created"
    }  # fmt: skip
    assert charge["id"].startswith("ch_") and charge["object"] == "charge"
    assert (charge["amount"], charge["currency"], charge["customer"]) == (1500, "usd", "cus_1")
    assert charge["status"] == "succeeded"
    assert isinstance(charge["created"], int) and abs(charge["created"] - time.time()) < 60
    assert first.headers["Location"] == f"/v1/charges/{charge['id']}"

    again = post_charge(client, currency="USD")
    assert again.status_code == 201
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.data == first.data
    assert again.headers["Location"] == first.headers["Location"]

    assert processor.charges_for(processor_key(TOKEN, "key-1")) == 1
    assert processor.calls_for(processor_key(TOKEN, "key-1")) == 1
    assert [(r[0], r[3]) for r in charge_rows(clean_db)] == [(charge["id"], "usd")]
    assert client.get(first.headers["Location"], headers=headers()).get_json() == charge


@pytest.mark.parametrize(
    "authorization",
    [None, "", "Bearer", "Bearer ", "Bearer   ", "Basic c2tfdGVzdDo=", "Token sk_1", "sk_1",
     "Bearer a b"],
)  # fmt: skip
def test_missing_api_key_is_401(client: FlaskClient, authorization: str | None) -> None:
    sent = {"Idempotency-Key": "k"}
    if authorization is not None:
        sent["Authorization"] = authorization
    for method, path in [
        ("POST", "/v1/charges"),
        ("GET", "/v1/charges?customer=c"),
        ("GET", "/v1/charges/ch_" + "0" * 24),
    ]:
        response = client.open(path, method=method, json=BODY, headers=sent)
        assert response.status_code == 401, path
        error = error_of(response)
        assert (error["type"], error["code"]) == ("authentication_error", "missing_api_key")
        assert response.headers["WWW-Authenticate"].startswith("Bearer")
        assert "Idempotent-Replayed" not in response.headers


def test_bearer_scheme_is_case_insensitive(client: FlaskClient) -> None:
    sent = {"Authorization": f"bEaReR  {TOKEN} ", "Idempotency-Key": "k"}
    assert client.post("/v1/charges", json=BODY, headers=sent).status_code == 201


def test_401_is_not_stored(client: FlaskClient) -> None:
    assert post_charge(client, token=None).status_code == 401
    response = post_charge(client)
    assert response.status_code == 201
    assert response.headers["Idempotent-Replayed"] == "false"


def test_idempotency_key_required(client: FlaskClient) -> None:
    response = post_charge(client, key=None)
    assert response.status_code == 400
    assert error_of(response)["code"] == "missing_key"


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"amount": 100.0}, "amount"),
        ({"amount": True}, "amount"),
        ({"amount": "100"}, "amount"),
        ({"amount": 0}, "amount"),
        ({"amount": -5}, "amount"),
        ({"amount": 100_000_000}, "amount"),
        ({"amount": None}, "amount"),
        ({"currency": "us"}, "currency"),
        ({"currency": "usdd"}, "currency"),
        ({"currency": "us1"}, "currency"),
        ({"currency": "usd\n"}, "currency"),
        ({"currency": "ÜSD"}, "currency"),
        ({"currency": 840}, "currency"),
        ({"customer": ""}, "customer"),
        ({"customer": "c" * 65}, "customer"),
        ({"customer": 7}, "customer"),
        ({"customer": "a\x00b"}, "customer"),
        ({"customer": "\ud800"}, "customer"),
        ({"source": ""}, "source"),
        ({"source": ["tok_visa"]}, "source"),
        ({"description": 5}, "description"),
        ({"description": {"a": 1}}, "description"),
        ({"metadata": {}}, "metadata"),
    ],
)
def test_invalid_fields_are_400_validation_failed(
    client: FlaskClient, processor: FakeProcessor, changes: dict[str, Any], field: str
) -> None:
    response = post_charge(client, **changes)
    assert response.status_code == 400
    error = error_of(response)
    assert (error["type"], error["code"]) == ("invalid_request_error", "validation_failed")
    assert list(error["fields"]) == [field]
    assert all(isinstance(m, str) for m in error["fields"][field])
    assert processor.ledger() == []


@pytest.mark.parametrize("missing", ["amount", "currency", "customer", "source"])
def test_required_fields(client: FlaskClient, missing: str) -> None:
    body = {k: v for k, v in BODY.items() if k != missing}
    response = client.post("/v1/charges", json=body, headers=headers())
    assert response.status_code == 400
    assert list(error_of(response)["fields"]) == [missing]


@pytest.mark.parametrize(
    "changes",
    [
        {"amount": 1},
        {"amount": 99_999_999},
        {"currency": "EuR"},
        {"customer": "c" * 64, "source": "s" * 64},
        {"description": None},
        {"description": "Order #1 ☕"},
    ],
)
def test_valid_edges_are_accepted(client: FlaskClient, changes: dict[str, Any]) -> None:
    response = post_charge(client, **changes)
    assert response.status_code == 201, response.data
    assert response.get_json()["currency"] == changes.get("currency", "usd").lower()


@pytest.mark.parametrize(
    ("content_type", "body", "code"),
    [
        ("application/json", b"", "invalid_json"),
        ("application/json", b"{", "invalid_json"),
        ("application/json", b'{"amount": NaN}', "invalid_json"),
        ("application/json", b"\xff\xfe\x00", "invalid_json"),
        ("application/json", b"[" * 100_000, "invalid_json"),
        ("application/json", b'{"amount": 1' + b"0" * 5000 + b"}", "invalid_json"),
        ("application/json", b"[]", "validation_failed"),
        ("application/json", b'"charge"', "validation_failed"),
        ("application/json", b"null", "validation_failed"),
        ("text/plain", json.dumps(BODY).encode(), "invalid_content_type"),
        ("application/x-www-form-urlencoded", b"amount=1500", "invalid_content_type"),
        (None, json.dumps(BODY).encode(), "invalid_content_type"),
    ],
)
def test_malformed_bodies_are_json_400(
    client: FlaskClient, content_type: str | None, body: bytes, code: str
) -> None:
    sent = headers()
    if content_type is not None:
        sent["Content-Type"] = content_type
    response = client.post("/v1/charges", data=body, headers=sent)
    assert response.status_code == 400
    error = error_of(response)
    assert (error["type"], error["code"]) == ("invalid_request_error", code)


def test_a_400_is_not_stored_so_a_corrected_retry_runs(client: FlaskClient) -> None:
    assert post_charge(client, amount=100.0).status_code == 400
    response = post_charge(client)
    assert response.status_code == 201
    assert response.headers["Idempotent-Replayed"] == "false"


def test_body_over_max_content_length_is_json_413(build_app: BuildApp) -> None:
    client = build_app(MAX_CONTENT_LENGTH=1024).test_client()
    response = post_charge(client, description="x" * 2000)
    assert response.status_code == 413
    assert error_of(response)["type"] == "invalid_request_error"
    assert post_charge(client, description="x" * 100).status_code == 201


def test_decline_is_402_stored_and_replayed(client: FlaskClient, processor: FakeProcessor) -> None:
    first = post_charge(client, source="tok_decline_insufficient_funds")
    assert first.status_code == 402
    assert first.headers["Idempotent-Replayed"] == "false"
    error = error_of(first)
    assert (error["type"], error["code"]) == ("card_error", "card_declined")
    again = post_charge(client, source="tok_decline_insufficient_funds")
    assert again.status_code == 402
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.data == first.data
    assert processor.calls_for(processor_key(TOKEN, "key-1")) == 1
    assert client.get("/v1/charges?customer=cus_1", headers=headers()).get_json()["data"] == []


@pytest.mark.parametrize("mode", ["500", "garbage", "timeout", "after_charge_500"])
def test_processor_failure_is_502_not_stored_and_a_retry_charges_once(
    build_app: BuildApp, processor: FakeProcessor, clean_db: str, mode: Any
) -> None:
    client = build_app(PROCESSOR_CLIENT=InProcessProcessorClient(processor, 0.3)).test_client()
    processor.set_hang_seconds(0.6)
    processor.fail_next(1, mode)
    first = post_charge(client)
    assert first.status_code == 502
    assert first.headers["Idempotent-Replayed"] == "false"
    error = error_of(first)
    assert (error["type"], error["code"]) == ("api_error", "processor_unavailable")
    assert charge_rows(clean_db) == []

    retry = post_charge(client)
    assert retry.status_code == 201, retry.data
    assert retry.headers["Idempotent-Replayed"] == "false"
    key = processor_key(TOKEN, "key-1")
    # A timed-out call is recorded when its hang ends.
    wait_until(lambda: processor.calls_for(key) >= 2, 5, "the timed-out call to be recorded")
    assert processor.calls_for(key) == 2
    assert processor.charges_for(key) == 1
    assert len(charge_rows(clean_db)) == 1


def test_processor_sees_one_derived_key_per_api_key_and_idempotency_key(
    client: FlaskClient, processor: FakeProcessor
) -> None:
    a = post_charge(client, token=TOKEN)
    b = post_charge(client, token=OTHER_TOKEN)
    assert a.status_code == b.status_code == 201
    assert b.headers["Idempotent-Replayed"] == "false"
    assert a.get_json()["id"] != b.get_json()["id"]
    assert processor.charges_for(processor_key(TOKEN, "key-1")) == 1
    assert processor.charges_for(processor_key(OTHER_TOKEN, "key-1")) == 1


def test_same_key_other_body_is_422(client: FlaskClient) -> None:
    assert post_charge(client).status_code == 201
    response = post_charge(client, amount=1600)
    assert response.status_code == 422
    assert error_of(response)["code"] == "key_reused"


# -- GET routes --------------------------------------------------------------------


def test_get_charge_and_other_keys_get_404(client: FlaskClient) -> None:
    charge = post_charge(client).get_json()
    mine = client.get(f"/v1/charges/{charge['id']}", headers=headers(None))
    assert mine.status_code == 200
    assert mine.get_json() == charge
    for path in (f"/v1/charges/{charge['id']}", "/v1/charges/ch_" + "0" * 24, "/v1/charges/x%00"):
        token = OTHER_TOKEN if path.endswith(charge["id"]) else TOKEN
        response = client.get(path, headers=headers(None, token))
        assert response.status_code == 404
        error = error_of(response)
        assert (error["type"], error["code"]) == ("invalid_request_error", "resource_missing")


def test_list_is_newest_first_with_ties_in_creation_order(
    client: FlaskClient, clean_db: str
) -> None:
    ids = [post_charge(client, key=f"k{i}").get_json()["id"] for i in range(4)]
    post_charge(client, key="other-customer", customer="cus_2")
    post_charge(client, key="other-api-key", token=OTHER_TOKEN)
    # Seed the clock: ids[0] oldest, ids[1] a minute later, ids[2] and ids[3] tied.
    # One statement, so one now(): separate ones could straddle a second boundary
    # and untie the tie.
    execute(
        clean_db,
        "UPDATE charges AS c SET created_at = date_trunc('second', now())"
        " - make_interval(secs => v.seconds_ago)"
        " FROM (VALUES (%s, 120), (%s, 60), (%s, 5), (%s, 5)) AS v(id, seconds_ago)"
        " WHERE c.id = v.id",
        tuple(ids),
    )
    response = client.get("/v1/charges?customer=cus_1", headers=headers(None))
    assert response.status_code == 200
    data = response.get_json()["data"]
    assert [c["id"] for c in data] == [ids[2], ids[3], ids[1], ids[0]]
    created = [c["created"] for c in data]
    assert created[0] == created[1] == created[2] + 55 == created[3] + 115
    assert all(c["customer"] == "cus_1" and c["object"] == "charge" for c in data)
    other = client.get("/v1/charges?customer=cus_1", headers=headers(None, OTHER_TOKEN))
    assert len(other.get_json()["data"]) == 1
    empty = client.get("/v1/charges?customer=nobody", headers=headers(None))
    assert empty.get_json() == {"data": []}


@pytest.mark.parametrize("query", ["", "?customer=", "?customer=" + "c" * 65, "?customer=a%00"])
def test_list_needs_a_valid_customer(client: FlaskClient, query: str) -> None:
    response = client.get("/v1/charges" + query, headers=headers(None))
    assert response.status_code == 400
    error = error_of(response)
    assert error["code"] == "validation_failed"
    assert list(error["fields"]) == ["customer"]


def test_unknown_route_and_method_are_json(client: FlaskClient) -> None:
    missing = client.get("/v2/nothing")
    assert missing.status_code == 404
    assert error_of(missing)["type"] == "invalid_request_error"
    wrong = client.delete("/v1/charges", headers=headers())
    assert wrong.status_code == 405
    assert error_of(wrong)["code"] == "method_not_allowed"
    assert "POST" in wrong.headers["Allow"]


def test_healthz(client: FlaskClient) -> None:
    response = client.get("/healthz")
    assert response.status_code == 200
    assert response.get_json()["status"] == "ok"


def test_healthz_names_a_forgotten_migrate(
    fresh_database_url: str, processor: FakeProcessor
) -> None:
    app = create_app(
        {
            "TESTING": True,
            "DATABASE_URL": fresh_database_url,
            "REDIS_URL": None,
            "PROCESSOR_URL": None,
            "PROCESSOR_CLIENT": InProcessProcessorClient(processor, 2.0),
            "IDEMPOTENCY_AUTO_MIGRATE": False,
        }
    )
    try:
        response = app.test_client().get("/healthz")
        assert response.status_code == 500
        assert "Retry-After" not in response.headers
        assert response.get_json() == {"status": "misconfigured", "postgres": "schema_missing"}
    finally:
        app.extensions["idempotency"].close()


# -- PostgreSQL down ----------------------------------------------------------------


def test_every_route_is_503_while_postgres_is_down_but_a_redis_replay(
    build_app: BuildApp, clean_db: str, clean_redis: str, tcp_proxy: ProxyFactory
) -> None:
    proxy = tcp_proxy(clean_db)
    app = build_app(DATABASE_URL=proxy.url, REDIS_URL=clean_redis)
    client = app.test_client()
    first = post_charge(client)
    assert first.status_code == 201
    # Retried once while PostgreSQL answers: that replay copies the answer to Redis
    # (IDEMPOTENCY_REDIS_OPTIONS["fill"] = "replay", the default).
    assert post_charge(client).headers["Idempotent-Replayed"] == "true"
    proxy.cut()

    replay = post_charge(client)
    assert (replay.status_code, replay.headers["Idempotent-Replayed"]) == (201, "true")
    assert replay.data == first.data
    down = [
        post_charge(client, key="new-key"),
        client.get(first.headers["Location"], headers=headers(None)),
        client.get("/v1/charges?customer=cus_1", headers=headers(None)),
    ]
    for response in down:
        assert response.status_code == 503
        assert error_of(response)["code"] == "store_unavailable"
        assert response.headers["Retry-After"].isdigit()
    health = client.get("/healthz")
    assert health.status_code == 503
    assert health.get_json()["status"] == "unavailable"

    proxy.restore()
    assert client.get("/healthz").status_code == 200
    assert post_charge(client, key="new-key").status_code == 201


# -- configuration and start-up -----------------------------------------------------


def test_config_from_env_defaults_and_values() -> None:
    assert config_from_env({}) == {
        "DATABASE_URL": None,
        "REDIS_URL": None,
        "PROCESSOR_URL": None,
        "PROCESSOR_TIMEOUT_SECONDS": 10.0,
        "IDEMPOTENCY_LEASE": 30.0,
        "IDEMPOTENCY_TTL": 86400.0,
        "MAX_CONTENT_LENGTH": 1048576,
        "IDEMPOTENCY_PROFILE": "stripe",
        "IDEMPOTENCY_CLAIM_MODE": "row",
        "FULFILMENT_URL": None,
        "CRASH_DRILL_DELAY_SECONDS": 0.0,
    }
    env = {
        "DATABASE_URL": "postgresql://db/x",
        "REDIS_URL": "redis://r/1",
        "PROCESSOR_URL": "http://p:8001",
        "PROCESSOR_TIMEOUT_SECONDS": "2.5",
        "IDEMPOTENCY_LEASE_SECONDS": "5",
        "IDEMPOTENCY_TTL_SECONDS": "60",
        "MAX_CONTENT_LENGTH": "2048",
        "IDEMPOTENCY_PROFILE": "ietf",
        "FULFILMENT_URL": "http://f:8002",
        "CRASH_DRILL_DELAY_SECONDS": "1.5",
        "IDEMPOTENCY_POOL_SIZE": "32",
    }
    config = config_from_env(env)
    assert config["PROCESSOR_TIMEOUT_SECONDS"] == 2.5 and config["IDEMPOTENCY_LEASE"] == 5.0
    assert config["IDEMPOTENCY_TTL"] == 60.0 and config["MAX_CONTENT_LENGTH"] == 2048
    assert config["IDEMPOTENCY_PROFILE"] == "ietf"
    assert config["FULFILMENT_URL"] == "http://f:8002"
    assert config["CRASH_DRILL_DELAY_SECONDS"] == 1.5
    assert config["IDEMPOTENCY_DATABASE_OPTIONS"] == {"pool_size": 32}  # --threads 32 needs as many


def test_the_example_app_speaks_the_ietf_profile_when_asked(
    clean_db: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    monkeypatch.setenv("IDEMPOTENCY_PROFILE", "ietf")
    app = create_app({"DATABASE_URL": clean_db}, instance_path=str(tmp_path))
    try:
        missing = app.test_client().post(
            "/v1/charges", json={}, headers={"Authorization": "Bearer sk_ietf"}
        )
        assert missing.status_code == 400
        assert missing.content_type == "application/problem+json"
        assert missing.get_json()["code"] == "missing_key"
    finally:
        app.extensions["idempotency"].close()


def test_an_unknown_profile_stops_the_start(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    monkeypatch.setenv("IDEMPOTENCY_PROFILE", "soap")
    with pytest.raises(ValueError, match="IDEMPOTENCY_PROFILE"):
        create_app({"DATABASE_URL": "postgresql://unused/x"}, instance_path=str(tmp_path))


@pytest.mark.parametrize(
    "env",
    [
        {"PROCESSOR_TIMEOUT_SECONDS": "ten"},
        {"PROCESSOR_TIMEOUT_SECONDS": "-1"},
        {"IDEMPOTENCY_LEASE_SECONDS": "inf"},
        {"IDEMPOTENCY_TTL_SECONDS": "0"},
        {"MAX_CONTENT_LENGTH": "1.5"},
        {"MAX_CONTENT_LENGTH": "0"},
        {"IDEMPOTENCY_POOL_SIZE": "0"},
        {"IDEMPOTENCY_POOL_SIZE": "many"},
    ],
)
def test_bad_environment_values_fail_at_start(env: dict[str, str]) -> None:
    with pytest.raises(ValueError, match=next(iter(env))):
        config_from_env(env)


@pytest.mark.parametrize(("lease", "timeout"), [(10, 10), (5, 10)])
def test_lease_must_outlast_the_processor_timeout(
    build_app: BuildApp, lease: float, timeout: float
) -> None:
    with pytest.raises(ValueError, match="IDEMPOTENCY_LEASE_SECONDS"):
        build_app(IDEMPOTENCY_LEASE=lease, PROCESSOR_TIMEOUT_SECONDS=timeout)


def test_redis_url_and_migrations_reach_the_extension(
    build_app: BuildApp, clean_redis: str
) -> None:
    settings = build_app(REDIS_URL=clean_redis).extensions["idempotency"].settings
    assert settings.redis_url == clean_redis
    assert settings.lease == 30.0 and settings.ttl == 86400.0
    assert settings.migration_dirs == (str(REPO_ROOT / "migrations"),)


def test_cli_migrate_and_purge(build_app: BuildApp, clean_db: str) -> None:
    app = build_app()
    runner = app.test_cli_runner()
    migrated = runner.invoke(args=["idempotency", "migrate"])
    assert migrated.exit_code == 0, migrated.output
    assert "schema is up to date" in migrated.output

    client = app.test_client()
    old = post_charge(client, key="old")
    assert old.status_code == 201
    assert post_charge(client, key="fresh").status_code == 201
    execute(
        clean_db,
        "UPDATE idempotency_records SET expires_at = now() - interval '1 second'"
        " WHERE record_key = %s",
        (digests.record_key(owner_of(TOKEN), "old"),),
    )
    dry = runner.invoke(args=["idempotency", "purge", "--dry-run"])
    assert (dry.exit_code, dry.output.splitlines()) == (
        0,
        ["1 expired record(s) would be deleted", "0 published event(s) would be deleted"],
    )
    purged = runner.invoke(args=["idempotency", "purge", "--batch-size", "1"])
    assert (purged.exit_code, purged.output.strip()) == (0, "1 expired record(s) deleted")
    assert post_charge(client, key="fresh").headers["Idempotent-Replayed"] == "true"

    # The purged key runs again; the processor still knows its derived key and
    # answers with the same payment, which stays one charge.
    rerun = post_charge(client, key="old")
    assert (rerun.status_code, rerun.headers["Idempotent-Replayed"]) == (201, "false")
    assert rerun.get_json() == old.get_json()
    assert len(charge_rows(clean_db)) == 2


def test_flask_command_line_finds_the_factory(clean_db: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLASK_", "REDIS_"))}
    result = subprocess.run(
        [sys.executable, "-m", "flask", "--app", "example_app", "idempotency", "migrate"],
        env=env | {"DATABASE_URL": clean_db},
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "schema is up to date" in result.stdout


def test_without_database_url_an_embedded_postgres_starts(
    tmp_path: Path, processor: FakeProcessor, monkeypatch: pytest.MonkeyPatch
) -> None:
    from example_app.embedded import stop_embedded_postgres

    monkeypatch.delenv("DATABASE_URL", raising=False)
    monkeypatch.delenv("REDIS_URL", raising=False)
    instance = tmp_path / "instance"
    config = {"PROCESSOR_CLIENT": InProcessProcessorClient(processor, 2.0)}
    try:
        app = create_app(config, instance_path=str(instance))
        try:
            assert app.extensions["idempotency"].settings.database_url.startswith("postgresql:")
            client = app.test_client()
            assert client.get("/healthz").status_code == 200
            assert post_charge(client).status_code == 201
            assert post_charge(client).headers["Idempotent-Replayed"] == "true"
        finally:
            app.extensions["idempotency"].close()
        assert (instance / "pgdata" / "PG_VERSION").exists()
    finally:
        stop_embedded_postgres(str(instance))
