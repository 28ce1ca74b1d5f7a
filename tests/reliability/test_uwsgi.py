"""The payments API under uWSGI (the project's ``uwsgi.ini``): the gunicorn drills again.

uWSGI loads the app once in its master, which runs statements at start-up (the
migrations, the database's identity), then forks the workers, and forks a new one
from the master again when a worker dies. Python's at-fork hooks run only with
``py-call-osafterfork``, which the ini does not set, so the extension must notice
a new process by itself: its pool must not lend a connection the master opened,
and its statement watchdog (a thread of the master's, which a forked worker does
not have) must run in each worker. The drills, as under gunicorn
(test_storm.py, test_crash.py, test_pg_frozen.py), on a master with several
threaded workers:

* a duplicate storm: each key charged exactly once, every duplicate answered
  ``409 in_progress`` or the stored answer, byte for byte;
* SIGKILLed workers (replaced by forks of the master): a killed worker's claim is
  taken over by a retry once its lease has run out (no SQL moves it here: the
  lease is short), exactly one charge per key;
* PostgreSQL stalled behind a proxy: the statements already sent on the workers'
  connections are cut by the watchdog at their deadline (``503
  store_unavailable``), not left waiting on the stalled server.
"""

from __future__ import annotations

import os
import random
import re
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from support.gunicorn_server import REPO_ROOT
from support.uwsgi_server import UWSGI_INI, UwsgiServer, uwsgi_command

from .figures import Figures
from .load import (
    Answer,
    Call,
    Connections,
    charge_body,
    charge_call,
    retry_until_final,
    run_all,
    status_counts,
)
from .stack import Stack, StackOptions, own_database, running_stack
from .storm import assert_each_key_ran_once, run_storm, tally

pytestmark = pytest.mark.reliability

WORKERS = 3
THREADS = 4
#: Short, so a killed worker's claim lapses within the test, and the processor
#: timeout below it (the app refuses to start otherwise).
LEASE = 3.0
PROCESSOR_TIMEOUT = 2.0
#: The extension's deadline for one statement: the default statement_timeout (5 s)
#: plus 1 s of grace. A request may meet two: one queued behind a stuck one on its
#: worker, admitted before the breaker opened (test_pg_frozen.py), then a loaded
#: machine's slack.
DEADLINE = 6.0
ANSWER_BOUND = 2 * DEADLINE + 2.0


@pytest.fixture(scope="module")
def uwsgi_stack(server_database_url: str, stack_redis_url: str) -> Iterator[Stack]:
    if uwsgi_command() is None:
        message = "no uwsgi command: pip install pyuwsgi (the dev extra installs it)"
        if os.environ.get("CI"):
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    options = StackOptions(
        server="uwsgi",
        workers=WORKERS,
        threads=THREADS,
        lease_seconds=LEASE,
        processor_timeout=PROCESSOR_TIMEOUT,
        pg_proxy=True,
    )
    with (
        own_database(server_database_url) as url,
        running_stack(url, stack_redis_url, options) as stack,
    ):
        yield stack


def server(stack: Stack) -> UwsgiServer:
    assert isinstance(stack.app, UwsgiServer)
    return stack.app


def test_the_app_is_loaded_in_the_master_and_forked_without_at_fork_hooks(
    uwsgi_stack: Stack,
) -> None:
    """The setting the drills below are about, read off the running server."""
    app = server(uwsgi_stack)
    settings = [line.split(";")[0].strip() for line in UWSGI_INI.read_text().splitlines()]
    assert not any(s.startswith(("py-call-osafterfork", "lazy")) for s in settings)
    assert not any("osafterfork" in arg or "lazy" in arg for arg in app.argv())
    log = app.log_text()
    assert "*** Operational MODE: preforking+threaded ***" in log
    loaded = re.search(r"WSGI app 0 \(mountpoint=''\) ready in .* pid: (\d+)", log)
    assert loaded, log[-2000:]
    assert int(loaded.group(1)) == app.master_pid, "the app was not loaded in the master"
    assert len(app.worker_pids()) == WORKERS


def test_the_deployment_page_shows_this_ini() -> None:
    """docs/deployment.md's uWSGI section shows the file these drills run, verbatim."""
    page = (REPO_ROOT / "docs" / "deployment.md").read_text()
    section = page.split("## Under uWSGI\n", 1)[1].split("\n## ", 1)[0]
    shown = re.findall(r"^```ini\n(.*?)^```$", section, re.MULTILINE | re.DOTALL)
    assert shown == [UWSGI_INI.read_text()]


