"""Contract section 6, row by row, through Flask's test client and both dialects.

``db.session`` inside a claimed request works on the request's transaction:
what the view writes is kept exactly when its answer is stored. Outside a
claimed request it is plain Flask-SQLAlchemy. Each test counts the rows of its
own label in PostgreSQL through a connection of its own.
"""

from __future__ import annotations

from typing import Any

import pytest
from sa_harness import *  # noqa: F403  (the fixtures, used by name)
from sa_harness import API_KEY, Client, new_label, record_states, rows, seed_user, user_row

from support.pg_query import terminate_sessions


@pytest.mark.parametrize(("then", "kept"), [("ok", ["first"]), ("twice", ["first", "second"])])
def test_commits_and_a_stored_answer_keep_every_write(
    client: Client, dialect_url: str, then: str, kept: list[str]
) -> None:
    label = new_label("kept")
    first = client.post(label, then=then)
    assert first.status_code == 201, first.get_data(as_text=True)
    assert first.headers["Idempotent-Replayed"] == "false"
    assert rows(dialect_url, label) == kept

    replay = client.post(label, then=then)
    assert replay.status_code == 201
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert replay.get_data() == first.get_data()
    assert rows(dialect_url, label) == kept, "the replay ran the view again"


@pytest.mark.parametrize(
    ("then", "status"),
    [
        ("raise", 500),  # an exception after the commit
        ("declined", 402),  # an exception an error handler renders as a 4xx
        ("500", 500),
        ("abort503", 503),
        ("400", 400),  # answers that are not stored
        ("409", 409),
        ("422", 422),
    ],
)
def test_commit_then_failure_keeps_nothing_and_the_retry_runs_once(
    client: Client, dialect_url: str, then: str, status: int
) -> None:
    label = new_label(f"failed-{then}")
    failed = client.post(label, then=then)
    assert failed.status_code == status, failed.get_data(as_text=True)
    assert rows(dialect_url, label) == [], f"a commit before a {then} was kept"

    retry = client.post(label)  # same key, same request; the failure was transient
    assert retry.status_code == 201, retry.get_data(as_text=True)
    assert retry.headers["Idempotent-Replayed"] == "false"
    assert rows(dialect_url, label) == ["first"]
    assert client.post(label).headers["Idempotent-Replayed"] == "true"
    assert rows(dialect_url, label) == ["first"]


def test_a_connection_lost_under_the_view_keeps_nothing_and_forgets_the_join(
    client: Client, dialect_url: str
) -> None:
    label = new_label("lost")
    lost = client.post(label, then="lost_connection")
    assert lost.status_code >= 500, lost.get_data(as_text=True)
    assert rows(dialect_url, label) == []
    # The attempt's connection was dropped before it left the session: the join is
    # forgotten all the same, and the next attempt joins a connection of its own.
    retry = client.post(label)
    assert retry.status_code == 201, retry.get_data(as_text=True)
    assert rows(dialect_url, label) == ["first"]


def test_dead_pooled_connections_after_a_restart_cost_no_request(
    make_sa_app: Any, dialect_url: str, database_url: str
) -> None:
    """After a restart the engine's idle connections are dead. The claim on one is
    retried on a fresh connection of the engine, the session joins that one, and the
    store's breaker does not count the dead one (a threshold of one would show it).
    (A route whose own query runs before the claim, an authentication decorator's,
    meets a dead connection in SQLAlchemy first: that is the engine's
    ``pool_pre_ping``'s to prevent, so this route claims first.)"""
    name = new_label("stale-sa")
    app = make_sa_app(
        SQLALCHEMY_ENGINE_OPTIONS={"connect_args": {"application_name": name}},
        IDEMPOTENCY_DATABASE_OPTIONS={"breaker_threshold": 1},
    )
    client = Client(app)
    assert client.post(new_label("warm"), path="/optional-transfers").status_code == 201
    assert terminate_sessions(database_url, name) >= 1

    label = new_label("after-restart")
    answer = client.post(label, path="/optional-transfers")
    assert answer.status_code == 201, answer.get_data(as_text=True)
    assert answer.headers["Idempotent-Replayed"] == "false"
    assert rows(dialect_url, label) == ["first"]
    assert app.extensions["idempotency"].store.breaker.state.value == "closed"


