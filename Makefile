# ddptrain: `make train` trains the default model, `make test` runs the whole suite.
# Both create the virtual environment on first use. TORCH pins the torch install (the tested range
# is in pyproject.toml); it comes from pip's configured index (PyPI: the CUDA build on Linux).
# TORCH_INDEX=URL adds a wheel index for it, e.g. PyTorch's CPU or CUDA-version index (the URL
# that pytorch.org's install page gives): make TORCH_INDEX=URL test.

PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
PY := $(VENV)/bin/python
STAMP := $(VENV)/.ddptrain-installed

.PHONY: venv train test test-measure test-explore test-unit test-dist test-cluster lint format bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: a bare `torch` requirement would pull PyPI's multi-GB CUDA build.
	$(PY) -m pip install -q "$(TORCH)" $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

train: venv
	$(VENV)/bin/ddptrain train $(ARGS)

# Three pytest workers on the 2-core CI machines: the multi-host and fault tests spend much of their time
# waiting (timeouts, outages, sleeping steps), and a third worker fills those waits (measured in
# docs/testing.md). The SLURM test files stay on one worker, in order (tests/conftest.py).
TEST_WORKERS ?= 3

# The suite starts hundreds of interpreters and forks: with the bytecode cache (the ignored __pycache__
# folders) each compiles ddptrain and pytest rewrites each test module once, not in every process, even
# where the environment turns the cache off.
unexport PYTHONDONTWRITEBYTECODE

# `make test` asserts behaviour, never a timing: the measurements (marker `measure`: the straggler
# detection and false-alarm figures, the recovery time) would make a loaded machine fail the suite.
# They run in `make test-measure`, alone and one at a time, so that no other test competes for the
# cores while they time the ranks; their figures go to docs/observability.md and docs/benchmarks.md.
test: venv
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup -m "not measure" --durations=25 tests

test-measure: venv
	$(PY) -m pytest -q -m measure tests

# The property tests with fresh random examples (`make test` draws the same ones every run: tests/conftest.py).
test-explore: venv
	HYPOTHESIS_PROFILE=explore $(PY) -m pytest -q -n $(TEST_WORKERS) tests/unit

# Style, types and layers: ruff (lint + format check) on everything, mypy --strict on src/, and
# import-linter's contracts (the layers, no import circle; pyproject.toml). All pinned in the dev extra,
# so that each check means the same everywhere.
lint: venv
	$(VENV)/bin/ruff check src tests bench examples
	$(VENV)/bin/ruff format --check src tests bench examples
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports --no-cache

format: venv
	$(VENV)/bin/ruff check --fix src tests bench examples
	$(VENV)/bin/ruff format src tests bench examples

# The unit tests by file (loadfile): a file's tests share one worker's lazy imports (MLflow, matplotlib,
# transformers) instead of each worker importing them again (measured in docs/testing.md).
test-unit: venv
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not measure" tests/unit

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
