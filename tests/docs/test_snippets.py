"""Every Python and shell block of the README and the docs runs, or says it is illustrative.

``snippets.py`` has the convention. Each test below runs a page (or some of its
sections) the way a reader would, against the run's PostgreSQL (a database of
its own), Redis and RabbitMQ, then checks what the reader was told to expect.
"""

from __future__ import annotations

import re
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg2
import pytest

from .snippets import ROOT, Block, Page, blocks, describe, documents, free_port, runs, section_lines

DOCS = ROOT / "docs"

#: What the tests below run: a document and its sections (empty: the whole page).
#: A block that is neither run here nor marked ``illustrative`` fails
#: ``test_every_block_is_run_or_illustrative``.
#: docs/testing.md's unit tests on memory://, run as a reader would.
MEMORY_SECTION = "Unit tests without PostgreSQL: `memory://`"
#: docs/testing.md's conftest for a `db=db` app, run against tests/docs/fsa_app/yourapp.py.
FSA_SECTION = "A Flask-SQLAlchemy app"

COVERED: dict[Path, tuple[str, ...]] = {
    ROOT / "README.md": ("Quickstart",),
    DOCS / "quickstart.md": ("With Flask-SQLAlchemy", "With a psycopg2 connection", "Try it"),
    DOCS / "events.md": (),
    DOCS / "celery.md": ("A first idempotent task",),
    DOCS / "observability.md": (),
    DOCS / "deployment.md": ("Health checks",),
    DOCS / "client-retries.md": (),
    DOCS / "testing.md": (MEMORY_SECTION, FSA_SECTION),
}


def test_every_block_is_run_or_illustrative() -> None:
    unmarked, bad = [], []
    for path in documents():
        sections = COVERED.get(path)
        ranges = [section_lines(path, name) for name in sections or ()] or [(0, 10**9)]
        for block in blocks(path):
            if block.bad_words():
                bad.append(block)
            if not runs(block) or not block.runnable_language:
                continue
            if sections is None or not any(start <= block.line < end for start, end in ranges):
                unmarked.append(block)
    assert not bad, "unknown words after the language:\n" + describe(bad)
    assert not unmarked, "blocks neither run by tests/docs nor marked illustrative:\n" + describe(
        unmarked
    )


@pytest.fixture
def page_env(tmp_path: Path, fresh_database_url: str, redis_url: str) -> Iterator[dict[str, str]]:
    """Where a page runs: its port, and the placeholders of the docs replaced."""
    port = free_port()
    yield {
        "port": str(port),
        "postgresql+psycopg2://localhost/payments": _with_scheme(
            fresh_database_url, "postgresql+psycopg2"
        ),
        "postgresql://localhost/payments": fresh_database_url,
        "redis://localhost:6379/0": redis_url,
        "localhost:5000": f"127.0.0.1:{port}",
        "localhost:8000": f"127.0.0.1:{port}",
        "127.0.0.1:8000": f"127.0.0.1:{port}",
    }


def _with_scheme(url: str, scheme: str) -> str:
    return scheme + url[url.index("://") :]


def make_page(path: Path, workdir: Path, substitutions: dict[str, str]) -> Page:
    port = int(substitutions.pop("port"))
    return Page(
        path,
        workdir,
        substitutions=substitutions,
        port=port,
        env={"FLASK_RUN_PORT": str(port), "GUNICORN_CMD_ARGS": f"--bind 127.0.0.1:{port}"},
    )


def count(database_url: str, table: str) -> int:
    conn = psycopg2.connect(database_url)
    try:
        with conn.cursor() as cur:
            cur.execute(f"SELECT count(*) FROM {table}")
            row = cur.fetchone()
            assert row is not None
            return int(row[0])
    finally:
        conn.close()


def check_try_it(page: Page) -> None:
    """The three requests of "Try it": created, replayed, refused."""
    answers = re.split(r"(?=HTTP/1\.[01] )", page.output_of("Idempotency-Key: order-1001"))
    answers = [a for a in answers if a.startswith("HTTP/")]
    assert len(answers) == 3, answers
    first, replay, reused = answers
    assert first.startswith("HTTP/1.1 201") and "Idempotent-Replayed: false" in first
    assert replay.startswith("HTTP/1.1 201") and "Idempotent-Replayed: true" in replay
    assert first.split("\r\n\r\n", 1)[1] == replay.split("\r\n\r\n", 1)[1]
    assert reused.startswith("HTTP/1.1 422") and '"key_reused"' in reused


@pytest.mark.parametrize(
    ("section", "table"),
    [("With Flask-SQLAlchemy", "charge"), ("With a psycopg2 connection", "charges")],
)
def test_quickstart(
    tmp_path: Path, page_env: dict[str, str], fresh_database_url: str, section: str, table: str
) -> None:
    page = make_page(DOCS / "quickstart.md", tmp_path, page_env)
    try:
        page.run(section, "Try it")
        check_try_it(page)
    finally:
        page.stop()
    assert count(fresh_database_url, table) == 1


