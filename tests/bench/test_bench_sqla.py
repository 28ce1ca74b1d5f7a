"""The Flask-SQLAlchemy subjects run, and issue 24's criteria are computed from them.

Flask-SQLAlchemy is a benchmark-only dependency here
(benchmarks/requirements-peers.txt): without it these tests skip, saying so.
"""

from __future__ import annotations

import sys
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest
from werkzeug.test import TestResponse

if str(Path(__file__).resolve().parents[2]) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import __main__ as runner  # noqa: E402
from benchmarks import app as bench_app  # noqa: E402
from benchmarks import inprocess, report  # noqa: E402
from benchmarks.app import REQUEST_BODY  # noqa: E402
from support.databases import count_rows

pytestmark = pytest.mark.skipif(
    find_spec("flask_sqlalchemy") is None,
    reason=f"flask-sqlalchemy is not installed (pip install -r {bench_app.PEERS_REQUIREMENTS})",
)

JSON = "application/json"


@pytest.fixture
def bench_servers(clean_db: str, clean_redis: str, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("BENCH_DATABASE_URL", clean_db)
    monkeypatch.setenv("BENCH_REDIS_URL", clean_redis)
    return clean_db


def test_the_default_run_has_the_family_and_its_baseline() -> None:
    defaults = set(bench_app.DEFAULT_SUBJECTS)
    assert {"sqla-bare", "sqla-pg", "sqla-handwritten"} <= defaults
    assert set(bench_app.SQLA_SUBJECTS) <= set(bench_app.SUBJECTS)
    subjects, notes = runner.choose_subjects("sqla-pg,sqla-bare")
    assert subjects == ["bare", "sqla-bare", "sqla-pg"] and notes == []


def test_without_flask_sqlalchemy_the_family_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        bench_app, "find_spec", lambda name: None if name == "flask_sqlalchemy" else find_spec(name)
    )
    reason = bench_app.unavailable("sqla-pg")
    assert reason is not None and "flask-sqlalchemy" in reason
    subjects, notes = runner.choose_subjects(None)
    assert not set(bench_app.SQLA_SUBJECTS) & set(subjects)
    assert any("flask-sqlalchemy" in note for note in notes)


@pytest.mark.parametrize(
    ("subject", "replayed"),
    [("sqla-bare", None), ("sqla-pg", "true"), ("sqla-pg-txclaim", "true"),
     ("sqla-handwritten", "true")],
)  # fmt: skip
def test_a_subject_executes_once_and_replays(
    subject: str, replayed: str | None, bench_servers: str
) -> None:
    """In process, with the PostgreSQL meter: first requests insert the charge;
    the extension's and the hand-written replays answer the stored 201 without
    inserting again (the bare one ignores the key and inserts each time)."""
    from benchmarks import cpu

    meter = cpu.CpuMeter(bench_servers, None) if cpu.available() else None
    try:
        with inprocess.Subject(subject, meter) as opened:
            first = opened.probe("first", 5, 1)
            replay = opened.probe("replay", 5, 1)
    finally:
        if meter is not None:
            meter.close()
    fresh = "false" if replayed is not None else None
    assert first.answers == {("201 CREATED", fresh): 5}, first.answers
    assert replay.answers == {("201 CREATED", replayed): 5}, replay.answers
    assert first.cpu_us > 0 and (meter is None or first.postgres_us is not None)
    # The replay key's first request, the warm-up and five first requests; then,
    # without idempotency, the replay path's six requests run too.
    expected = 1 + 1 + 5 + (6 if replayed is None else 0)
    assert count_rows(bench_servers, "bench_charges") == expected


