"""The rollout itself: the previous release migrates and serves, this checkout's
migrations are applied under it, and its workers keep answering as before."""

from __future__ import annotations

import json

from support.http_client import HttpResponse

from .rollout import PREVIOUS_VERSION, Stack


def _shown(answers: list[tuple[str, HttpResponse]], most: int = 6) -> str:
    shown = [f"{key}: {a.status} {a.body[:200]!r}" for key, a in answers[:most]]
    more = [f"... and {len(answers) - most} more"] if len(answers) > most else []
    return "\n".join(shown + more)


def _answered(answer: HttpResponse, *, replayed: str) -> bool:
    return answer.status == 201 and answer.headers["Idempotent-Replayed"] == replayed


def test_each_release_runs_in_its_own_workers(stack: Stack) -> None:
    from support.http_client import http_request

    old = http_request("GET", stack.old.gunicorn.url + "/release").json()
    new = http_request("GET", stack.new.gunicorn.url + "/release").json()
    assert old["version"] == PREVIOUS_VERSION
    assert old["package"] == str(stack.previous.package)
    assert new["package"] == str(stack.current.package)
    assert old["package"] != new["package"]


def test_old_workers_keep_serving_while_new_migrations_apply(stack: Stack) -> None:
    log = stack.rollout
    assert log.before is not None and log.before.status == 201, log.before
    # Every request the old workers got while this checkout's migrate ran: a first
    # request ran the view and was stored, its retry replayed it.
    assert len(log.during) >= 4
    firsts, replays = log.during[0::2], log.during[1::2]
    bad = [(k, a) for k, a in firsts if not _answered(a, replayed="false")]
    bad += [(k, a) for k, a in replays if not _answered(a, replayed="true")]
    assert not bad, f"while `migrate` ran ({log.current_migrate.strip()}):\n{_shown(bad)}"
    for (key, first), (again, replay) in zip(firsts, replays, strict=True):
        assert key == again and replay.body == first.body
    # After it, a record from before still replays and a new key still runs.
    assert log.after_replay is not None and log.after_first is not None
    assert log.after_replay.status == 201
    assert log.after_replay.headers["Idempotent-Replayed"] == "true"
    assert log.after_replay.body == log.before.body
    assert log.after_first.status == 201
    assert json.loads(log.after_first.body)["release"] == "previous"
