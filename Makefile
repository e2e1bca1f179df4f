# osd: the two commands are `make demo` and `make test`. Each sets itself up on a fresh
# machine: a virtualenv, torch (the local CPU build here, pip's wheel elsewhere), the
# package in editable mode with its dev extra, and the native extension.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.osd-installed
NVCC ?= $(shell command -v nvcc 2>/dev/null)
CU_SOURCES := $(wildcard csrc/kernels/*.cu)
export PYTHONUNBUFFERED := 1

.PHONY: all venv install build lint test test-fast cuda-check bench demo gpu-check clean

all: test

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# torch first (unless one is present), then our package without build isolation so the
# extension builds against that torch.
$(STAMP): $(PY) pyproject.toml setup.py
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q --no-build-isolation -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

# (Re)build the native extension in place; ninja only recompiles what changed.
build: $(STAMP)
	flock /tmp/osd-build.lock $(PY) setup.py -q build_ext --inplace

# Compile every torch-free CUDA source for sm_90a (compile-only when no GPU is present).
cuda-check:
ifneq ($(strip $(NVCC)),)
	@$(PY) scripts/cuda_check.py --nvcc "$(NVCC)" $(CU_SOURCES)
else
	@echo "cuda-check: nvcc not found, skipped"
endif

# Compile every Triton kernel for sm_90 (no GPU needed) with the Triton in $(VENV) and with
# Triton 3.6.0, the one torch 2.11 ships. $(TRITON36_VENV) holds only that Triton; a .pth
# file puts $(VENV)'s site-packages (torch) behind it on the path.
TRITON36_VENV ?= .venv-triton36
TRITON36_PY := $(TRITON36_VENV)/bin/python
TRITON36_STAMP := $(TRITON36_VENV)/.osd-installed

$(TRITON36_STAMP): $(STAMP)
	$(PYTHON) -m venv $(TRITON36_VENV)
	$(TRITON36_PY) -m pip install -q triton==3.6.0
	$(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" > \
		"$$($(TRITON36_PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/osd-venv.pth"
	touch $@

.PHONY: triton-check
triton-check: $(STAMP) $(TRITON36_STAMP)
	$(PY) scripts/triton_check.py
	$(TRITON36_PY) scripts/triton_check.py --triton-version 3.6.0

# ruff (the dev extra; settings in pyproject.toml): lint and the format check over the whole tree;
# scripts/check_house.py: no source file over 600 lines, no import cycle, and every import
# inside a function says why.
RUFF := $(VENV)/bin/ruff

lint: $(STAMP)
	$(RUFF) check .
	$(RUFF) format --check .
	$(PY) scripts/check_house.py

PYTEST := TRITON_INTERPRET=1 $(PY) -m pytest -q -p no:cacheprovider --benchmark-disable

test: build cuda-check triton-check
	$(PYTEST) tests

# The tests without the slow and gpu markers (a few minutes on 2 CPU cores).
test-fast: build
	$(PYTEST) -m "not slow and not gpu" tests

# llama.cpp's llama-server, llama-bench and llama-quantize, built once from the sources in
# the llama-cpp-python sdist and cached (scripts/build_llamacpp.sh; bench/bench_llamacpp.py).
.PHONY: llamacpp
llamacpp:
	bash scripts/build_llamacpp.sh

# Results (JSON, plots) go to results/, which git ignores.
bench: build llamacpp
	mkdir -p results
	$(PY) -m pytest -q -p no:cacheprovider bench --benchmark-json=results/bench_results.json

gpu-check:
	bash scripts/gpu_check.sh

demo: build
	$(PY) -m osd.cli demo

clean:
	rm -rf build osd_kernels/*.so *.egg-info
