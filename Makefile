# `make test` and `make bench` set themselves up: a .venv with torch (the CPU wheel on machines without a GPU),
# triton, the dev/hf/bench extras and fusedmoe in editable mode, then run.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.fusedmoe-installed
PYTEST_ARGS ?=

.PHONY: setup test bench lint gpu-check clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile src/fusedmoe/__init__.py  # __init__ holds the version
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q setuptools wheel "triton==3.6.0" "numpy<2.3"
	$(PY) -m pip install -q --no-build-isolation -e ".[dev,hf,bench]"
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) -m fusedmoe bench

lint: $(STAMP)
	$(PY) -m ruff check src tests
	$(PY) -m ruff format --check src tests scripts

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