def test_rollback_discards_since_the_last_commit_and_the_session_goes_on(
    client: Client, dialect_url: str
) -> None:
    label = new_label("rollback")
    answer = client.post(label, then="rollback")
    assert answer.status_code == 201, answer.get_data(as_text=True)
    assert rows(dialect_url, label) == ["after_rollback", "first"]


@pytest.mark.parametrize("claim_mode", ["row", "transaction"])
def test_psycopg3_dropping_every_prepared_statement_after_a_rollback_costs_no_request(
    make_sa_app: Any,
    dialect: str,
    dialect_url: str,
    claim_mode: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """psycopg 3 prepares the queries it runs often (``prepare_threshold``; 0 here: at
    once), and after any statement that answers ``ROLLBACK`` (the view's
    ``rollback()`` to its last commit, a release) it deallocates every prepared
    statement of the session, the extension's too. Such requests answer as any
    other, on one connection, and the extension does not take the driver for a
    pooler."""
    if dialect != "psycopg":
        pytest.skip("psycopg 3's own statement cache")
    engine_options = {"pool_size": 1, "max_overflow": 0, "connect_args": {"prepare_threshold": 0}}
    app = make_sa_app(SQLALCHEMY_ENGINE_OPTIONS=engine_options, IDEMPOTENCY_CLAIM_MODE=claim_mode)
    client = Client(app)
    with caplog.at_level("WARNING", logger="flask_idempotency"):
        for then, kept in [("rollback", ["after_rollback", "first"]), ("ok", ["first"])] * 3:
            label = new_label(f"pg3-{then}")
            answer = client.post(label, then=then)
            assert answer.status_code == 201, answer.get_data(as_text=True)
            assert rows(dialect_url, label) == kept
        failed = new_label("pg3-fail")  # a release: its ROLLBACK, then the next claim
        assert client.post(failed, then="raise").status_code == 500
        assert client.post(failed, then="ok").status_code == 201
        assert rows(dialect_url, failed) == ["first"]
    assert not [r for r in caplog.records if "vanished" in r.getMessage()]


def test_a_rollback_with_nothing_sent_since_the_commit_discards_nothing(
    client: Client, dialect_url: str
) -> None:
    label = new_label("empty-rollback")
    answer = client.post(label, then="empty_rollback")
    assert answer.status_code == 201, answer.get_data(as_text=True)
    assert rows(dialect_url, label) == ["after_rollback", "first"]


@pytest.mark.parametrize(
    ("status", "kept"), [(201, ["after_nested", "first", "nested"]), (500, [])]
)
def test_nested_transactions_of_the_session_nest_in_the_requests(
    client: Client, dialect_url: str, status: int, kept: list[str]
) -> None:
    """``db.session.begin_nested()`` (a caught collision, then a block that succeeds)
    inside a claimed request: its savepoints are inside the request's transaction,
    kept with a stored answer and gone with one that is not."""
    label = new_label(f"nested-{status}")
    answer = client.post(label, then="nested", headers={"X-Status": str(status)})
    assert answer.status_code == status, answer.get_data(as_text=True)
    assert rows(dialect_url, label) == kept
    if status == 500:  # not stored: the retry runs, once
        assert client.post(label, then="nested").status_code == 201
        assert rows(dialect_url, label) == ["after_nested", "first", "nested"]


@pytest.mark.parametrize(("status", "kept"), [(201, ["first", "raw", "second"]), (500, [])])
def test_session_and_the_extensions_connection_share_the_transaction(
    client: Client, dialect_url: str, status: int, kept: list[str]
) -> None:
    label = new_label(f"raw-{status}")
    answer = client.post(label, then="raw", headers={"X-Status": str(status)})
    assert answer.status_code == status, answer.get_data(as_text=True)
    assert rows(dialect_url, label) == kept


def test_rollback_then_failure_keeps_nothing(client: Client, dialect_url: str) -> None:
    """The writes after a rollback follow the same rule: a 500 keeps none of them."""
    label = new_label("rollback-failed")
    answer = client.post(label, then="rollback", headers={"X-Status": "500"})
    assert answer.status_code == 500
    assert rows(dialect_url, label) == []


def test_a_caught_integrity_error_rolls_back_to_the_last_commit(
    client: Client, dialect_url: str
) -> None:
    """Get-or-create: the view's commit fails on a unique violation, it rolls back
    and goes on; PostgreSQL's aborted transaction must not take the request's down."""
    label = new_label("conflict")
    answer = client.post(label, then="conflict")
    assert answer.status_code == 201, answer.get_data(as_text=True)
    assert rows(dialect_url, label) == ["after_rollback", "first"]


def test_writes_left_unflushed_are_kept_with_the_answer(client: Client, dialect_url: str) -> None:
    label = new_label("unflushed")
    assert client.post(label, then="unflushed").status_code == 201
    assert rows(dialect_url, label) == ["first", "unflushed"]


def test_a_flush_failing_as_the_answer_is_stored_keeps_nothing(
    client: Client, dialect_url: str
) -> None:
    """The view leaves a write that violates a constraint for the extension to flush:
    the attempt fails (500), nothing of it is kept, and a retry runs."""
    label = new_label("flush-fails")
    assert client.post(label, then="flush_fails").status_code == 500
    assert rows(dialect_url, label) == []
    retry = client.post(label)
    assert retry.status_code == 201 and retry.headers["Idempotent-Replayed"] == "false"
    assert rows(dialect_url, label) == ["first"]


@pytest.mark.parametrize(
    "ended",
    [
        "closed",
        # A second session (after db.session.remove()) is refused: the view fails,
        # and nothing of it is kept.
        "removed",
    ],
)
def test_writes_after_the_view_ends_its_session_follow_the_rules(
    client: Client, dialect_url: str, ended: str
) -> None:
    label = new_label(ended)
    answer = client.post(label, then=ended, headers={"X-Status": "500"})
    assert answer.status_code == 500
    assert rows(dialect_url, label) == []


def test_reads_after_commit_see_own_writes_others_do_not_yet(
    client: Client, dialect_url: str
) -> None:
    label = new_label("read")
    answer = client.post(label, then="read")
    assert answer.status_code == 201, answer.get_data(as_text=True)
    seen = answer.get_json()
    assert seen["seen_by_session"] == 1
    assert seen["loaded_amount"] == 100
    # Committed by the view, yet not visible to anyone else until the answer is stored.
    assert seen["seen_elsewhere"] == 0
    assert rows(dialect_url, label) == ["first"]


@pytest.mark.parametrize("loaded_in", ["decorator", "before_request"])
def test_user_loaded_before_the_claim_is_written_with_the_answer(
    client: Client, dialect_url: str, loaded_in: str
) -> None:
    """An authentication step queries the caller's row through ``db.session`` before
    the key is claimed; the view updates that row and commits. The update is kept
    with the answer, and not when the attempt fails."""
    api_key = new_label("user")
    seed_user(dialect_url, api_key)
    headers = {"X-Load-User": loaded_in}
    label = new_label("user-transfer")

    failed = client.post(label, then="raise", headers=headers, api_key=api_key)
    assert failed.status_code == 500
    assert user_row(dialect_url, api_key) == (0, None)
    assert rows(dialect_url, label) == []

    answer = client.post(label, headers=headers, api_key=api_key)
    assert answer.status_code == 201, answer.get_data(as_text=True)
    assert answer.get_json()["transfers_made"] == 1
    assert user_row(dialect_url, api_key) == (1, None)
    assert rows(dialect_url, label) == ["first"]

    replay = client.post(label, headers=headers, api_key=api_key)
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert user_row(dialect_url, api_key) == (1, None)


def test_a_query_before_the_claim_holds_no_second_connection(
    make_sa_app: Any, dialect_url: str
) -> None:
    """The authentication decorator's query checks a connection out of db's pool
    before the claim; the claim must not need a second one. With one connection in
    db's pool, requests in turn all run, as they do without the extension; holding
    two each, they would wait for the pool and 503. (Nor does the lease keeper take
    that one: it renews on a connection of its own.)"""
    client = Client(
        make_sa_app(
            SQLALCHEMY_ENGINE_OPTIONS={"pool_size": 1, "max_overflow": 0, "pool_timeout": 1}
        )
    )
    labels = [new_label("one-connection") for _ in range(3)]
    for label in labels:
        answer = client.post(label)
        assert answer.status_code == 201, answer.get_data(as_text=True)
    assert client.post(labels[0]).headers["Idempotent-Replayed"] == "true"
    assert [rows(dialect_url, label) for label in labels] == [["first"]] * 3


def test_change_made_before_the_claim_is_refused_not_dropped(
    client: Client, dialect_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A ``before_request`` changes the caller's row without committing (a "last
    seen" mark), then the decorated view runs. That change cannot join the
    request's transaction (it was made on another connection), and dropping it
    silently would lose a write: the request is refused with a clear error before
    anything is claimed, and nothing is kept."""
    api_key = new_label("touch")
    seed_user(dialect_url, api_key)
    label = new_label("touch-transfer")
    headers = {"X-Load-User": "before_request", "X-Touch-User": label}
    answer = client.post(label, headers=headers, api_key=api_key)
    assert answer.status_code == 500
    assert "changes made before the idempotent view" in caplog.text
    assert rows(dialect_url, label) == []
    assert user_row(dialect_url, api_key)[1] != label


# -- outside a claimed request: plain Flask-SQLAlchemy ------------------------------


@pytest.mark.parametrize("path", ["/plain-transfers", "/optional-transfers"])
def test_without_a_claim_commit_commits_on_its_own(
    client: Client, dialect_url: str, path: str
) -> None:
    """An undecorated route, or an optional one called without a key: the view's
    ``commit()`` commits at once (others see it), and a failure after it keeps it,
    exactly as without the extension."""
    label = new_label("unclaimed")
    answer = client.post(label, then="read", key=None, path=path)
    assert answer.status_code == 201, answer.get_data(as_text=True)
    assert answer.get_json()["seen_elsewhere"] == 1

    label = new_label("unclaimed-raise")
    assert client.post(label, then="raise", key=None, path=path).status_code == 500
    assert rows(dialect_url, label) == ["first"]
    label = new_label("unclaimed-400")
    assert client.post(label, then="400", key=None, path=path).status_code == 400
    assert rows(dialect_url, label) == ["first"]


def test_optional_route_with_a_key_is_atomic(client: Client, dialect_url: str) -> None:
    label = new_label("optional-key")
    assert client.post(label, then="raise", path="/optional-transfers").status_code == 500
    assert rows(dialect_url, label) == []
    assert client.post(label, path="/optional-transfers").status_code == 201
    assert rows(dialect_url, label) == ["first"]


def test_safe_method_on_a_decorated_route_commits_on_its_own(
    client: Client, dialect_url: str
) -> None:
    label = new_label("get")
    before = record_states(dialect_url)
    answer = client.client.get(
        f"/safe-transfers?label={label}",
        headers={"Idempotency-Key": label, "Authorization": f"Bearer {API_KEY}"},
    )
    assert answer.status_code == 200, answer.get_data(as_text=True)
    assert answer.get_json()["seen_elsewhere"] == 1
    assert rows(dialect_url, label) == ["get"]
    assert record_states(dialect_url) == before, "a GET made an idempotency record"


def test_session_is_plain_again_after_a_claimed_request(client: Client, dialect_url: str) -> None:
    """The same thread's next, unclaimed request commits for real again."""
    claimed = new_label("claimed")
    assert client.post(claimed, then="raise").status_code == 500
    plain = new_label("plain-after")
    answer = client.post(plain, then="read", key=None, path="/plain-transfers")
    assert answer.get_json()["seen_elsewhere"] == 1
    assert rows(dialect_url, claimed) == []