def test_readme_quickstart(
    tmp_path: Path, page_env: dict[str, str], fresh_database_url: str
) -> None:
    # The README's `sleep 2` is a reader's guess at `flask run`'s start-up; on a loaded
    # 2-core CI (the suite runs on xdist workers) it may be short: wait for the port,
    # at most 60 s, instead. The requests that follow are the README's own.
    port = page_env["port"]
    page_env["sleep 2\n"] = (
        f"for _ in $(seq 300); do (exec 3<>/dev/tcp/127.0.0.1/{port}) 2>/dev/null && break;"
        " sleep 0.2; done\n"
    )
    page = make_page(ROOT / "README.md", tmp_path, page_env)
    try:
        page.run("Quickstart")
        check_try_it(page)
    finally:
        page.stop()
    assert count(fresh_database_url, "charge") == 1


def test_events_end_to_end_through_rabbitmq(
    tmp_path: Path, page_env: dict[str, str], fresh_database_url: str, amqp_url: str
) -> None:
    """The route emits, the relay publishes to the exchange the consumer bound, the
    consumer writes one receipt; a second relay run and a replay add nothing."""
    prefix = "docs-" + secrets.token_hex(4)
    page_env |= {
        "amqp://guest:guest@localhost:5672//": amqp_url,
        '"payments.events"': f'"{prefix}.events"',
        '"receipts"': f'"{prefix}.receipts"',
    }
    page = make_page(DOCS / "events.md", tmp_path, page_env)
    try:
        page.run()
        relay = page.output_of("idempotency relay --once")
        assert "unroutable" not in relay, relay
        _wait_for(lambda: count(fresh_database_url, "receipts") == 1, page)
        page.run_block(_block(page, "idempotency relay --once"))  # nothing pending: no-op
        page.run_block(_block(page, "Idempotency-Key: order-1001"))  # a replay: no event
        page.run_block(_block(page, "idempotency relay --once"))
        time.sleep(1)
        assert count(fresh_database_url, "receipts") == 1
        assert count(fresh_database_url, "charges") == 1
    finally:
        page.stop()
        _delete_broker_names(amqp_url, prefix)


def test_celery_task_through_db_session_runs_once(
    tmp_path: Path,
    page_env: dict[str, str],
    fresh_database_url: str,
    amqp_url: str,
    redis_url: str,
) -> None:
    """The page's worker and three publishes of one call: three equal results, one
    receipt written through db.session, on a queue of the test's own."""
    queue = "docs-" + secrets.token_hex(4)
    page_env |= {
        "amqp://guest:guest@localhost:5672//": amqp_url,
        "redis://localhost:6379/1": redis_url,
        '"payments-tasks"': f'"{queue}"',
    }
    page = make_page(DOCS / "celery.md", tmp_path, page_env)
    try:
        page.run("A first idempotent task")
    finally:
        page.stop()
        _delete_queue(amqp_url, queue)
    printed = page.output_of("tasks.demo()").strip().splitlines()[-1]
    expected = {"charge": "ch_1", "amount": 1500}
    assert printed == repr([expected] * 3), printed
    assert count(fresh_database_url, "receipts") == 1
    assert count(fresh_database_url, "idempotency_records") == 1
    worker_log = page.logs()
    assert "Traceback" not in worker_log, worker_log


def _delete_queue(url: str, queue: str) -> None:
    import kombu

    with kombu.Connection(url, connect_timeout=5) as conn:
        try:
            conn.channel().queue_delete(queue)
        except Exception:  # never declared, or already gone
            pass


def _block(page: Page, contains: str) -> Block:
    for block in blocks(page.path):
        if contains in block.text and runs(block):
            return block
    raise KeyError(contains)


