# One entry for everything: `make demo`, `make test`, `make test-security`, `make bench`.
# Each target creates the virtual environment, installs the project, brings the services up
# (scripts/services.sh: PostgreSQL, Redis, Apache Kafka; nothing is started when
# DATABASE_URL, KAFKA_BOOTSTRAP_SERVERS and REDIS_URL are already set) and runs.
SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
SERVICES := eval "$$(bash scripts/services.sh up)"
# The secured endpoints too (TLS/SASL Kafka listeners, Redis with AUTH and TLS, PostgreSQL
# ssl=on: docs/security.md); they print OUTBOX_SEC_* for tests/security.
SECURE_SERVICES := eval "$$(OUTBOX_SECURITY=1 bash scripts/services.sh up)"
PYTEST_ARGS ?=
PY_DIRS := ledgerbox outbox relay inbox migrations example_services tests bench

.PHONY: venv services test test-security lint unit demo bench soak clean down

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[dev,services,otel,compression]'
	touch $@

services:
	bash scripts/services.sh up >/dev/null

lint: venv
	$(VENV)/bin/ruff check $(PY_DIRS)
	$(VENV)/bin/ruff format --check $(PY_DIRS)
	$(VENV)/bin/mypy

unit: venv
	$(PY) -m pytest tests/unit -q $(PYTEST_ARGS)

# tests/security needs the secured endpoints: `make test-security` (CI runs both).
test: venv lint
	$(SERVICES); $(PY) -m pytest -rfEs -p no:cacheprovider --ignore=tests/security $(PYTEST_ARGS)

test-security: venv
	$(SECURE_SERVICES); $(PY) -m pytest -rfEs -p no:cacheprovider tests/security $(PYTEST_ARGS)

demo: venv
	$(SERVICES); $(PY) -m example_services.demo $(DEMO_ARGS)

bench: venv
	$(SERVICES); $(PY) -m bench $(BENCH_ARGS)

down:
	bash scripts/services.sh down

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
