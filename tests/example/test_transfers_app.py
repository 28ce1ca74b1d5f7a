"""example_app.transfers, the smallest Flask-SQLAlchemy app: atomic and idempotent."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from flask import Flask
from sqlalchemy import text

from example_app import transfers
from flask_idempotency.testing import assert_idempotent
from flask_idempotency.testing.live_server import LiveServer

AUTH = {"Authorization": "Bearer key_transfers"}


@pytest.fixture
def app(clean_db: str) -> Iterator[Flask]:
    url = clean_db.replace("postgresql://", "postgresql+psycopg2://", 1)
    app = transfers.create_app({"SQLALCHEMY_DATABASE_URI": url, "IDEMPOTENCY_TESTING_DRILLS": True})
    yield app
    app.extensions["idempotency"].close()
    with app.app_context():
        transfers.db.engine.dispose()


def count(app: Flask) -> int:
    with app.app_context():
        return int(transfers.db.session.execute(text("SELECT count(*) FROM transfer")).scalar_one())


def test_transfers_are_idempotent_and_atomic(app: Flask) -> None:
    with LiveServer(app) as server:
        report = assert_idempotent(
            server.url + "/transfers",
            json={"from": "acct_a", "to": "acct_b", "amount": 1500},
            headers=AUTH,
            duplicates=8,
            executions=lambda: count(app),
            atomicity_drill=True,
        )
    assert report.status == 201


def test_an_invalid_transfer_is_not_stored(app: Flask) -> None:
    client = app.test_client()
    headers = {**AUTH, "Idempotency-Key": "bad-then-good"}
    bad = client.post("/transfers", json={"from": "a", "to": "b", "amount": 0}, headers=headers)
    assert bad.status_code == 400
    good = client.post("/transfers", json={"from": "a", "to": "b", "amount": 7}, headers=headers)
    assert good.status_code == 201 and good.headers["Idempotent-Replayed"] == "false"
    assert count(app) == 1
    shown = client.get(f"/transfers/{good.get_json()['id']}")
    assert shown.get_json()["amount"] == 7
