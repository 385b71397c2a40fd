# pgfence — the two commands a new user needs:
#   make demo   the outbox (and every module) on a throwaway embedded PostgreSQL
#   make test   pgTAP suites (pg_prove), isolation specs (pg_isolation_regress) + pytest, against a
#               throwaway cluster or $DATABASE_URL
# Everything is installed on first use: system packages via tools/ensure-system-deps.sh (apt, as
# root), Python packages into .venv.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PGFENCE := $(VENV)/bin/pgfence
PYTEST_ARGS ?=
FUZZ_SECONDS ?= 900

.PHONY: help venv deps test-deps demo test test-here pgtap isolation pytest fuzz bench lint schema clean

help:
	@echo "make demo    run the demo on a throwaway PostgreSQL"
	@echo "make test    pgTAP + isolation specs + pytest (installs what it needs)"
	@echo "make fuzz    the fuzzer of every public function, longer (FUZZ_SECONDS=$(FUZZ_SECONDS)), random seeds"
	@echo "make bench   benchmarks (prints numbers and ratios, writes bench/results/)"
	@echo "make lint    ruff + mypy"
	@echo "make schema  regenerate schema/pgfence.sql (the one-file install) from migrations/ + functions/"

$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV) || { \
	  echo "python3 -m venv failed: install python3-venv (apt-get install python3-venv)"; exit 1; }
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,web,otel]'
	@touch $@

venv: $(VENV)/.installed

deps:
	@tools/ensure-system-deps.sh

test-deps:
	@tools/ensure-system-deps.sh --pgtap

demo: venv deps
	$(PGFENCE) demo

# One throwaway cluster for the whole run (or $$DATABASE_URL); stopped afterwards.
test: venv test-deps
	@$(PGFENCE) db run -- $(MAKE) --no-print-directory test-here

test-here: pgtap isolation pytest

pgtap:
	$(PY) tests/run_pgtap.py

# The races between sessions, run by PostgreSQL's isolation tester (tests/isolation/specs).
isolation:
	$(PY) tests/run_isolation.py

pytest:
	$(PY) -m pytest $(PYTEST_ARGS)

# The fuzzer of tests/test_fuzz.py (a minute of it runs in `make test`): random Hypothesis
# seeds, a finding shrunk to a short sequence; the call counts are printed.
fuzz: venv test-deps
	@$(PGFENCE) db run -- env PGFENCE_FUZZ_LONG=1 PGFENCE_FUZZ_SECONDS=$(FUZZ_SECONDS) \
	  $(PY) -m pytest tests/test_fuzz.py -q $(PYTEST_ARGS)

bench: venv deps
	$(PGFENCE) db run --durable -- $(PY) bench/run.py

# schema/pgfence.sql: generated from migrations/ and functions/ on a throwaway cluster (or
# $$DATABASE_URL); deterministic, so the lead re-runs it after merging SQL changes.
schema: venv deps
	@$(PGFENCE) db run -- $(PY) tools/make_schema.py

lint: venv
	$(VENV)/bin/ruff check glue tests bench tools hatch_build.py
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache bench/results
