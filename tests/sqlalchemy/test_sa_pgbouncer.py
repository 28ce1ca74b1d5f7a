"""``Idempotency(app, db=db)`` behind PgBouncer in transaction-pooling mode.

The Flask-SQLAlchemy app under gunicorn reaches PostgreSQL only through a
throwaway PgBouncer (``pool_mode = transaction``, fewer server connections than
the app has clients), in both claim modes, with the extension's default
settings: it prepares no statements, so it needs none turned off. On psycopg 3
the application's own engine prepares nothing (``prepare_threshold: None``,
which turns psycopg's preparing off): that is for the queries of the app's
``db.session``, which psycopg would otherwise prepare after a few runs.
The claim, the view's savepoints and the fenced completion must each stay
within one server transaction. The test counts rows straight in PostgreSQL.

A topology test (``make test-topologies``), skipped with the reason where no
``pgbouncer`` binary can be found.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sa_harness import *  # noqa: F403  (the fixtures, used by name)
from sa_harness import DIALECTS, Gates, new_label, post, rows, sa_url, serving, storm

from support.gunicorn_server import GunicornServer
from support.pgbouncer_server import ThrowawayPgBouncer, find_pgbouncer

pytestmark = [
    pytest.mark.topology,
    pytest.mark.skipif(
        find_pgbouncer() is None,
        reason="no pgbouncer binary: `apt-get install pgbouncer` (.ci/run does so when it can)",
    ),
]

#: Server connections PgBouncer opens: fewer than the app's 2 workers x 12 pooled
#: connections, so clients really take turns on them.
BOUNCER_POOL_SIZE = 8


@pytest.fixture(scope="module")
def bouncer(database_url: str) -> Iterator[ThrowawayPgBouncer]:
    with ThrowawayPgBouncer(database_url, pool_size=BOUNCER_POOL_SIZE) as running:
        yield running
        print(f"--- pgbouncer log ---\n{running.log_path.read_text(errors='replace')[-4000:]}")


@pytest.fixture(
    scope="module",
    params=[(dialect, mode) for dialect in DIALECTS for mode in ("row", "transaction")],
    ids=lambda param: "-".join(param),
)
def bounced(
    request: pytest.FixtureRequest, database_url: str, bouncer: ThrowawayPgBouncer, gates: Gates
) -> Iterator[GunicornServer]:
    dialect, claim_mode = request.param
    dbname = database_url.rsplit("/", 1)[1].split("?", 1)[0]
    url = sa_url(bouncer.url_for(dbname), dialect)
    env = {"SA_APP_IDEMPOTENCY_CLAIM_MODE": claim_mode}
    if dialect == "psycopg":
        env["SA_APP_NO_PREPARE"] = "1"  # the app's own queries (see above)
    with serving(url, gates, **env) as running:
        yield running


def test_storm_through_pgbouncer(bounced: GunicornServer) -> None:
    storm(bounced, keys=4, duplicates=50)


def test_success_and_failure_after_commit_through_pgbouncer(
    bounced: GunicornServer, database_url: str
) -> None:
    label = new_label("bounced")
    first = post(bounced, label, headers={"X-Then": "twice"})
    assert first.status == 201, first.body
    assert rows(database_url, label) == ["first", "second"]
    replay = post(bounced, label, headers={"X-Then": "twice"})
    assert replay.headers["Idempotent-Replayed"] == "true" and replay.body == first.body

    label = new_label("bounced-failed")
    assert post(bounced, label, headers={"X-Then": "raise"}).status == 500
    assert rows(database_url, label) == []
    retry = post(bounced, label)
    assert retry.status == 201, retry.body
    assert rows(database_url, label) == ["first"]

    label = new_label("bounced-rollback")
    assert post(bounced, label, headers={"X-Then": "rollback"}).status == 201
    assert rows(database_url, label) == ["after_rollback", "first"]
