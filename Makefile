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
# Extra pytest arguments, e.g. `make test PYTEST_ARGS="-x -k proxy"`.
PYTEST_ARGS ?=

.PHONY: venv test test-fast test-reliability lint run bench clean distclean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON3) -m venv $(VENV)
	$(PY) -m pip install -e '.[dev]'
	touch $@

# The whole suite, including the slower `reliability` tests (storms, crashes,
# outages through gunicorn).
test: venv
	$(PY) -m pytest $(PYTEST_ARGS)

# Quick feedback while editing: everything but the reliability tests.
test-fast: venv
	$(PY) -m pytest -m "not reliability" $(PYTEST_ARGS)

# Only the reliability tests (named by the marker's description in pyproject.toml).
test-reliability: venv
	$(PY) -m pytest -m reliability $(PYTEST_ARGS)

# mypy reads its file list and strictness from setup.cfg.
lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

run: venv
	$(VENV)/bin/gunicorn -c gunicorn.conf.py wsgi:app

bench: venv
	$(PY) -m benchmarks

# Build and tool leftovers; keeps .venv and instance/ (the example app's
# embedded database lives there).
clean:
	rm -rf build dist *.egg-info .mypy_cache .ruff_cache .pytest_cache .hypothesis
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
