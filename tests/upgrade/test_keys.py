"""Record keys and derived keys are byte-identical in both releases, for any scope
(Unicode included) and any valid key: a retry that spans the upgrade finds its
record, and a downstream call derives the key it derived before.

The expected values come from the previous release's own functions, run from
its tree in git (frozen, so naming them is safe); this checkout's values are
read from outside: the derived keys its view returns, and the record key column
of the records table, which the add-only schema keeps for both releases.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest

from support.pg_query import query

from .answers import assert_replays
from .app import PURPOSES
from .rollout import Release, Stack
from .test_replay import DIRECTIONS, _servers

#: Principals as scope functions return them: ASCII, accented, CJK, emoji, and a
#: colon where the length prefix of the record key matters.
SCOPES = ("tenant-1", "Zürich", "東京支店", "🧾 receipts", "12:ab", "user:42")


def _keys() -> list[tuple[str, str]]:
    """(header value, key) pairs, fresh per call (the stacks are shared): plain, the
    longest allowed, punctuation, and the quoted form with a comma inside it."""
    tag = uuid.uuid4().hex[:12]
    return [
        (f"k-{tag}", f"k-{tag}"),
        ("x" * (255 - len(tag)) + tag, "x" * (255 - len(tag)) + tag),
        (f"~!@#$%^&*()_+{{}}|:<>?[]\\;'./`={tag}", f"~!@#$%^&*()_+{{}}|:<>?[]\\;'./`={tag}"),
        (f'"order,{tag}"', f"order,{tag}"),
    ]


#: Run in a Python of the previous release: its record keys and derived keys.
PREVIOUS_DIGESTS = """
import json, sys
import flask_idempotency
from flask_idempotency import digests
pairs, purposes = json.load(sys.stdin)
keys = []
for scope, key in pairs:
    record = digests.record_key(scope, key)
    derived = {p: digests.derived_key(record, p) for p in purposes}
    keys.append({"record_key": record.hex(), "derived": derived})
print(json.dumps({"package": flask_idempotency.__file__, "keys": keys}))
"""


def previous_digests(release: Release, pairs: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """What the previous release computes for each (scope, key)."""
    out = json.loads(release.python(PREVIOUS_DIGESTS, json.dumps([pairs, list(PURPOSES)])))
    assert out["package"].startswith(str(release.package)), out["package"]
    keys: list[dict[str, Any]] = out["keys"]
    return keys


@pytest.mark.parametrize("stack", ["row"], indirect=True)  # keys do not depend on the mode
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_record_keys_and_derived_keys_are_those_of_the_previous_release(
    stack: Stack, direction: str
) -> None:
    first_server, other = _servers(stack, direction)
    cases = [(scope, header, key) for scope in SCOPES for header, key in _keys()]
    expected = previous_digests(stack.previous, [(scope, key) for scope, _, key in cases])
    for (scope, header, _), want in zip(cases, expected, strict=True):
        first = first_server.charge(header, {"amount": 1}, scope=scope)
        assert first.status == 201, (scope, header, first)
        assert first.json()["derived"] == want["derived"], (scope, header)
        stored = query(
            stack.database_url,
            "SELECT count(*) FROM idempotency_records WHERE record_key = %s",
            (bytes.fromhex(want["record_key"]),),
        )
        assert stored == [(1,)], f"no record under the previous release's key for {scope!r}"
        assert_replays(other.charge(header, {"amount": 1}, scope=scope), first)
        assert stack.runs(header) == [first_server.release.name]


@pytest.mark.parametrize("stack", ["row"], indirect=True)
def test_a_scope_is_its_own_on_both_releases(stack: Stack) -> None:
    """The same key under two scopes is two records whichever release serves each."""
    header, _ = _keys()[0]
    a = stack.old.charge(header, {"amount": 1}, scope="Zürich")
    b = stack.new.charge(header, {"amount": 1}, scope="Zurich")
    assert (a.status, b.status) == (201, 201)
    assert b.headers["Idempotent-Replayed"] == "false"
    assert a.json()["derived"] != b.json()["derived"]
    assert stack.runs(header) == ["previous", "current"]
    assert_replays(stack.new.charge(header, {"amount": 1}, scope="Zürich"), a)
    assert_replays(stack.old.charge(header, {"amount": 1}, scope="Zurich"), b)
