"""Isolation: one Idempotency-Key under many API keys is many independent records.

Ten tenants send the same key with the same body, eight times each, all at
once. Each tenant must get exactly one charge of its own and only ever its own
answer back: from PostgreSQL, and from Redis too (checked with PostgreSQL cut
off from the app, when only Redis can answer). A tenant that never used the
key must not be handed anyone else's cached answer.
"""

from __future__ import annotations

import json
from collections import defaultdict

import pytest

from .figures import Figures
from .load import Answer, Call, charge_body, charge_call, run_all, run_waves, status_counts
from .stack import Stack

pytestmark = pytest.mark.reliability

TENANTS = 10
CONCURRENT_PER_TENANT = 8


def test_one_key_under_many_api_keys_never_replays_another_tenants_answer(
    stack: Stack, run_id: str, figures: Figures
) -> None:
    assert stack.pg_proxy is not None
    key = f"iso-{run_id}shared-key"
    customer = f"{run_id}shared"
    body = charge_body(4242, customer)
    tenants = [f"sk_test_{run_id}tenant{t}" for t in range(TENANTS)]
    first_call = {t: charge_call(t, key, body, tag=t) for t in tenants}

    connections = stack.connections()
    try:
        storm = run_waves(
            connections, [[first_call[t] for t in tenants for _ in range(CONCURRENT_PER_TENANT)]]
        )
        from_postgres = run_all(connections, list(first_call.values()), threads=TENANTS)
        stack.pg_proxy.cut()
        try:
            from_redis = run_all(connections, list(first_call.values()), threads=TENANTS)
            stranger = connections.send(charge_call(f"sk_test_{run_id}stranger", key, body))
        finally:
            stack.pg_proxy.restore()
        # The same tenant spelled differently (scheme case, spacing) is the same tenant.
        respelled = [
            connections.send(_with_authorization(first_call[tenants[0]], f"bearer  {tenants[0]}")),
            connections.send(_with_authorization(first_call[tenants[1]], f"BEARER {tenants[1]}")),
        ]
        other_request = charge_body(4343, f"{run_id}other")
        other_tenant = connections.send(charge_call(f"sk_test_{run_id}other", key, other_request))
        same_tenant = connections.send(charge_call(tenants[2], key, other_request))
        ids_by_tenant: dict[str, str] = {}
        for answer in storm:
            if answer.replayed == "false":
                ids_by_tenant[answer.call.tag] = answer.json()["id"]
        own = connections.send(
            Call(
                "GET",
                f"/v1/charges/{ids_by_tenant[tenants[0]]}",
                (("Authorization", f"Bearer {tenants[0]}"),),
            )
        )
        foreign = connections.send(
            Call(
                "GET",
                f"/v1/charges/{ids_by_tenant[tenants[0]]}",
                (("Authorization", f"Bearer {tenants[1]}"),),
            )
        )
        listed = connections.send(
            Call(
                "GET",
                f"/v1/charges?customer={customer}",
                (("Authorization", f"Bearer {tenants[1]}"),),
            )
        )
    finally:
        connections.close()

    owner_of_id = {charge_id: tenant for tenant, charge_id in ids_by_tenant.items()}
    crossed = [
        a
        for a in storm + from_postgres + from_redis + respelled
        if 200 <= a.status < 300 and owner_of_id.get(a.json().get("id")) != a.call.tag
    ]
    calls_seen, charged = stack.processor_counts(customer)
    rows = stack.charge_rows(customer)
    figures(
        tenants=TENANTS,
        same_key_requests=len(storm),
        outcomes=status_counts(storm),
        charges_for_the_shared_key=charged[customer],
        charge_rows=rows[customer],
        replays_from_postgres=status_counts(from_postgres),
        replays_from_redis_with_postgres_cut=status_counts(from_redis),
        unknown_tenant_with_postgres_cut=stranger.describe(),
        cross_tenant_answers=len(crossed),
    )

    assert not crossed, f"{len(crossed)} answers carried another tenant's charge"
    by_tenant: dict[str, list[Answer]] = defaultdict(list)
    for answer in storm:
        by_tenant[answer.call.tag].append(answer)
    assert set(by_tenant) == set(tenants)
    for tenant, answers in by_tenant.items():
        assert all(a.status in (201, 409) for a in answers), status_counts(answers)
        assert sum(a.replayed == "false" for a in answers) == 1, f"{tenant}: ran != once"
        assert len({a.body for a in answers if a.status == 201}) == 1
    assert len(set(ids_by_tenant.values())) == TENANTS
    assert charged[customer] == TENANTS and calls_seen[customer] == TENANTS
    assert rows[customer] == TENANTS

    storm_body = {t: next(a.body for a in by_tenant[t] if a.replayed == "false") for t in tenants}
    for answer in from_postgres + from_redis:
        assert answer.status == 201 and answer.replayed == "true", answer.describe()
        assert answer.body == storm_body[answer.call.tag]
    assert (stranger.status, stranger.code) == (503, "store_unavailable")
    for answer, tenant in zip(respelled, tenants[:2], strict=True):
        assert answer.replayed == "true" and answer.body == storm_body[tenant]
    # A different request under the key: another tenant's business, but a 422 within one.
    assert (other_tenant.status, other_tenant.replayed) == (201, "false")
    assert (same_tenant.status, same_tenant.code) == (422, "key_reused")
    assert own.status == 200 and json.loads(own.body)["id"] == ids_by_tenant[tenants[0]]
    assert (foreign.status, foreign.code) == (404, "resource_missing")
    assert [c["id"] for c in listed.json()["data"]] == [ids_by_tenant[tenants[1]]]


def _with_authorization(call: Call, value: str) -> Call:
    headers = tuple((n, v) for n, v in call.headers if n != "Authorization")
    return Call(call.method, call.path, (("Authorization", value), *headers), call.body, call.tag)
