# One entry for everything: `make demo`, `make test`, `make bench`.
# Each target creates the virtual environment, installs the project, brings the services up
# (scripts/services.sh: PostgreSQL, Redis, Apache Kafka; nothing is started when
# DATABASE_URL, KAFKA_BOOTSTRAP_SERVERS and REDIS_URL are already set) and runs.
SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
SERVICES := eval "$$(bash scripts/services.sh up)"
PYTEST_ARGS ?=
PY_DIRS := ledgerbox outbox relay inbox migrations example_services tests bench

.PHONY: venv services test test-long lint unit demo bench soak clean down

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

test: venv lint
	$(SERVICES); $(PY) -m pytest -rfEs -p no:cacheprovider $(PYTEST_ARGS)

# Longer runs of what `make test` runs short (~2 min): transactions held open 30 s (idle in
# transaction, PREPARED) while other keys flow, and 200 examples of the relay's interleaving
# property (make test: 6 s and 25 examples).
test-long: venv
	$(SERVICES); LEDGERBOX_TEST_LONG_TX_S=30 LEDGERBOX_TEST_PROPERTY_EXAMPLES=200 \
	  $(PY) -m pytest -rfEs -p no:cacheprovider -s $(PYTEST_ARGS) \
	  "tests/faults/test_relay_cursor.py::test_c01_long_open_transaction_does_not_stall_other_keys" \
	  tests/integration/test_relay_property.py

demo: venv
	$(SERVICES); $(PY) -m example_services.demo $(DEMO_ARGS)

bench: venv
	$(SERVICES); $(PY) -m bench $(BENCH_ARGS)

down:
	bash scripts/services.sh down

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
