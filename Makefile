# One entry for everything: `make demo`, `make test`, `make test-security`,
# `make test-browser`, `make bench`, `make soak`.
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

.PHONY: venv services test test-security test-browser test-long lint unit demo bench soak soak-short
.PHONY: test-cluster clean down

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[dev,services,console,otel,compression]'
	touch $@

$(VENV)/.soak-installed: $(VENV)/.installed
	$(VENV)/bin/pip install -q -e '.[dev,services,console,otel,compression,soak]'
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
# The console's browser test needs chromium: `make test-browser` (CI runs it too).
BROWSER_TEST := tests/acceptance/test_console_browser.py
test: venv lint
	$(SERVICES); $(PY) -m pytest -rfEs -p no:cacheprovider --ignore=tests/security \
	  --ignore=$(BROWSER_TEST) $(PYTEST_ARGS)

test-security: venv
	$(SECURE_SERVICES); $(PY) -m pytest -rfEs -p no:cacheprovider tests/security $(PYTEST_ARGS)

# The ops console in a real headless Chromium (Debian's package, installed by
# scripts/browser.sh; Playwright drives it) on the real services; screenshots in
# .artifacts/console/ (docs/console.md). 8-40 s once chromium is installed.
test-browser: venv
	LEDGERBOX_CHROMIUM="$$(bash scripts/browser.sh)"; export LEDGERBOX_CHROMIUM; \
	  $(SERVICES); $(PY) -m pytest -rfEs -p no:cacheprovider $(BROWSER_TEST) $(PYTEST_ARGS)

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

# The 3-broker cluster (scripts/services.sh with OUTBOX_KAFKA_NODES=3: 3 brokers + 3 KRaft
# controllers, RF 3, min.insync.replicas=2). `make test` stays on the single broker.
CLUSTER := unset KAFKA_BOOTSTRAP_SERVERS KAFKA_PROXIED_BOOTSTRAP_SERVERS OUTBOX_KAFKA_PROXY_LINKS; \
	export OUTBOX_KAFKA_NODES=3; eval "$$(bash scripts/services.sh up)"
SOAK_S ?= 1800
SOAK_SEED ?=
SOAK_ARGS ?=

test-cluster: venv
	$(CLUSTER); $(PY) -m pytest tests/cluster -q -p no:cacheprovider $(PYTEST_ARGS)

# Chaos soak: SOAK_S seconds (default 1800) of steady load with overlapping faults of every
# kind; SOAK_SEED replays a run (the seed is printed). Results in soak-results/.
soak: $(VENV)/.soak-installed
	$(CLUSTER); $(PY) -m pytest tests/cluster -q -p no:cacheprovider; \
	SOAK_S=$(SOAK_S) SOAK_SEED=$(SOAK_SEED) $(PY) -m example_services.soak $(SOAK_ARGS)

# The CI soak: 3 minutes, every fault kind at least once.
soak-short:
	$(MAKE) soak SOAK_S=180

down:
	bash scripts/services.sh down

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
