# Everyday commands.  Everything runs from the project's own .venv, so a
# fresh machine with only python3 gets the same tools as CI.
#
# `make test` needs no running servers: without DATABASE_URL / REDIS_URL the
# suite starts throwaway PostgreSQL and Redis itself (tests/support).  With
# them set, it uses those servers and fails (never skips) if they are down.

PYTHON3 ?= python3
VENV    := .venv
PY      := $(VENV)/bin/python
# pip runs again only when the dependencies may have changed.
STAMP   := $(VENV)/.installed
# `make run` needs the example's dependencies only (the `example` extra), not the
# development toolchain; `make venv` (`dev`) includes them.
EXAMPLE_STAMP := $(VENV)/.installed-example
# Extra pytest arguments, e.g. `make test PYTEST_ARGS="-x -k proxy"`.
PYTEST_ARGS ?=
# `make test` runs on pytest-xdist workers: most tests wait on gunicorn, PostgreSQL
# or sleeps, not on the CPU, so 4 workers beat 2 cores (the main pass: 10 min
# serially, 6 with -n 4). Each worker has a
# database and a Redis db of its own (tests/support/xdist_worker.py); the reliability
# tests share one worker (--dist loadgroup, tests/conftest.py). PYTEST_WORKERS=0 runs serially.
PYTEST_WORKERS ?= 4
XDIST := -n $(PYTEST_WORKERS) --dist loadgroup

.PHONY: venv test test-transaction-mode test-minimal test-fast test-reliability test-topologies lint run bench docs reference clean distclean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON3) -m venv $(VENV)
	$(PY) -m pip install -e '.[dev]'
	touch $@

# The whole suite, including the slower `reliability` tests (storms, crashes,
# outages through gunicorn); the deployment topologies are `make test-topologies`.
test: venv
	$(PY) -m pytest -m "not topology" $(XDIST) $(PYTEST_ARGS)
	$(MAKE) test-transaction-mode

# The guarantees again with IDEMPOTENCY_CLAIM_MODE=transaction: the reliability
# suite (the example app reads the variable) and the core app's semantics and
# concurrency tests (CORE_APP_* reaches its config), and tests/sqlalchemy (SA_APP_*).
TRANSACTION_MODE_TESTS := tests/reliability tests/core/test_semantics.py tests/core/test_concurrency.py \
	tests/core/test_field_safety.py tests/core/test_claim_modes.py tests/sqlalchemy
test-transaction-mode: venv
	IDEMPOTENCY_CLAIM_MODE=transaction CORE_APP_IDEMPOTENCY_CLAIM_MODE=transaction \
		SA_APP_IDEMPOTENCY_CLAIM_MODE=transaction \
		$(PY) -m pytest $(TRANSACTION_MODE_TESTS) $(XDIST) $(PYTEST_ARGS)

# The minimal environment (Pallets projects keep one): the suite on the lowest
# version that pyproject.toml allows of each direct dependency, resolved afresh by
# uv (`--resolution lowest-direct`; what those pull in comes at its newest, as for
# an application that pins nothing). A lower bound that is not true fails here.
# Rebuilt on every run (seconds, from uv's cache), since step 2 downgrades it; made
# by `venv`, not `uv venv`, so it has the pip that tests/tooling/test_install.py runs.
#
# Step 1: `.[dev]` at its floors, on a subset that keeps the pass to ~5 minutes in
# CI. Left out: tests/reliability (storms, crashes and outages through gunicorn:
# the code and dependencies of tests/example, tests/core/test_lease_capacity.py and
# tests/sqlalchemy/test_sa_gunicorn.py, which stay), tests/bench and tests/structure
# (timings, and the source's own shape: no dependency's version changes them), the
# `transaction` claim mode (a setting, not a dependency), and the install tests that
# fill a fresh virtualenv from PyPI (they get the newest releases, nothing minimal).
# Store, cache, SQLAlchemy, Alembic, CLI, events, Celery, observability, the example
# app, the pytest plugin and the docs' snippets all run.
#
# Step 2: where `dev` or `example` ask for more than the library's own extras
# (redis-py, pytest-postgresql, the OpenTelemetry API; requests and httpx, which the
# docs' toolchain lifts above the `client` extra's floors), those extras at their own
# floors, with the tests of what they serve; the one test that reads a redis-py 6
# attribute (dev's reason for redis>=6) is left out there.
VENV_MINIMAL := .venv-minimal
MINIMAL_PY   := $(VENV_MINIMAL)/bin/python
UV           := $(VENV)/bin/uv
MINIMAL_TESTS := tests -m "not topology" --ignore=tests/reliability --ignore=tests/bench \
	--ignore=tests/structure \
	--deselect tests/tooling/test_install.py::test_wheel_without_extras_serves_an_app \
	--deselect tests/tooling/test_install.py::test_wheel_with_redis_extra_caches_answers \
	--deselect tests/tooling/test_install.py::test_example_app_runs_from_the_checkout_with_example_extra \
	--deselect tests/tooling/test_install.py::test_wheel_with_sqlalchemy_extra_keeps_one_row_per_key_under_gunicorn_kills