def test_metrics_add_up_across_workers(uwsgi_stack: Stack, api_key: str, run_id: str) -> None:
    """uwsgi.ini's multiprocess directory: every scrape, whichever worker answers it,
    counts every worker's charges. As many slow charges at once as the workers have
    threads, so that every worker serves some."""
    stack = uwsgi_stack
    calls = [
        charge_call(api_key, f"uwsgi-metrics-{run_id}{i}", charge_body(300, f"{run_id}m{i}"))
        for i in range(WORKERS * THREADS)
    ]
    stack.control(latency_seconds=0.5)
    connections = stack.connections(keep_alive=False)
    try:
        charged = run_all(connections, calls, threads=len(calls))
        scrapes = run_all(connections, [Call("GET", "/metrics")] * 4 * WORKERS, threads=WORKERS)
    finally:
        connections.close()
        stack.control(latency_seconds=0)
    assert all(a.status == 201 for a in charged), status_counts(charged)
    # Every stored answer of this stack's database was one "executed" request.
    stored = stack.query("SELECT count(*) FROM idempotency_records WHERE state = 'completed'")
    executed = re.compile(
        r'^flask_idempotency_requests_total\{outcome="executed",route="/v1/charges",source=""\} '
        r"(\S+)$",
        re.MULTILINE,
    )
    for scrape in scrapes:
        assert scrape.status == 200, scrape.describe()
        found = executed.search(scrape.body.decode())
        assert found, scrape.body.decode()[:2000]
        assert float(found.group(1)) == stored[0][0], "a scrape shows some workers only"
        assert b"flask_idempotency_metrics_multiprocess_misconfigured 0.0" in scrape.body


#: Storm: keys sent by this many clients at once, a few keys per wave.
KEYS = 60
DUPLICATES = 12
KEYS_PER_WAVE = 3
STORM_LATENCY = 0.05


def test_storm_executes_each_key_exactly_once(
    uwsgi_stack: Stack, api_key: str, run_id: str, figures: Figures
) -> None:
    stack = uwsgi_stack
    prefix = f"{run_id}s"
    stack.control(latency_seconds=STORM_LATENCY)
    try:
        run = run_storm(
            stack,
            stack.connections(keep_alive=False),
            api_key,
            prefix,
            keys=KEYS,
            duplicates=DUPLICATES,
            keys_per_wave=KEYS_PER_WAVE,
            replay_threads=8,
        )
    finally:
        stack.control(latency_seconds=0)
    counted = tally(stack, prefix)
    figures(
        requests_sent=len(run.storm),
        keys=KEYS,
        concurrent_per_key=DUPLICATES,
        seconds=round(run.seconds, 1),
        outcomes=status_counts(run.storm),
        replays_after=status_counts(run.after),
        **counted.figures(),
    )
    assert any(a.status == 409 for a in run.storm), "no duplicate met a running claim"
    assert_each_key_ran_once(stack, run, counted)


#: Crash drill: kills while a batch of charges waits on a slow processor.
KILLS = 6
BATCH = 6
CRASH_LATENCY = 1.0
#: A replacement is a fork of the master, which holds the app already: it serves
#: at once, unlike a gunicorn worker that imports the app after its fork.
SETTLE_AFTER_KILL = 0.5


