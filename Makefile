# The README's commands. Each target creates (or reuses) .venv in the checkout
# and installs what it needs; torch is installed first, pinned, so that the
# project's own range never pulls a multi-GB CUDA build. Override with
# `make test TORCH=torch==2.5.1`, or `TORCH=` to keep whatever is installed.

PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet --disable-pip-version-check

.PHONY: setup test-tools demo test test-gpu bench proto lint format clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || { test -z "$(TORCH)" || $(PIP) "$(TORCH)"; }
	$(PIP) -e ".[dev]"
	touch $@

# The deployment tests verify the systemd units with systemd-analyze: as root
# on a Debian-like machine, install it where it is missing (elsewhere that one
# test says why it skips).
test-tools:
	@command -v systemd-analyze >/dev/null || [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null \
	  || { apt-get update -qq && apt-get install -y -qq systemd >/dev/null; }

demo: setup
	$(VENV)/bin/engramd demo $(ARGS)

test: setup test-tools
	$(PY) -m pytest $(ARGS)

# The GPU tests (tests/gpu, skipped where no CUDA device is seen) with the
# venv, or on a GPU machine whose interpreter already has CUDA torch with
# `make test-gpu PY=python3`: the project then comes from this checkout
# (PYTHONPATH), and pytest, safetensors, rich, prometheus-client and
# grpcio-health-checking must be importable there.
test-gpu: $(if $(filter $(VENV)/bin/python,$(PY)),setup)
	PYTHONPATH=$(CURDIR)/client:$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(PY) -m pytest -m gpu tests/gpu $(ARGS)

bench: setup
	$(PY) -c "import matplotlib" 2>/dev/null || $(PIP) -e ".[dev,bench]"
	$(PY) -m bench $(ARGS)

proto: setup
	$(PY) tools/gen_proto.py

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy engramd client/engramd_client tests tools bench examples

format: setup
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
