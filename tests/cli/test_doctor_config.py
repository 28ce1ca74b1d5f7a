"""The doctor's checks of the configuration: the pool against gunicorn's settings,
leases and TTLs per route, scopes of requests without credentials, and
Prometheus' multiprocess directory under several workers."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from flask import Flask, Request, g

from flask_idempotency import global_scope, user_scope
from flask_idempotency.cli.doctor.base import FAIL, OK, WARN
from flask_idempotency.decorators import RouteDecorator
from flask_idempotency.scopes import default_scope

from .doctoring import app_on, check, doctor

required = RouteDecorator(True)


@pytest.fixture(autouse=True)
def elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Run where no gunicorn.conf.py lies around, with no GUNICORN_CMD_ARGS."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("GUNICORN_CMD_ARGS", raising=False)
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    yield tmp_path


def conf(tmp_path: Path, text: str, name: str = "gunicorn.conf.py") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# -- pool against gunicorn -------------------------------------------------------------


def test_without_gunicorn_settings_the_pool_is_only_reported(clean_db: str) -> None:
    with app_on(clean_db) as app:
        found = check(app, "pool")
    assert found.status == OK
    assert "no gunicorn settings to compare with (--gunicorn-config)" in found.detail


def test_more_threads_than_connections_warns_with_the_size_to_set(
    clean_db: str, tmp_path: Path
) -> None:
    path = conf(tmp_path, "workers = 2\nthreads = 16\n", "server.py")
    with app_on(clean_db) as app:
        code, output = doctor(app, "--gunicorn-config", path)
        assert "WARN  pool" in output
        assert (
            f'IDEMPOTENCY_DATABASE_OPTIONS["pool_size"] = 10 for 16 threads per worker ({path})'
            in output
        )
        assert '-> set IDEMPOTENCY_DATABASE_OPTIONS["pool_size"] to at least 16' in output

        (tmp_path / "server.py").write_text("workers = 2\nthreads = 8\n")
        found = check(app, "pool", gunicorn_config=path)
    assert (
        found.status == OK
        and "10 connection(s) for 8 threads per worker, 2 worker(s)" in found.detail
    )


def test_gunicorn_cmd_args_override_the_file_as_in_gunicorn(
    clean_db: str, elsewhere: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    conf(elsewhere, "threads = 4\n")  # ./gunicorn.conf.py, read as gunicorn reads it
    with app_on(clean_db) as app:
        assert check(app, "pool").status == OK
        monkeypatch.setenv("GUNICORN_CMD_ARGS", "--threads 32 --workers 3")
        found = check(app, "pool")
    assert found.status == WARN, found
    assert "for 32 threads per worker (gunicorn.conf.py + GUNICORN_CMD_ARGS)" in found.detail


def test_async_workers_are_counted_by_worker_connections(clean_db: str, tmp_path: Path) -> None:
    path = conf(tmp_path, "worker_class = 'gevent'\nworker_connections = 100\n")
    with app_on(clean_db, IDEMPOTENCY_DATABASE_OPTIONS={"pool_size": 20}) as app:
        found = check(app, "pool", gunicorn_config=path)
    assert found.status == WARN and "for 100 worker_connections (gevent)" in found.detail


def test_the_config_files_environment_does_not_leak_into_the_doctor(
    clean_db: str, tmp_path: Path
) -> None:
    path = conf(tmp_path, "import os\nos.environ['DOCTOR_TEST_SET_BY_CONF'] = '1'\n")
    with app_on(clean_db) as app:
        check(app, "pool", gunicorn_config=path)
    assert "DOCTOR_TEST_SET_BY_CONF" not in os.environ


def test_a_broken_config_file_fails_its_checks_not_the_doctor(
    clean_db: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = conf(tmp_path, "threads = 1/0\n")
    with app_on(clean_db) as app:
        found = check(app, "pool", gunicorn_config=path)
        assert found.status == FAIL and "ZeroDivisionError" in found.detail
        conf(tmp_path, "import sys\nsys.exit(3)\n")
        found = check(app, "pool", gunicorn_config=path)
        assert found.status == FAIL and "exited (3) while being read" in found.detail
        monkeypatch.setenv("GUNICORN_CMD_ARGS", "--no-such-option")
        found = check(app, "pool")
    assert found.status == FAIL and "GUNICORN_CMD_ARGS is not valid" in found.detail


# -- leases --------------------------------------------------------------------------------


def add_route(app: Flask, path: str, **options: object) -> None:
    def view() -> str:
        return "ok"

    view.__name__ = path.strip("/").replace("/", "_") or "root"
    app.post(path)(required(**options)(view))  # type: ignore[call-overload]


def test_a_route_lease_shorter_than_the_renewal_interval_fails(clean_db: str) -> None:
    with app_on(clean_db, IDEMPOTENCY_LEASE=30) as app:
        assert check(app, "lease").status == OK
        add_route(app, "/quick", lease=5)
        found = check(app, "lease")
    assert found.status == FAIL, found
    assert found.detail.startswith("POST /quick: idempotency route lease (5 s) must be longer")


def test_a_renewal_that_can_outlast_the_lease_warns(clean_db: str) -> None:
    with app_on(
        clean_db, IDEMPOTENCY_LEASE=10, IDEMPOTENCY_DATABASE_OPTIONS={"statement_timeout": 8}
    ) as app:
        found = check(app, "lease")
    assert found.status == WARN, found
    assert "the app: lease 10 s but a renewal may start" in found.detail


def test_without_renewal_the_lease_must_outlast_the_processor_timeout(clean_db: str) -> None:
    with app_on(clean_db, IDEMPOTENCY_LEASE=30, IDEMPOTENCY_LEASE_RENEW_INTERVAL=0) as app:
        code, output = doctor(app, "--processor-timeout", "45")
        assert code == 1
        assert "FAIL  lease" in output and "is not renewed and a view may wait 45 s" in output
        found = check(app, "lease", processor_timeout=20)
    assert found.status == OK and "never renewed" in found.detail, found


def test_a_route_ttl_within_the_processor_timeout_fails(clean_db: str) -> None:
    with app_on(clean_db) as app:
        add_route(app, "/short", ttl=60, lease=30)
        found = check(app, "lease", processor_timeout=90)
        assert found.status == FAIL, found
        assert "POST /short: TTL 60 s is not longer than the processor timeout 90 s" in found.detail
        found = check(app, "lease", processor_timeout=10)
    assert found.status == OK and "lease 30 s (renewed every 10 s)" in found.detail


# -- scopes --------------------------------------------------------------------------------


def test_the_default_scope_refuses_requests_without_credentials(clean_db: str) -> None:
    with app_on(clean_db, IDEMPOTENCY_SCOPE_FUNC=default_scope) as app:
        add_route(app, "/pay")
        found = check(app, "scope")
    assert found.status == OK and "refused (400 missing_scope) on 1 route(s)" in found.detail


def test_global_scope_chosen_explicitly_warns(clean_db: str) -> None:
    with app_on(clean_db, IDEMPOTENCY_SCOPE_FUNC=default_scope) as app:
        add_route(app, "/pay")
        add_route(app, "/internal", scope_func=global_scope)
        found = check(app, "scope")
    assert found.status == WARN and found.detail.startswith("global_scope on POST /internal")


def test_a_scope_function_that_pools_anonymous_requests_fails(clean_db: str) -> None:
    def by_tenant_header(request: Request) -> str:
        return "tenant:" + str(request.headers.get("X-Tenant", "default"))

    with app_on(clean_db, IDEMPOTENCY_SCOPE_FUNC=by_tenant_header) as app:
        add_route(app, "/pay")
        code, output = doctor(app)
    assert code == 1
    assert "FAIL  scope" in output and "without credentials gets a scope on POST /pay" in output
    assert "-> make the scope function return None" in output


def test_a_scope_function_needing_a_real_request_is_not_judged(clean_db: str) -> None:
    scope = user_scope(lambda: g.user.id)  # AttributeError without the app's auth
    with app_on(clean_db, IDEMPOTENCY_SCOPE_FUNC=scope) as app:
        add_route(app, "/pay")
        found = check(app, "scope")
    assert found.status == OK and "1 scope function(s) need more than headers" in found.detail


# -- Prometheus under gunicorn ----------------------------------------------------------


@pytest.fixture
def exported(clean_db: str) -> Iterator[Flask]:
    from prometheus_client import CollectorRegistry

    from flask_idempotency.observability.prometheus import PrometheusMetrics

    with app_on(clean_db) as app:
        PrometheusMetrics(app, registry=CollectorRegistry())
        yield app


def test_several_workers_without_a_multiprocess_directory_fail(
    exported: Flask, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = conf(tmp_path, "workers = 4\n")
    found = check(exported, "prometheus", gunicorn_config=path)
    assert found.status == FAIL and "4 workers and no PROMETHEUS_MULTIPROC_DIR" in found.detail

    conf(tmp_path, "workers = 1\n")
    assert check(exported, "prometheus", gunicorn_config=path).status == OK


def test_a_multiprocess_directory_set_by_the_config_with_child_exit_passes(
    exported: Flask, tmp_path: Path
) -> None:
    metrics = tmp_path / "metrics"
    path = conf(
        tmp_path,
        "import os\nworkers = 3\n"
        f"os.environ['PROMETHEUS_MULTIPROC_DIR'] = {str(metrics)!r}\n"
        "def child_exit(server, worker):\n    pass\n",
    )
    found = check(exported, "prometheus", gunicorn_config=path)
    assert (
        found.status == OK and f"3 workers share PROMETHEUS_MULTIPROC_DIR={metrics}" in found.detail
    )


def test_an_unwritable_or_unhooked_directory_is_named(
    exported: Flask, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = conf(tmp_path, "workers = 2\ndef child_exit(server, worker):\n    pass\n")
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(a_file / "metrics"))
    found = check(exported, "prometheus", gunicorn_config=path)
    assert found.status == FAIL and "does not exist and cannot be created" in found.detail
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(a_file))
    found = check(exported, "prometheus", gunicorn_config=path)
    assert found.status == FAIL and "is not a directory" in found.detail

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    conf(tmp_path, "workers = 2\n")
    found = check(exported, "prometheus", gunicorn_config=path)
    assert found.status == WARN and "no child_exit hook" in found.detail


def test_hooks_that_may_set_the_directory_warn_and_the_librarys_pass(
    exported: Flask, tmp_path: Path
) -> None:
    path = conf(tmp_path, "workers = 2\ndef on_starting(server):\n    pass\n")
    found = check(exported, "prometheus", gunicorn_config=path)
    assert found.status == WARN and "on_starting may set it" in found.detail

    conf(tmp_path, "workers = 2\nfrom flask_idempotency.gunicorn import post_worker_init\n")
    found = check(exported, "prometheus", gunicorn_config=path)
    assert found.status == OK and "flask_idempotency.gunicorn's hooks" in found.detail