LIBRARY_FLOOR_EXTRAS := --extra redis --extra pytest --extra opentelemetry --extra client
LIBRARY_FLOOR_TESTS := tests/cache tests/observability/test_observability.py \
	tests/tooling/test_pytest_plugin.py tests/client/test_adapters.py tests/client/test_policy.py \
	--deselect tests/cache/test_redis_cache.py::test_url_client_has_short_timeouts_no_retries_and_connects_lazily
test-minimal: venv
	rm -rf $(VENV_MINIMAL)
	$(PYTHON3) -m venv $(VENV_MINIMAL)
	$(UV) pip install --python $(MINIMAL_PY) --resolution lowest-direct -e '.[dev]'
	$(MINIMAL_PY) -m pytest $(MINIMAL_TESTS) $(XDIST) $(PYTEST_ARGS)
	$(UV) pip compile --quiet --no-header --no-annotate --no-deps --resolution lowest-direct \
		--python $(MINIMAL_PY) $(LIBRARY_FLOOR_EXTRAS) -o $(VENV_MINIMAL)/library-floors.txt pyproject.toml
	$(UV) pip install --python $(MINIMAL_PY) --resolution lowest-direct \
		-r $(VENV_MINIMAL)/library-floors.txt opentelemetry-sdk
	$(MINIMAL_PY) -m pytest $(LIBRARY_FLOOR_TESTS) $(XDIST) $(PYTEST_ARGS)

# Quick feedback while editing: everything but the reliability tests.
test-fast: venv
	$(PY) -m pytest -m "not reliability and not topology" $(PYTEST_ARGS)

# Only the reliability tests (named by the marker's description in pyproject.toml).
test-reliability: venv
	$(PY) -m pytest -m reliability $(PYTEST_ARGS)

# Deployment topologies (tests/topologies), on servers the tests start: a
# read-only server and a multi-host DSN, failover to a streaming standby under
# load, a lost synchronous standby, PgBouncer in transaction mode (storm and
# crash through it, both claim modes), TLS to PostgreSQL and Redis, Redis
# Cluster and Sentinel with failovers. Without a pgbouncer binary, an
# OpenSSL-built PostgreSQL or a TLS-capable redis-server those tests skip and
# say why (.ci/run installs Debian's pgbouncer when it can). tests/sqlalchemy adds
# the Flask-SQLAlchemy app (db=db, both dialects) behind PgBouncer.
test-topologies: venv
	$(PY) -m pytest -m topology tests/topologies tests/sqlalchemy $(PYTEST_ARGS)

# mypy reads its file list and strictness from setup.cfg.
lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

# The example app on a fresh machine: without DATABASE_URL gunicorn's master starts
# an embedded PostgreSQL (pgserver); without REDIS_URL it runs with no cache.
run: $(EXAMPLE_STAMP)
	$(VENV)/bin/gunicorn -c gunicorn.conf.py wsgi:app

$(EXAMPLE_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON3) -m venv $(VENV)
	$(PY) -m pip install -e '.[example]'
	touch $@

# The peers it measures next to the extension are benchmark-only dependencies,
# installed here (not by `make venv`); see benchmarks/README.md.
bench: venv $(VENV)/.bench-peers
	$(PY) -m benchmarks

$(VENV)/.bench-peers: benchmarks/requirements-peers.txt
	$(PY) -m pip install -r benchmarks/requirements-peers.txt
	touch $@

# The documentation site in docs/_build/html: warnings are errors (-W) and every
# cross-reference must resolve (-n, nitpicky); then the link check, on internal
# links only (conf.py ignores http(s) URLs: CI has no business failing on a
# third party's site; links into this repository are checked by docs/_ext).
# It installs the `docs` extra only (Sphinx, the theme, what autodoc imports), not
# the development toolchain. docs/_ext also fails the build when the committed CLI
# or configuration reference is stale (`make reference` rewrites them from the
# code), and when a built page shows a raw directive, a dash for `--` or a
# swallowed `<TAG>`. The snippets on these pages are run by tests/docs.
DOCS_STAMP  := $(VENV)/.installed-docs
SPHINXBUILD := $(VENV)/bin/sphinx-build -W --keep-going -n -q
docs: $(DOCS_STAMP)
	$(SPHINXBUILD) -b html docs docs/_build/html
	$(SPHINXBUILD) -b linkcheck docs docs/_build/linkcheck

# docs/cli.md and docs/configuration.md's settings, written from the click commands
# and settings.py's comments (committed: they read the same on GitHub).
reference: $(DOCS_STAMP)
	$(PY) docs/_ext/reference.py

$(DOCS_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON3) -m venv $(VENV)
	$(PY) -m pip install -e '.[docs]'
	touch $@

# Build and tool leftovers; keeps .venv and instance/ (the example app's
# embedded database lives there).
clean:
	rm -rf build dist *.egg-info .mypy_cache .ruff_cache .pytest_cache .hypothesis docs/_build
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV) $(VENV_MINIMAL)