def _wait_for(condition: Callable[[], bool], page: Page, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting\n{page.logs()}")
        time.sleep(0.2)


def _delete_broker_names(url: str, prefix: str) -> None:
    import kombu

    with kombu.Connection(url, connect_timeout=5) as conn:
        for name, kind in (
            (f"{prefix}.receipts", "queue"),
            (f"{prefix}.receipts.dlq", "queue"),
            (f"{prefix}.events", "exchange"),
        ):
            channel = conn.channel()
            try:
                if kind == "queue":
                    channel.queue_delete(name)
                else:
                    channel.exchange_delete(name)
            except Exception:  # already gone
                pass


def test_prometheus_under_gunicorn_adds_up_workers(
    tmp_path: Path, page_env: dict[str, str]
) -> None:
    """Two workers, seven requests, the hooks imported in one line: every scrape shows
    6 executed and 1 replayed, whichever worker answers."""
    page = make_page(DOCS / "observability.md", tmp_path, page_env)
    try:
        page.run()
    finally:
        page.stop()
    scraped = page.output_of("curl -s localhost:8000/metrics")
    executed = re.findall(r'outcome="executed"[^}]*} (\S+)', scraped)
    replayed = re.findall(r'outcome="replayed"[^}]*source="store"[^}]*} (\S+)', scraped)
    assert executed == ["6.0"] * 3, scraped
    assert replayed == ["1.0"] * 3, scraped
    # The shipped hooks set up the multiprocess mode: nothing to warn about.
    misconfigured = re.findall(
        r"^flask_idempotency_metrics_multiprocess_misconfigured (\S+)", scraped, re.M
    )
    assert misconfigured == ["0.0"] * 3, scraped


def test_unit_tests_on_memory(tmp_path: Path, page_env: dict[str, str]) -> None:
    page = make_page(DOCS / "testing.md", tmp_path, page_env)
    try:
        page.run(MEMORY_SECTION)
    finally:
        page.stop()
    assert "1 passed" in page.results[-1].output


#: The app's Alembic history: one revision, as `flask db migrate` would write it.
CHARGES_REVISION = '''"""charges"""
import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade():
    op.create_table(
        "charges",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("amount", sa.Integer, nullable=False),
        sa.Column("currency", sa.String(3), nullable=False),
    )


def downgrade():
    op.drop_table("charges")
'''


def test_testing_a_flask_sqlalchemy_app(
    tmp_path: Path, page_env: dict[str, str], database_url: str, fresh_database_url: str
) -> None:
    """The page's conftest and test, verbatim, on a real Flask-SQLAlchemy + Flask-Migrate
    app: the template gets the app's Alembic tables, each test a copy, and
    assert_idempotent (with the atomicity drill) passes through db.session."""
    shutil.copy(Path(__file__).parent / "fsa_app" / "yourapp.py", tmp_path / "yourapp.py")
    page = make_page(DOCS / "testing.md", tmp_path, page_env)
    # The plugin's databases on the run's server; `flask db init` needs the app's URL.
    page.env |= {"IDEMPOTENCY_TEST_DSN": database_url, "DATABASE_URL": fresh_database_url}
    subprocess.run(
        [sys.executable, "-m", "flask", "--app", "yourapp", "db", "init"],
        cwd=tmp_path,
        env=page.env,
        check=True,
        capture_output=True,
        timeout=60,
    )
    (tmp_path / "migrations" / "versions" / "0001_charges.py").write_text(CHARGES_REVISION)
    try:
        page.run(FSA_SECTION)
    finally:
        page.stop()
    assert "1 passed" in page.results[-1].output, page.results[-1].output


def test_client_retries_page(tmp_path: Path, page_env: dict[str, str]) -> None:
    """The client page's calls: a payment, its replay under the kept key, the key
    refused for another request, and orders paying downstream through purpose_key."""
    page = make_page(DOCS / "client-retries.md", tmp_path, page_env)
    try:
        page.run()
    finally:
        page.stop()
    output = "\n".join(result.output for result in page.results)
    assert re.search(r"^201 py_1 1 False$", output, re.MULTILINE), output
    assert "replayed py_1" in output
    assert re.search(r"^refused: Idempotency-Key \(sha256 [0-9a-f]{12}\)", output, re.MULTILINE)
    # Four orders, each paid once (py_2..py_5) by its own downstream key.
    assert "{'order': 'mug', 'payment': 'py_2'} 1" in output, output
    async_payments = re.findall(r"^201 (py_\d+)$", output, re.MULTILINE)
    assert sorted(async_payments) == ["py_3", "py_4", "py_5"], output


def test_health_check(tmp_path: Path, page_env: dict[str, str]) -> None:
    page = make_page(DOCS / "deployment.md", tmp_path, page_env)
    page.run("Health checks")
    assert "200 {'status': 'ok'}" in page.results[-1].output


def test_readme_links_point_at_files() -> None:
    """The README's relative links (into docs/ and benchmarks/) name files that exist."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = re.findall(r"\]\((?!https?://|#)([^)#\s]+)", text)
    assert targets
    missing = [t for t in targets if not (ROOT / t).exists()]
    assert not missing, missing


def test_readme_is_short() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) < 150, len(lines)


def test_deployment_shows_the_gunicorn_import_the_observability_page_runs() -> None:
    """The deployment page's gunicorn.conf.py is illustrative; its import line is the
    one the observability page runs under gunicorn (above)."""

    def first_line(path: Path, starts: str) -> str:
        found = [
            line
            for block in blocks(path)
            for line in block.text.splitlines()
            if line.startswith(starts)
        ]
        assert found, path
        return found[0]

    imports = "from flask_idempotency.gunicorn import"
    assert first_line(DOCS / "deployment.md", imports) == first_line(
        DOCS / "observability.md", imports
    )
