"""Each release replays the other's completed answers, byte for byte, without
running the view again: a retry that spans the upgrade is a replay."""

from __future__ import annotations

import json

import pytest

from .answers import assert_replays, seen
from .rollout import Server, Stack, new_key

DIRECTIONS = ["old-then-new", "new-then-old"]


def _servers(stack: Stack, direction: str) -> tuple[Server, Server]:
    return (stack.old, stack.new) if direction == "old-then-new" else (stack.new, stack.old)


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_a_completed_answer_replays_on_the_other_release(stack: Stack, direction: str) -> None:
    first_server, other = _servers(stack, direction)
    key = new_key()
    body = {"amount": 4200, "currency": "eur", "note": "ünïcødé ✓"}
    first = first_server.charge(key, body)
    assert first.status == 201, first
    assert json.loads(first.body)["release"] == first_server.release.name

    replay = other.charge(key, body)
    assert_replays(replay, first)
    # The same record replays on the release that wrote it, and again on the other.
    assert_replays(first_server.charge(key, body), first)
    assert_replays(other.charge(key, body), first)
    assert stack.runs(key) == [first_server.release.name]


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_json_compared_canonically_across_releases(stack: Stack, direction: str) -> None:
    """A retry whose JSON differs only in key order and spacing is the same request
    to both releases (the fingerprint 0.2.0 wrote is read as it was written)."""
    first_server, other = _servers(stack, direction)
    key = new_key()
    first = first_server.charge(key, {"amount": 7, "currency": "usd"})
    assert first.status == 201, first
    reordered = {"currency": "usd", "amount": 7}
    assert_replays(other.charge(key, reordered), first)
    assert stack.runs(key) == [first_server.release.name]


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_a_different_request_under_the_key_is_refused_by_the_other(
    stack: Stack, direction: str
) -> None:
    first_server, other = _servers(stack, direction)
    key = new_key()
    assert first_server.charge(key, {"amount": 1}).status == 201
    answer = other.charge(key, {"amount": 2})
    assert answer.status == 422, answer
    assert answer.json()["error"]["code"] == "key_reused"
    assert stack.runs(key) == [first_server.release.name]


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_an_answer_not_stored_runs_again_on_the_other(stack: Stack, direction: str) -> None:
    """A 5xx is not stored by either release: the retry runs on the other one."""
    first_server, other = _servers(stack, direction)
    key = new_key()
    failed = first_server.charge(key, {"amount": 3, "status": 500})
    assert failed.status == 500, failed
    retried = other.charge(key, {"amount": 3})
    assert retried.status == 201, retried
    assert json.loads(retried.body)["release"] == other.release.name
    assert stack.runs(key) == [first_server.release.name, other.release.name]
    assert seen(first_server.charge(key, {"amount": 3})) == seen(retried)


def test_a_text_body_recorded_by_the_previous_release_replays_on_the_new(stack: Stack) -> None:
    """Each record is compared the way it was written: a non-JSON body that 0.2.0
    fingerprinted as bytes replays on the new release, media type or not."""
    key = new_key()
    first = stack.old.note(key, b"ship it \xe2\x9c\x93")
    assert first.status == 201, first
    assert_replays(stack.new.note(key, b"ship it \xe2\x9c\x93"), first)
    assert_replays(stack.old.note(key, b"ship it \xe2\x9c\x93"), first)
    assert stack.runs(key) == ["previous"]


def test_a_text_body_recorded_by_the_new_release_never_runs_again_on_the_previous(
    stack: Stack,
) -> None:
    """The other way round 0.2.0 may not know the new fingerprint of a non-JSON body
    (the CHANGELOG says such a retry may get ``422`` during the rollout), but it never
    runs the view again and never answers anything but the stored answer."""
    key = new_key()
    first = stack.new.note(key, b"ship it")
    assert first.status == 201, first
    retry = stack.old.note(key, b"ship it")
    if retry.status == 422:
        assert retry.json()["error"]["code"] == "key_reused"
    else:
        assert_replays(retry, first)
    assert stack.runs(key) == ["current"]
