# Entry points for a fresh machine: `make run` and `make test`.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of this version is what the development and CI machines carry;
# installing it before the project keeps pip from pulling CUDA torch.
TORCH_VERSION := 2.13.0
NIXL_VERSION := 1.5.1
XGRAMMAR_VERSION := 0.2.8
# Triton: the GPU attention kernel's compiler; on CPU its interpreter runs that kernel's tests (tests/unit/
# test_triton_attention.py). About 290 MB, its own dependencies none that the CPU path needs.
TRITON_VERSION := 3.9.0
# Which dtype(s) of the embedded model `make prepare` (and so `make test`) makes: float32, bfloat16 or both.
DTYPE ?= float32
PYTEST_ARGS ?=
PORT ?= 8000
PIP := $(BIN)/python -m pip --quiet
# Reinstalls when the dependencies change; an existing venv without it is reused, not rebuilt.
SETUP_STAMP := $(VENV)/.tessera-setup
# Bytecode is written wherever make runs Python: make setup installs without compiling (below), and the tests
# start some 300 Python processes (cluster processes, ranks, commands). Where the environment sets
# PYTHONDONTWRITEBYTECODE (as the development machines do), each would compile what it imports again, and each
# lane would rewrite every test module's asserts again: with bytecode written (the checkout's __pycache__ is
# ignored by git) a worker starts on 0.2 CPU-s less and a lane collects on 6 instead of 12.
BYTECODE_ENV := env -u PYTHONDONTWRITEBYTECODE

.PHONY: setup prepare run test test-repeat install

setup: $(SETUP_STAMP)

$(SETUP_STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	# Every install --no-compile; the last line compiles what the processes import (tests/compile_imports.py;
	# docs/benchmarks.md, "The test suite on two cores").
	$(PIP) install --no-compile torch==$(TORCH_VERSION)
	$(PIP) install --no-compile -e '.[dev]'
	# NIXL the lean way: its own dependencies would pull CUDA torch (pip check
	# then reports nixl-cu13 and torch as missing; both are unneeded on CPU).
	# xgrammar (structured output) without its dependencies; triton, one of them, pinned beside it.
	$(PIP) install --no-compile --no-deps nixl==$(NIXL_VERSION) nixl-cu12==$(NIXL_VERSION) \
		xgrammar==$(XGRAMMAR_VERSION) triton==$(TRITON_VERSION)
	$(BYTECODE_ENV) $(BIN)/python -m tests.compile_imports
	touch $@

prepare: setup
	for dtype in $(DTYPE); do $(BYTECODE_ENV) $(BIN)/tessera model prepare --dtype $$dtype || exit 1; done

# The fastest dtype this machine computes (bfloat16 with AVX512-BF16 or AMX, or on AVX2 without AVX-512, else float32);
# RUN_DTYPE=float32 overrides.
# Passed by name: the tessera commands' own default is float32, the dtype `make prepare` makes.
RUN_DTYPE ?= auto

run: setup
	$(BYTECODE_ENV) $(BIN)/tessera model prepare --dtype $(RUN_DTYPE)
	$(BYTECODE_ENV) $(BIN)/tessera up --dtype $(RUN_DTYPE) --port $(PORT)

# Three lanes side by side (tests/conftest.py says which test runs in which); LANES= runs the tests one at a time.
LANES ?= --numprocesses=3
test: setup prepare
	$(BYTECODE_ENV) $(BIN)/python -m pytest -q $(LANES) $(PYTEST_ARGS)

# Flake finder: the e2e tests (or REPEAT_ARGS) REPEAT times, then every test that failed in any round.
REPEAT ?= 3
REPEAT_ARGS ?= tests/e2e
test-repeat: setup prepare
	$(BYTECODE_ENV) $(BIN)/python -m tests.repeat --count $(REPEAT) $(REPEAT_ARGS) $(LANES)

# A production install: a virtualenv at PREFIX with the project (not editable) and its runtime dependencies only,
# the CPU build of torch, NIXL and xgrammar; no test or dev tools. On a GPU host install the CUDA torch build first
# (pip install torch==$(TORCH_VERSION) from PyTorch's CUDA index) and then run this.
PREFIX ?= /opt/tessera/venv
install:
	test -x $(PREFIX)/bin/python || $(PYTHON) -m venv $(PREFIX)
	$(PREFIX)/bin/python -m pip --quiet install --upgrade pip
	$(PREFIX)/bin/python -c "import torch" 2>/dev/null || $(PREFIX)/bin/python -m pip --quiet install torch==$(TORCH_VERSION)
	$(PREFIX)/bin/python -m pip --quiet install '.[prepare]'
	$(PREFIX)/bin/python -m pip --quiet install --no-deps nixl==$(NIXL_VERSION) nixl-cu12==$(NIXL_VERSION)
	$(PREFIX)/bin/python -m pip --quiet install --no-deps xgrammar==$(XGRAMMAR_VERSION)
	$(PREFIX)/bin/tessera --version

