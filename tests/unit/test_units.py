"""The pure parts: key parsing, fingerprints, decisions and settings validation."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flask_idempotency import InvalidKey
from flask_idempotency.digests import derived_key, log_key, record_key
from flask_idempotency.fingerprint import canonical_body, fingerprint
from flask_idempotency.flow import (
    Proceed,
    Rejection,
    Replay,
    decide,
    retry_after_seconds,
)
from flask_idempotency.keys import parse_key
from flask_idempotency.settings import default_should_store, settings_from_config
from flask_idempotency.store.base import Claimed, Existing, StoredResponse


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("abc", "abc"),
        ('"abc"', "abc"),
        ('"a\\"b"', 'a"b'),
        ('"a\\\\b"', "a\\b"),
        ("!~", "!~"),
        ("x" * 255, "x" * 255),
        ('"', '"'),
    ],
)
def test_valid_keys(raw: str, expected: str) -> None:
    assert parse_key(raw) == expected


@pytest.mark.parametrize(
    "raw", ["", '""', "a b", "x" * 256, "\x7f", "a\x00", "é", '"a"b"', '"a\\b"', '"a b"']
)
def test_invalid_keys(raw: str) -> None:
    with pytest.raises(InvalidKey):
        parse_key(raw)


def test_missing_key() -> None:
    assert parse_key(None) is None  # (a required route answers MissingKey: test_semantics)


def test_record_key_separates_scopes_and_is_unambiguous() -> None:
    assert record_key("a", "k") != record_key("b", "k")
    assert record_key("ab", "c") != record_key("a", "bc")
    assert len(record_key("", "k")) == 32
    assert "k" not in log_key(record_key("", "k"))
    assert derived_key(record_key("a", "k"), "processor") != derived_key(
        record_key("b", "k"), "processor"
    )


def test_json_canonical_form() -> None:
    assert canonical_body("application/json", b'{"b":1, "a":2}') == canonical_body(
        "application/json", b'{"a": 2,\n"b": 1}'
    )
    assert canonical_body("application/json", b'{"a":1500}') != canonical_body(
        "application/json", b'{"a":1500.0}'
    )
    assert canonical_body("application/merge-patch+json", b'{"b":1,"a":2}') == b'{"a":2,"b":1}'
    assert canonical_body("text/plain", b'{"b":1, "a":2}') == b'{"b":1, "a":2}'
    assert canonical_body("application/json", b"{not json") == b"{not json"
    deep = b"[" * 100_000 + b"]" * 100_000
    assert canonical_body("application/json", deep) == deep


def test_fingerprint_covers_method_path_query_and_body() -> None:
    base = fingerprint("POST", "/a", b"", "application/json", b"{}")
    assert base == fingerprint("post", "/a", b"", "application/json", b"{ }")
    assert base != fingerprint("PUT", "/a", b"", "application/json", b"{}")
    assert base != fingerprint("POST", "/b", b"", "application/json", b"{}")
    assert base != fingerprint("POST", "/a", b"x=1", "application/json", b"{}")
    assert base != fingerprint("POST", "/a", b"", "application/json", b"[]")


def test_decisions() -> None:
    stored = StoredResponse(201, (("Content-Type", "application/json"),), b"{}")
    fp = b"f" * 32
    assert decide(Claimed(7), fp) == Proceed(7)
    assert decide(Existing("completed", fp, stored), fp) == Replay(stored)
    assert decide(Existing("processing", fp, None), fp) is Rejection.IN_PROGRESS
    other = b"o" * 32
    assert decide(Existing("processing", other, None), fp) is Rejection.KEY_REUSED
    assert decide(Existing("completed", other, stored), fp) is Rejection.KEY_REUSED


def test_default_stored_statuses() -> None:
    stored = [200, 201, 202, 204, 301, 302, 304, 402, 410, 418]
    not_stored = [400, 401, 403, 404, 408, 409, 422, 425, 429, 500, 502, 503]
    assert all(default_should_store(s) for s in stored)
    assert not any(default_should_store(s) for s in not_stored)


def test_retry_after_bounds() -> None:
    assert retry_after_seconds(1, 30.0) == 1
    assert retry_after_seconds(60, 2.2) == 3
    assert retry_after_seconds(0, None) == 1
    assert retry_after_seconds(5, -3.0) == 5


def test_settings_are_read_and_validated() -> None:
    bad_configs: list[tuple[dict[str, object], str]]
    settings = settings_from_config(
        {"database_url": "postgresql://x", "ttl": timedelta(hours=1), "lease": "10", "wait": 0}
    )
    assert settings.ttl == 3600 and settings.lease == 10 and settings.renew_interval == 10 / 3
    # None is the default of any setting but a function (an unset environment variable).
    defaults = settings_from_config({"database_url": "x", "ttl": None, "key_header": None})
    assert (defaults.ttl, defaults.key_header) == (86400.0, "Idempotency-Key")
    bad_configs = [
        ({}, "DATABASE_URL"),
        ({"database_url": "x", "ttl": -1}, "TTL"),
        ({"database_url": "x", "lease": "soon"}, "LEASE"),
        ({"database_url": "x", "ttl": 5, "lease": 10}, "at least"),
        ({"database_url": "x", "lease_renew_interval": 60}, "RENEW"),
        ({"database_url": "x", "scope_func": "nope"}, "callable"),
        ({"database_url": "x", "scope_func": None}, "SCOPE_FUNC must be callable"),
        ({"database_url": "x", "wait": True}, "WAIT must be a number of seconds"),
        ({"database_url": "x", "retry_after": "1.5"}, "RETRY_AFTER must be an integer"),
        ({"database_url": "x", "wait": -1}, "WAIT must not be negative"),
        ({"database_url": "x", "no_such_key": 1}, "Unknown"),
        ({"database_url": "x", "auto_migrate": "maybe"}, "boolean"),
    ]
    for bad, message in bad_configs:
        with pytest.raises(ValueError, match=message):
            settings_from_config(bad)


@pytest.mark.parametrize(
    "body",
    [
        b'{"b":1,"a":[1.0,2]}',
        b"[1,2]",
        b'  {"a": 2}',
        '{"é":"x"}'.encode(),
        '{"a":1}'.encode("utf-16-le"),
        '{"a":1}'.encode("utf-16"),
        b'\xef\xbb\xbf{"a":1}',
        b"{",
        b"{\xff}",
        b"1",
    ],
)
def test_canonical_body_is_the_sorted_json_of_what_json_loads_reads(body: bytes) -> None:
    """Whatever encoding ``json.loads`` detects (UTF-8, -16, a BOM), or the raw bytes."""
    try:
        expected = json.dumps(
            json.loads(body), sort_keys=True, separators=(",", ":"), ensure_ascii=False
        ).encode("utf-8", "surrogatepass")
    except ValueError:
        expected = body
    assert canonical_body("application/json", body) == expected


_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=20,
)


@given(value=_JSON_VALUES)
@settings(max_examples=300, deadline=None)
def test_a_canonical_body_is_what_json_dumps_writes_sorted(value: object) -> None:
    """Any JSON value, sent any way, compares as ``json.dumps(sort_keys=True, ...)``
    writes it, byte for byte, NaN and surrogates included."""
    expected = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    for sent in (json.dumps(value), json.dumps(value, indent=2, ensure_ascii=False)):
        body = sent.encode("utf-8", "surrogatepass")
        assert canonical_body("application/json", body) == expected.encode("utf-8", "surrogatepass")


def test_route_options_hash_once_and_compare_by_value() -> None:
    from flask_idempotency.route_options import RouteOptions

    first, same = RouteOptions(True, ttl=5.0), RouteOptions(True, ttl=5.0)
    other = RouteOptions(True)
    assert first == same and hash(first) == hash(same)
    assert first != other
    assert {first: "route"}[same] == "route"


def test_the_key_header_is_read_where_wsgi_puts_it() -> None:
    from flask_idempotency.settings import Settings

    assert Settings().key_environ_name == "HTTP_IDEMPOTENCY_KEY"
    assert Settings(key_header="X-Request-Key").key_environ_name == "HTTP_X_REQUEST_KEY"
