# The README's commands. Each target creates (or reuses) .venv in the checkout
# and installs what it needs; torch is installed first, pinned, so that the
# project's own range never pulls a multi-GB CUDA build. Override with
# `make test TORCH=torch==2.5.1`, or `TORCH=` to keep whatever is installed.

PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet --disable-pip-version-check

.PHONY: setup test-tools demo test test-unit test-vllm test-sglang test-gpu bench bench-vllm \
	bench-sglang-file bench-fleetsim proto docs lint format clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml requirements-nixl.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || { test -z "$(TORCH)" || $(PIP) "$(TORCH)"; }
	rm -rf engramd.egg-info
	$(PIP) -e ".[dev]"
	$(PIP) --no-deps -r requirements-nixl.txt
	touch $@

# The deployment tests verify the systemd units with systemd-analyze, the alert rules
# with promtool (Debian's prometheus), and build and run the image with podman (a base
# from debootstrap; runc), and the
# fleet tests make network namespaces with ip (iproute2) and start s3rver (npm):
# as root on a Debian-like machine, install what is missing (elsewhere those
# tests say why they skip). s3rver goes to .tools/, beside the checkout.
S3RVER_VERSION ?= 3.7.1
S3RVER := .tools/s3rver/node_modules/.bin/s3rver
APT_GET := apt-get install -y -qq --no-install-recommends
test-tools: $(S3RVER)
	@command -v systemd-analyze >/dev/null || [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null \
	  || { apt-get update -qq && apt-get install -y -qq systemd >/dev/null; }
	@command -v ip >/dev/null || [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null \
	  || { apt-get update -qq && $(APT_GET) iproute2 >/dev/null; }
	@command -v podman >/dev/null && command -v debootstrap >/dev/null && command -v runc >/dev/null \
	  || [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null \
	  || { apt-get update -qq && $(APT_GET) podman buildah debootstrap runc >/dev/null; }
	@command -v promtool >/dev/null || [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null \
	  || { apt-get update -qq && $(APT_GET) prometheus >/dev/null; }

$(S3RVER):
	@command -v npm >/dev/null || [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null \
	  || { apt-get update -qq && $(APT_GET) nodejs npm >/dev/null; }
	command -v npm >/dev/null && npm install --silent --no-audit --no-fund --prefix .tools/s3rver \
	  s3rver@$(S3RVER_VERSION) || echo "npm is missing: the object-store tests will skip"

demo: setup
	$(VENV)/bin/engramd demo $(ARGS)

test: setup test-tools
	$(PY) -m pytest $(ARGS)

# The in-process tests alone (tests/unit: no daemon process, no root needed), in seconds.
# tests/daemon holds the scenarios with real daemons and workers; tests/support their helpers.
test-unit: setup
	$(PY) -m pytest tests/unit $(ARGS)

# The vLLM plugin's tests against the real vLLM 0.33.0 (tests/vllm_plugin), in a venv of
# their own: vLLM and its import chain without its CUDA dependencies, beside CPU
# torch. The venv is made again only when its requirements (or pyproject's entry
# points) change. VLLM_FIND_LINKS: a folder holding the vllm wheel, to skip the
# 336 MB download.
VLLM_VENV ?= .venv-vllm
VLLM_FIND_LINKS ?=
VLLM_REQS := tests/vllm_plugin/requirements.txt tests/vllm_plugin/requirements-nodeps.txt pyproject.toml
VLLM_STAMP = $(VLLM_VENV)/.installed-$(shell cat $(VLLM_REQS) | sha256sum | cut -c1-16)
VLLM_PIP = $(VLLM_VENV)/bin/python -m pip install --quiet --disable-pip-version-check \
	$(if $(VLLM_FIND_LINKS),--find-links $(VLLM_FIND_LINKS))

# The daemon of the object-store test runs from the project's venv (NIXL): setup.
test-vllm: $(VLLM_STAMP) test-tools setup
	$(VLLM_VENV)/bin/python -m pytest tests/vllm_plugin $(ARGS)

# Replicas starting with the plugin against vLLM's own tables (bench/vllm_plugin.py).
bench-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m bench.vllm_plugin $(ARGS)

$(VLLM_VENV)/.installed-%:
	rm -rf $(VLLM_VENV)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PIP) -r tests/vllm_plugin/requirements.txt
	$(VLLM_PIP) --no-deps -r tests/vllm_plugin/requirements-nodeps.txt
	$(VLLM_PIP) -e .
	touch $@

# The SGLang plugin's tests against the real SGLang 0.5.23 (tests/sglang_plugin), in a
# venv of their own made the same way: sglang --no-deps (its pins are CUDA builds),
# its Engram import chain, CPU torch held by constraints.txt. SGLANG_FIND_LINKS: a
# folder holding the sglang wheel, to skip the download.
SGLANG_VENV ?= .venv-sglang
SGLANG_FIND_LINKS ?=
SGLANG_DIR := tests/sglang_plugin
SGLANG_REQS := $(SGLANG_DIR)/requirements.txt $(SGLANG_DIR)/requirements-nodeps.txt \
	$(SGLANG_DIR)/constraints.txt pyproject.toml
SGLANG_STAMP = $(SGLANG_VENV)/.installed-$(shell cat $(SGLANG_REQS) | sha256sum | cut -c1-16)
SGLANG_PIP = $(SGLANG_VENV)/bin/python -m pip install --quiet --disable-pip-version-check \
	-c $(SGLANG_DIR)/constraints.txt $(if $(SGLANG_FIND_LINKS),--find-links $(SGLANG_FIND_LINKS))

# The daemon of the object-store test runs from the project's venv (NIXL): setup.
test-sglang: $(SGLANG_STAMP) test-tools setup
	$(SGLANG_VENV)/bin/python -m pytest $(SGLANG_DIR) $(ARGS)

# SGLang's own file PLE backend against engramd's disk-backed copy (bench/sglang_ple_file.py).
bench-sglang-file: $(SGLANG_STAMP)
	$(SGLANG_VENV)/bin/python -m bench.sglang_ple_file $(ARGS)

$(SGLANG_VENV)/.installed-%:
	rm -rf $(SGLANG_VENV)
	$(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_PIP) torch
	$(SGLANG_PIP) --no-deps --no-compile -r $(SGLANG_DIR)/requirements-nodeps.txt
	$(SGLANG_PIP) -r $(SGLANG_DIR)/requirements.txt
	$(SGLANG_PIP) -e .
	touch $@

# The GPU tests (tests/gpu, skipped where no CUDA device is seen) with the
# venv, or on a GPU machine whose interpreter already has CUDA torch with
# `make test-gpu PY=python3`: the project then comes from this checkout
# (PYTHONPATH), and pytest, safetensors, rich, prometheus-client and
# grpcio-health-checking must be importable there.
test-gpu: $(if $(filter $(VENV)/bin/python,$(PY)),setup)
	PYTHONPATH=$(CURDIR)/client:$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(PY) -m pytest -m gpu tests/gpu $(ARGS)

# The loaders the load section measures engramd against, into .venv for the bench only.
bench: setup test-tools
	@# The cold section reads the files with fio as the device's ceiling (its own reader without).
	@command -v fio >/dev/null || [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null \
	  || { apt-get update -qq && $(APT_GET) fio >/dev/null; }
	$(PY) -c "import matplotlib" 2>/dev/null || $(PIP) -e ".[dev,bench]"
	$(PY) -c "import runai_model_streamer, fastsafetensors" 2>/dev/null || $(PIP) -r bench/requirements-anchors.txt
	$(PY) -c "import boto3" 2>/dev/null || $(PIP) -r bench/requirements-fleet.txt
	$(PY) -m bench $(ARGS)

# A fleet's fill time against its size, simulated with the daemon's schedule (bench/fleetsim.py).
bench-fleetsim: setup
	$(PY) -c "import matplotlib" 2>/dev/null || $(PIP) -e ".[dev,bench]"
	$(PY) -m bench.fleetsim $(ARGS)

proto: setup
	$(PY) tools/gen_proto.py

# docs/flags.md from the flags' one declaration (engramd/config.py); a test fails while it is stale.
docs: setup
	$(PY) -m engramd.cli.flagref > docs/flags.md

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy engramd engramd_shared client/engramd_client tests tools bench examples

format: setup
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(SGLANG_VENV) .tools .pytest_cache .mypy_cache .ruff_cache
