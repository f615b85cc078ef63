# ddptrain: `make train` trains the default model, `make test` runs the whole suite.
# Both create the virtual environment on first use. TORCH pins the torch install: on a CPU
# machine torch==2.13.0 is the CPU build; on a GPU machine the same pin from PyPI is the CUDA
# build. Override it (make TORCH='torch==2.5.1') to match your CUDA driver.

PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.ddptrain-installed

.PHONY: venv train test test-unit test-dist test-cluster bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: a bare `torch` requirement would pull a multi-GB CUDA build here.
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

train: venv
	$(VENV)/bin/ddptrain train $(ARGS)

test: venv
	$(PY) -m pytest -q tests

test-unit: venv
	$(PY) -m pytest -q tests/unit

test-dist: venv
	$(PY) -m pytest -q tests/dist

test-cluster: venv
	$(PY) -m pytest -q tests/cluster

# Benchmarks (docs/benchmarks.md): installs the peers (Lightning, Accelerate) and runs every figure,
# writing bench/results/<date>.json and .md. OMP_NUM_THREADS=1: the driver and its children pin threads.
bench: venv
	$(PY) -m pip install -q -e '.[bench]'
	OMP_NUM_THREADS=1 $(PY) -m bench all $(ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache
