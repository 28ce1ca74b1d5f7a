"""The benchmark's subjects beyond the extension: the hand-written minimum, the
peers from the package index, and the claim-mode subjects that wait on a setting.

The peers are benchmark-only dependencies (benchmarks/requirements-peers.txt):
tests that run one skip, saying so, when it is not installed.
"""

from __future__ import annotations

import hashlib
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest
from werkzeug.test import TestResponse

if str(Path(__file__).resolve().parents[2]) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import __main__ as runner  # noqa: E402
from benchmarks import app as bench_app  # noqa: E402
from benchmarks import cpu, inprocess  # noqa: E402
from benchmarks.app import REQUEST_BODY  # noqa: E402
from support.databases import count_rows

JSON = "application/json"


def _installed(subject: str) -> bool:
    return find_spec(bench_app.PEERS[subject][0]) is not None


def _peer(subject: str) -> object:
    """A parameter that skips, with the reason, when the peer is not installed."""
    return pytest.param(
        subject,
        marks=pytest.mark.skipif(
            not _installed(subject),
            reason=f"{bench_app.PEERS[subject][1]} is not installed "
            f"(pip install -r {bench_app.PEERS_REQUIREMENTS})",
        ),
    )


PEER_PARAMS = [_peer(subject) for subject in bench_app.PEERS]


def test_the_default_run_is_bare_both_claim_modes_the_minimum_and_two_peers() -> None:
    defaults = bench_app.DEFAULT_SUBJECTS
    assert defaults[0] == bench_app.BASELINE
    assert {"pg", "pg+redis", bench_app.MINIMUM} <= set(defaults)
    assert bench_app.TXCLAIM_SUBJECTS <= set(defaults)
    assert len(set(bench_app.PEERS) & set(defaults)) >= 2
    assert set(defaults) <= set(bench_app.SUBJECTS)


def test_claim_mode_subjects_set_the_transaction_mode() -> None:
    config = bench_app.subject_config("pg-txclaim", "postgresql:///x", "redis://r/13")
    assert config["IDEMPOTENCY_CLAIM_MODE"] == "transaction"
    assert "IDEMPOTENCY_REDIS_URL" not in config
    config = bench_app.subject_config("pg+redis-txclaim", "postgresql:///x", "redis://r/13")
    assert config["IDEMPOTENCY_CLAIM_MODE"] == "transaction"
    assert config["IDEMPOTENCY_REDIS_URL"] == "redis://r/13"
    assert "IDEMPOTENCY_CLAIM_MODE" not in bench_app.subject_config("pg", "x", "y")


def test_without_the_setting_claim_mode_subjects_say_why_they_cannot_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(bench_app, "claim_mode_available", lambda: False)
    reason = bench_app.unavailable("pg-txclaim")
    assert reason is not None and "IDEMPOTENCY_CLAIM_MODE" in reason and "claim_mode" in reason
    with pytest.raises(SystemExit, match="IDEMPOTENCY_CLAIM_MODE"):
        runner.choose_subjects("pg,pg+redis-txclaim")
    with pytest.raises(RuntimeError, match="IDEMPOTENCY_CLAIM_MODE"):
        bench_app.create_app("pg-txclaim")


