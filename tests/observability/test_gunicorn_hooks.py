"""A user's app under gunicorn with two workers: Prometheus with and without the shipped hooks.

With ``from flask_idempotency.gunicorn import ...`` as their gunicorn.conf.py's only
line, every scrape counts every request whichever worker answers it, and a killed
worker's live gauges leave the sums. Without it, each worker logs an ERROR and
every scrape carries ``flask_idempotency_metrics_multiprocess_misconfigured 1``
instead of silently showing one worker's figures.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from flask import Flask, Response
from prometheus_client.parser import text_string_to_metric_families

from flask_idempotency import Idempotency
from flask_idempotency import gunicorn as hooks
from flask_idempotency.workers import gunicorn_workers
from support.servers import GunicornFactory, GunicornServer, http_request
from support.waiting import wait_until

POOL_SIZE = 3
WORKERS = 2
MISCONFIGURED = "flask_idempotency_metrics_multiprocess_misconfigured"
#: What the worker logs (once) when it serves its own figures alone.
ERROR = "without prometheus-client's multiprocess mode"
HOOKS_CONF = (
    "from flask_idempotency.gunicorn import child_exit, on_exit, on_starting, post_worker_init"
    "  # noqa: F401\n"
)

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="finds the workers through /proc"
)


def create_app() -> Flask:
    """An app as the docs write it: the extension, its Prometheus metrics, GET /metrics."""
    from flask_idempotency.observability.prometheus import PrometheusMetrics

    app = Flask(__name__)
    app.config.update(
        IDEMPOTENCY_DATABASE_URL=os.environ["DATABASE_URL"],
        IDEMPOTENCY_AUTO_MIGRATE=True,
        IDEMPOTENCY_SCOPE_FUNC=lambda request: "hooks-tests",
        IDEMPOTENCY_DATABASE_OPTIONS={"pool_size": POOL_SIZE},
    )
    idempotency = Idempotency(app)
    metrics = PrometheusMetrics(app)

    @app.post("/charges")
    @idempotency.required
    def charges() -> tuple[Response, int]:
        return Response(b'{"ok": true}', content_type="application/json"), 201

    @app.get("/metrics")
    def prometheus_metrics() -> Response:
        return metrics.response()

    return app


def scrape(server: GunicornServer) -> dict[str, float]:
    """Each sample's value, summed over its labels' other values, by name and outcome."""
    answer = http_request("GET", server.url + "/metrics")
    assert answer.status == 200, answer
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(answer.body.decode()):
        for sample in family.samples:
            name = sample.name + "/" + sample.labels.get("outcome", "")
            found[name] = found.get(name, 0) + sample.value
    return found


def start(
    factory: GunicornFactory,
    tmp_path: Path,
    conf: str,
    db: str,
    workers: int,
    extra_args: tuple[str, ...] = (),
) -> GunicornServer:
    config = tmp_path / "gunicorn.conf.py"
    config.write_text(conf)
    environ = {"DATABASE_URL": db}
    return factory(
        "observability.test_gunicorn_hooks:create_app()",
        config=config,
        workers=workers,
        worker_class="gthread",
        threads=2,
        env=environ,
        extra_args=extra_args,
    )


def test_the_shipped_hooks_add_up_every_worker_and_drop_dead_ones(
    gunicorn_server: GunicornFactory, clean_db: str, tmp_path: Path
) -> None:
    server = start(gunicorn_server, tmp_path, HOOKS_CONF, clean_db, WORKERS)
    found = re.search(r"prometheus multiprocess directory: (\S+)", server.log_text())
    assert found, server.log_text()
    directory = Path(found[1])  # made by on_starting: none was set
    pool_max = "flask_idempotency_pool_connections_max/"
    wait_until(lambda: scrape(server)[pool_max] == WORKERS * POOL_SIZE, 30, "both workers' apps")
    sent = 12
    for n in range(sent):
        answer = http_request(
            "POST", server.url + "/charges", {"Idempotency-Key": f"k-{n}"}, json={"n": n}
        )
        assert answer.status == 201, answer
    for _ in range(3 * WORKERS):  # whichever worker answers, it counts them all
        samples = scrape(server)
        assert samples["flask_idempotency_requests_total/executed"] == sent
        assert samples[pool_max] == WORKERS * POOL_SIZE
        assert samples[MISCONFIGURED + "/"] == 0
    assert ERROR not in server.log_text()

    # A worker killed outright: child_exit drops its live gauges (its file goes),
    # its counts stay, and its replacement's pool joins the sum.
    victim = server.worker_pids()[0]
    assert (directory / f"gauge_livesum_{victim}.db").exists()
    server.kill_worker(victim)
    server.wait_for_workers(exclude=[victim])
    wait_until(
        lambda: not (directory / f"gauge_livesum_{victim}.db").exists(), 10, "mark_process_dead"
    )
    wait_until(
        lambda: len(list(directory.glob("gauge_livesum_*.db"))) == WORKERS, 30, "the new worker"
    )
    # Its file appears with its first gauge, before its pool is built and counted.
    wait_until(lambda: scrape(server)[pool_max] == WORKERS * POOL_SIZE, 30, "the new worker's pool")
    for _ in range(2 * WORKERS):
        samples = scrape(server)
        assert samples["flask_idempotency_requests_total/executed"] == sent
        assert samples[pool_max] == WORKERS * POOL_SIZE  # not 3 workers' worth

    server.stop()
    assert not directory.exists()  # on_exit removed what on_starting made


@pytest.mark.parametrize("workers", [WORKERS, 1])
def test_without_the_hooks_several_workers_say_so_in_the_log_and_the_scrape(
    gunicorn_server: GunicornFactory, clean_db: str, tmp_path: Path, workers: int
) -> None:
    server = start(gunicorn_server, tmp_path, "", clean_db, workers)
    # Every worker builds its app (and checks) at start-up; each logs once.
    if workers > 1:
        wait_until(lambda: server.log_text().count(ERROR) == workers, 30, "one ERROR per worker")
    for _ in range(3 * workers):
        assert scrape(server)[MISCONFIGURED + "/"] == (1 if workers > 1 else 0)
    log = server.log_text()
    assert log.count(ERROR) == (workers if workers > 1 else 0), log
    if workers > 1:
        assert "from flask_idempotency.gunicorn import" in log  # the fix, in the message


def test_without_the_hooks_a_preloaded_app_says_so_too(
    gunicorn_server: GunicornFactory, clean_db: str, tmp_path: Path
) -> None:
    """With ``preload_app`` the app is built in the master, under the arbiter; the
    workers forked from it check again when they answer a scrape."""
    server = start(gunicorn_server, tmp_path, "", clean_db, WORKERS, ("--preload",))
    for _ in range(3 * WORKERS):
        assert scrape(server)[MISCONFIGURED + "/"] == 1
    # The master's, then each scraped worker's: found from a request's thread too.
    assert server.log_text().count(ERROR) >= 2, server.log_text()


def test_outside_gunicorn_there_is_no_worker_count() -> None:
    assert gunicorn_workers() is None


def forget_preparation(monkeypatch: pytest.MonkeyPatch) -> None:
    """No earlier preparation in this process, and none left behind by the test."""
    monkeypatch.setenv("FLASK_IDEMPOTENCY_METRICS_DIR_PREPARED", "")
    monkeypatch.delenv("FLASK_IDEMPOTENCY_METRICS_DIR_PREPARED")


def test_a_directory_that_was_set_is_emptied_and_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    given = tmp_path / "metrics"
    given.mkdir()
    (given / "counter_1.db").write_bytes(b"an earlier run's")
    (given / "notes.txt").write_text("not prometheus-client's")
    monkeypatch.setenv(hooks.MULTIPROC_ENV, str(given))
    forget_preparation(monkeypatch)
    assert hooks.prepare_metrics_dir() == given
    assert sorted(p.name for p in given.iterdir()) == ["notes.txt"]
    (given / "counter_2.db").write_bytes(b"this run's")
    assert hooks.prepare_metrics_dir() == given  # again (a reloaded config): left alone
    assert (given / "counter_2.db").exists()
    hooks.remove_metrics_dir()
    assert given.exists()  # never removed: the user's


def test_a_directory_made_is_removed_on_exit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(hooks.MULTIPROC_ENV, "")  # restored (unset) after the test
    monkeypatch.delenv(hooks.MULTIPROC_ENV)
    forget_preparation(monkeypatch)
    made = hooks.prepare_metrics_dir()
    assert made is not None and made.is_dir()
    assert os.environ[hooks.MULTIPROC_ENV] == str(made)
    hooks.remove_metrics_dir()
    assert not made.exists()


SCRAPE_WHILE_A_WORKER_STARTS = """
import sys, threading
from flask import Flask
from prometheus_client.mmap_dict import MmapedDict
from flask_idempotency.observability.prometheus import PrometheusMetrics

