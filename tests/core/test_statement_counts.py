"""Statements per request, counted: what PostgreSQL parses and runs, not only round trips.

``test_round_trips.py`` pins the round trips; several statements can ride in
one (``SET LOCAL ...; SELECT ...``), and PostgreSQL parses, plans and runs each
of them. Issue 38's budget, per first request, is a bare app's statements
(``BEGIN``, the ``INSERT``, ``COMMIT``) plus two, in both claim modes, and a
replay from PostgreSQL is one statement in row mode (the claim), the claim and
its ``ROLLBACK`` in transaction mode; none of them a ``SET LOCAL``: the
request path's functions set their own lock timeout (migration 0012).
``python -m benchmarks.pgcost`` counts the same with ``pg_stat_statements``,
with the WAL; this counts the statements in the texts the store sends, so it is
deterministic and needs no server extension.
"""

from __future__ import annotations

import pytest

from .test_round_trips import TRANSACTION_MODE, MakeSubject, Trace, make_subject, pg

__all__ = ["make_subject"]  # (the fixture, shared with test_round_trips)

#: ``BEGIN``, the view's ``INSERT``, ``COMMIT``: a bare app's first request.
BARE_STATEMENTS = 3


def statements(trace: Trace) -> list[str]:
    """Every statement sent, each round trip split at its top-level semicolons
    (the store's texts hold no semicolon in a literal)."""
    return [s.strip() for text in pg(trace) for s in text.split(";") if s.strip()]


@pytest.mark.parametrize(
    ("config", "replay"),
    [({}, 1), (TRANSACTION_MODE, 2)],
    ids=["row", "transaction"],
)
def test_a_first_request_is_bare_plus_two_statements_and_a_replay_one_or_two(
    make_subject: MakeSubject, config: dict[str, str], replay: int
) -> None:
    subject = make_subject("pg", **config)
    response, first = subject.counted("stmt-1")
    assert response.headers["Idempotent-Replayed"] == "false"
    sent = statements(first)
    assert len(sent) == BARE_STATEMENTS + 2, sent
    assert not [s for s in sent if s.upper().startswith("SET")], sent
    response, again = subject.counted("stmt-1")
    assert response.headers["Idempotent-Replayed"] == "true"
    sent = statements(again)
    # (transaction mode: BEGIN with the claim in one round trip, then ROLLBACK)
    assert len(sent) == replay + (1 if config else 0), sent
    assert len(pg(again)) == replay, pg(again)
    assert not [s for s in sent if s.upper().startswith("SET")], sent


def test_a_durable_claim_commit_adds_no_statement(make_subject: MakeSubject) -> None:
    subject = make_subject("pg-synccommit")
    response, first = subject.counted("stmt-durable")
    assert response.status_code == 201
    assert len(statements(first)) == BARE_STATEMENTS + 2