def test_killed_workers_leave_exactly_one_charge_per_key(
    uwsgi_stack: Stack, api_key: str, run_id: str, figures: Figures
) -> None:
    stack = uwsgi_stack
    app = server(stack)
    prefix = f"{run_id}k"
    rng = random.Random(39)
    connections = Connections(stack.url, timeout=20, keep_alive=False)
    calls: dict[str, Call] = {}
    customers: dict[str, str] = {}
    in_flight: list[Future[Answer]] = []
    killed: list[int] = []
    stack.control(latency_seconds=CRASH_LATENCY)
    try:
        with ThreadPoolExecutor(max_workers=BATCH * 2, thread_name_prefix="crash") as pool:
            for round_ in range(KILLS):
                for j in range(BATCH):
                    n = round_ * BATCH + j
                    key = f"uwsgi-crash-{prefix}{n}"
                    customers[key] = f"{prefix}{n}"
                    calls[key] = charge_call(api_key, key, charge_body(500 + n, customers[key]))
                    in_flight.append(pool.submit(connections.send, calls[key]))
                time.sleep(CRASH_LATENCY / 2)  # claimed, waiting on the processor
                victim = rng.choice(app.worker_pids())
                app.kill_worker(victim)
                killed.append(victim)
                app.wait_for_workers(exclude=killed)
                time.sleep(SETTLE_AFTER_KILL)
            during = [future.result(timeout=60) for future in in_flight]
        stuck_after_kills = stack.record_states()["processing"]
        # The clients retry, honouring Retry-After: 409 in_progress until the dead
        # holders' leases run out (nobody renews them), then a takeover runs the charge.
        final, retries = retry_until_final(connections, list(calls.values()), deadline=45)
        replays = {key: connections.send(call) for key, call in calls.items()}
    finally:
        connections.close()
        stack.control(latency_seconds=0)

    calls_seen, charged = stack.processor_counts(prefix)
    rows = stack.charge_ids(prefix)
    states = stack.record_states()
    figures(
        kills=len(killed),
        requests_in_flight=len(during),
        outcomes_during_kills=status_counts(during),
        stuck_processing_after_kills=stuck_after_kills,
        takeovers=stack.takeovers(),
        retries=dict(retries),
        processor_calls=dict(stack.processor_outcomes(prefix)),
        effective_charges=sum(charged.values()),
        charge_rows=sum(len(ids) for ids in rows.values()),
        records=dict(states),
    )

    cut = [a for a in during if a.status == 0]
    assert cut, "no kill hit a request in flight: the drill exercised nothing"
    assert all(a.status == 201 for a in during if a.status != 0), status_counts(during)
    if os.environ.get("IDEMPOTENCY_CLAIM_MODE") == "transaction":
        assert stuck_after_kills == 0, "a transaction-mode claim outlived its session"
    else:
        assert stuck_after_kills > 0, "no claim was left behind by a killed worker"
        assert stack.takeovers() >= stuck_after_kills
    for key, customer in customers.items():
        assert final[key].status == 201, f"{key}: {final[key].describe()}"
        assert charged[customer] == 1, f"{key}: {charged[customer]} effective charges"
        assert rows.get(customer, []) == [final[key].json()["id"]], key
        assert replays[key].status == 201 and replays[key].body == final[key].body, key
    assert states["processing"] == 0, f"records left processing: {dict(states)}"
    for answer in during:
        if answer.status == 201:
            assert answer.body == final[answer.call.tag].body


def test_statements_on_a_stalled_server_are_cut_at_their_deadline(
    uwsgi_stack: Stack, api_key: str, run_id: str, figures: Figures
) -> None:
    stack = uwsgi_stack
    proxy = stack.pg_proxy
    assert proxy is not None
    prefix = f"{run_id}f"
    connections = Connections(stack.url, timeout=30, keep_alive=False)

    def batch(name: str, size: int) -> list[Call]:
        customers = [f"{prefix}{name}{i}" for i in range(size)]
        return [charge_call(api_key, f"uwsgi-{c}", charge_body(700, c)) for c in customers]

    try:
        # Every thread of every worker claims once: each worker's pool holds open
        # connections, on which the next statements are sent.
        warm = run_all(connections, batch("warm", 3 * WORKERS * THREADS), threads=WORKERS * THREADS)
        assert all(a.status == 201 for a in warm), status_counts(warm)
        frozen_calls = batch("frozen", WORKERS * THREADS)
        proxy.stall()
        try:
            frozen = run_all(connections, frozen_calls, threads=WORKERS * THREADS)
        finally:
            proxy.resume(reset=True)
        final, retries = retry_until_final(connections, frozen_calls, deadline=60)
    finally:
        connections.close()

    seconds = sorted(a.finished - a.started for a in frozen)
    figures(
        requests=len(frozen),
        outcomes=status_counts(frozen),
        slowest_seconds=round(seconds[-1], 2),
        median_seconds=round(seconds[len(seconds) // 2], 2),
        answer_bound_seconds=ANSWER_BOUND,
        retries_after_thaw=dict(retries),
    )
    assert all(a.status == 503 and a.code == "store_unavailable" for a in frozen), [
        a.describe() for a in frozen
    ]
    assert all(a.headers.get("retry-after", "").isdigit() for a in frozen)
    assert seconds[-1] <= ANSWER_BOUND, f"an answer took {seconds[-1]:.1f} s: {seconds}"
    _, charged = stack.processor_counts(prefix)
    for call in frozen_calls:
        assert final[call.tag].status == 201, final[call.tag].describe()
    assert sum(charged.values()) == len(warm) + len(frozen_calls)
    assert all(n == 1 for n in charged.values()), charged