def test_the_extension_joins_db_session_to_the_claimed_request(bench_servers: str) -> None:
    """The view's commit() is a savepoint release: a view that fails after it
    keeps nothing, and its retry runs (the subject is what the issue says it is)."""
    bench_app.prepare_database(bench_servers, ["sqla-pg"])
    app = bench_app.create_app("sqla-pg")
    try:
        db = app.extensions["sqlalchemy"]
        with app.app_context():
            assert db.engine.url.drivername == "postgresql+psycopg2"

        @app.after_request
        def fail_once(response: Any) -> Any:
            if not app.config.get("FAILED"):
                app.config["FAILED"] = True
                response.status_code = 503  # a 5xx is not stored: the attempt is released
            return response

        client = app.test_client()
        assert _post(client, "k").status_code == 503
        assert count_rows(bench_servers, "bench_charges") == 0
        assert _post(client, "k").status_code == 201
        assert count_rows(bench_servers, "bench_charges") == 1
    finally:
        app.extensions["idempotency"].close()
        with app.app_context():
            app.extensions["sqlalchemy"].engine.dispose()


def test_the_handwritten_layer_refuses_another_body_and_a_missing_key(bench_servers: str) -> None:
    bench_app.prepare_database(bench_servers, ["sqla-handwritten"])
    app = bench_app.create_app("sqla-handwritten")
    try:
        client = app.test_client()
        first = _post(client, "k")
        assert first.status_code == 201 and first.headers["Idempotent-Replayed"] == "false"
        again = _post(client, "k")
        assert again.status_code == 201 and again.headers["Idempotent-Replayed"] == "true"
        assert again.get_data() == first.get_data()
        assert _post(client, "k", b'{"amount": 1, "currency": "usd"}').status_code == 422
        assert _post(client, None).status_code == 400
        assert count_rows(bench_servers, "bench_charges") == 1
    finally:
        with app.app_context():
            app.extensions["sqlalchemy"].engine.dispose()


def test_the_criteria_run_writes_its_ratios(
    bench_servers: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from benchmarks import sqla_criteria

    argv = ["--rounds", "1", "-n", "3", "--warmup", "1", "--output-dir", str(tmp_path)]
    assert sqla_criteria.main(argv) == 0
    printed = capsys.readouterr().out
    written = list(tmp_path.glob("sqla-*.md"))
    assert len(written) == 1 and len(list(tmp_path.glob("sqla-*.json"))) == 1
    text = written[0].read_text()
    assert text in printed
    assert "(sqla-pg - sqla-bare) / (pg - bare)" in text
    assert "(sqla-pg - sqla-bare) / (sqla-handwritten - sqla-bare)" in text
    assert "replay: sqla-pg / pg" in text and "transaction claim mode" not in text


def test_the_gunicorn_report_gives_the_same_ratios_per_round() -> None:
    def row(subject: str, path: str, rnd: int, app_us: float) -> dict[str, Any]:
        return {"subject": subject, "path": path, "connections": 16, "round": rnd,
                "cpu_app_us": app_us, "cpu_postgres_us": 0.0, "cpu_redis_us": 0.0}  # fmt: skip

    cpu = {"bare": 100, "pg": 300, "sqla-bare": 400, "sqla-pg": 620, "sqla-handwritten": 800}
    rows = [row(s, "first", r, v + r) for r in range(3) for s, v in cpu.items()]
    replay = {"bare": 100, "pg": 50, "sqla-bare": 400, "sqla-pg": 55, "sqla-handwritten": 110}
    rows += [row(s, "replay", 0, v) for s, v in replay.items()]
    lines = report.sqlalchemy_criteria(rows)
    assert "| first | 16 | 1.10 (1.10-1.10) | 0.55 (0.55-0.55) |" in lines
    assert "| replay | 16 | 1.10 (1.10-1.10) | 0.50 (0.50-0.50) |" in lines
    assert report.sqlalchemy_criteria([r for r in rows if r["subject"] != "sqla-pg"]) == []


def _post(client: Any, key: str | None, body: bytes = REQUEST_BODY) -> TestResponse:
    headers = {"Idempotency-Key": key} if key else {}
    response: TestResponse = client.post("/charges", data=body, headers=headers, content_type=JSON)
    return response