def test_a_missing_peer_is_left_out_of_the_default_run_with_a_note(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(
        bench_app, "find_spec", lambda name: None if name == "idemkit" else find_spec(name)
    )
    subjects, notes = runner.choose_subjects(None)
    assert "idemkit-pg" not in subjects and "bare" in subjects
    assert any("idemkit" in n and bench_app.PEERS_REQUIREMENTS in n for n in notes), notes
    with pytest.raises(SystemExit, match="requirements-peers.txt"):
        runner.choose_subjects("idemkit-pg")


def test_named_subjects_always_include_bare_and_keep_the_report_order() -> None:
    subjects, notes = runner.choose_subjects("minimum-pg+redis,pg")
    assert subjects == ["bare", "pg", "minimum-pg+redis"] and notes == []


@pytest.mark.parametrize("subject", [bench_app.MINIMUM, *PEER_PARAMS])
def test_a_subject_executes_once_and_replays(
    subject: str, clean_db: str, clean_redis: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In-process: first requests run the business INSERT; replays answer the
    stored 201 without inserting again."""
    monkeypatch.setenv("BENCH_DATABASE_URL", clean_db)
    monkeypatch.setenv("BENCH_REDIS_URL", clean_redis)
    for path in ("first", "replay"):
        probe = inprocess.measure(subject, path, n=5, warmup=1)
        assert sum(probe.answers.values()) == 5
        assert all(status.startswith("201") for status, _ in probe.answers), probe.answers
    rows = count_rows(clean_db, "bench_charges")
    # measure(): one request to complete the replay key, a warm-up and five
    # first requests, then one more key completed for the replay run.
    assert rows == 1 + 1 + 5 + 1


def test_the_minimum_refuses_a_duplicate_in_flight_and_another_body(
    clean_db: str, clean_redis: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import psycopg2

    monkeypatch.setenv("BENCH_DATABASE_URL", clean_db)
    monkeypatch.setenv("BENCH_REDIS_URL", clean_redis)
    bench_app.prepare_database(clean_db, [bench_app.MINIMUM])
    client = bench_app.create_app(bench_app.MINIMUM).test_client()

    def post(key: str | None, body: bytes = REQUEST_BODY) -> TestResponse:
        headers = {"Idempotency-Key": key} if key else {}
        return client.post("/charges", data=body, headers=headers, content_type=JSON)

    conn = psycopg2.connect(clean_db)
    try:
        with conn, conn.cursor() as cur:  # a claim whose first request is still running
            cur.execute(
                "INSERT INTO bench_minimum_keys (key, fingerprint) VALUES ('busy', %s)",
                (hashlib.sha256(REQUEST_BODY).hexdigest(),),
            )
    finally:
        conn.close()
    assert post("busy").status_code == 409
    first = post("k")
    assert first.status_code == 201 and first.headers["Idempotent-Replayed"] == "false"
    again = post("k")
    assert again.status_code == 201 and again.headers["Idempotent-Replayed"] == "true"
    assert again.get_data() == first.get_data()
    assert post("k", b'{"amount": 1, "currency": "usd"}').status_code == 422
    assert post(None).status_code == 400
    assert count_rows(clean_db, "bench_charges") == 1


FIRST_INSTALLED_PEER = next((s for s in bench_app.PEERS if _installed(s)), None)


@pytest.mark.skipif(not cpu.available(), reason="needs Linux /proc")
@pytest.mark.skipif(
    FIRST_INSTALLED_PEER is None,
    reason=f"no peer is installed (pip install -r {bench_app.PEERS_REQUIREMENTS})",
)
def test_a_short_run_measures_a_peer_through_gunicorn(
    clean_db: str, clean_redis: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """End to end: the first installed peer behind its gunicorn, next to bare,
    answers 201s on both paths; the report lists it side by side with its version."""
    peer = FIRST_INSTALLED_PEER
    assert peer is not None
    argv = ["--subjects", peer, "--paths", "first,replay", "--rounds", "1", "--duration", "0.5"]
    argv += ["--warmup", "0", "--connections", "2", "--replay-keys", "5", "--load", "python"]
    argv += ["--database-url", clean_db, "--redis-url", clean_redis, "--output-dir", str(tmp_path)]
    assert runner.main(argv) == 0
    capsys.readouterr()
    report = (tmp_path / "latest.md").read_text()
    side_by_side = report.split("## Side by side", 1)[1].split("## Every cell", 1)[0]
    assert f"| {peer} |" in side_by_side
    for path in ("first", "replay"):
        for conns in (1, 2):
            rows = [
                r for r in report.splitlines() if r.startswith(f"| {path} | {conns} | {peer} |")
            ]
            assert len(rows) == 1 and rows[0].endswith("| 201: 100% |"), rows
    distribution = bench_app.PEERS[peer][1].split("[")[0]
    assert f"Peers from the package index: {distribution} " in report
