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

.PHONY: venv test test-transaction-mode test-fast test-reliability test-topologies lint run bench docs clean distclean

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
# Sphinx and the theme are the `docs` extra, installed here, not by `make venv`.
# The snippets on these pages are run by the tests (tests/docs), not by this target.
SPHINXBUILD := $(VENV)/bin/sphinx-build -W --keep-going -n -q
docs: venv $(VENV)/.docs-deps
	$(SPHINXBUILD) -b html docs docs/_build/html
	$(SPHINXBUILD) -b linkcheck docs docs/_build/linkcheck

$(VENV)/.docs-deps: pyproject.toml
	$(PY) -m pip install -e '.[docs]'
	touch $@

# Build and tool leftovers; keeps .venv and instance/ (the example app's
# embedded database lives there).
clean:
	rm -rf build dist *.egg-info .mypy_cache .ruff_cache .pytest_cache .hypothesis docs/_build
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