starting = sys.argv[1] + "/counter_999.db"
open(starting, "wb").close()  # opened by the new worker, not yet sized
if sys.argv[2] != "never":
    threading.Timer(float(sys.argv[2]), MmapedDict, [starting]).start()  # ... now sized
body, _ = PrometheusMetrics(registry=None).exposition()
print(len(body))
"""


def scrape_while_a_worker_starts(
    directory: Path, sized_after: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", SCRAPE_WHILE_A_WORKER_STARTS, str(directory), sized_after],
        env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(directory)},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("sized_after", ["0.015", "0.4"])
def test_a_scrape_while_a_worker_creates_its_file_waits_for_it(
    tmp_path: Path, sized_after: str
) -> None:
    """prometheus-client opens a worker's file, then sizes it; a scrape between the
    two used to fail (500) while gunicorn started or replaced a worker, and on a
    loaded host the gap is far longer than on an idle one."""
    run = scrape_while_a_worker_starts(tmp_path, sized_after)
    assert run.returncode == 0, run.stderr
    assert int(run.stdout) > 0


def test_a_file_that_is_never_sized_fails_the_scrape_rather_than_hanging_it(
    tmp_path: Path,
) -> None:
    run = scrape_while_a_worker_starts(tmp_path, "never")
    assert run.returncode != 0
    assert "struct.error" in run.stderr
