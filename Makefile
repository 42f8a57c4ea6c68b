# Two commands do all set-up on a fresh machine:
#   make demo   install (into .venv) and run the main job on the CPU reference engine
#   make test   install the test tools and run every check CI runs (lint, types, tests)
PYTHON ?= python3
VENV ?= .venv
PIP := $(VENV)/bin/pip
CONSTRAINTS := constraints/cpu.txt
PIP_FLAGS := --disable-pip-version-check -q -c $(CONSTRAINTS)

.PHONY: demo test lint typecheck pytest clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.stamp-demo: pyproject.toml $(CONSTRAINTS) | $(VENV)/bin/python
	$(PIP) install $(PIP_FLAGS) -e '.[reference]'
	touch $@

$(VENV)/.stamp-test: pyproject.toml $(CONSTRAINTS) tools/install-multinode-deps.sh | $(VENV)/bin/python
	$(PIP) install $(PIP_FLAGS) -e '.[reference,sglang,dynamo,ray,dev]'
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

test: lint typecheck pytest

clean:
	rm -rf $(VENV) .rb-cache build dist *.egg-info
