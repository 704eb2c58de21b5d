# Poseidon plugin: set-up, tests, demo and benchmarks.
#   make demo   - create .venv, build, run the emulated 4-rank --poseidon-auto launch
#   make test   - create .venv, build, run the test suite
#   make bench  - simulator and search benchmarks (tables for the README)

SHELL := /bin/bash
VENV  := .venv
PY    := $(VENV)/bin/python
PIP   := $(VENV)/bin/pip

# Python 3.12 is required (megatron-core 0.19.2's wheel needs it). Try PATH, then pyenv.
PYTHON312 ?= $(shell for p in python3.12 $${PYENV_ROOT:-$$HOME/.pyenv}/versions/3.12*/bin/python3.12 /usr/bin/python3.12 /usr/local/bin/python3.12; do \
	if $$p -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; then echo $$p; break; fi; done)

PYX := $(wildcard poseidon_plugin/*/*.pyx poseidon_plugin/*/*.pxd)

.PHONY: all venv build test test-core demo bench validate clean

all: build

$(VENV)/.stamp-deps: setup.py
	@if [ -z "$(PYTHON312)" ]; then echo "error: Python 3.12 not found (tried python3.12 and pyenv); install it or set PYTHON312=/path/to/python3.12" >&2; exit 2; fi
	@[ -x $(PY) ] || $(PYTHON312) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	$(PIP) install -q "cython>=3.0" "numpy>=1.26" "pyyaml>=6" "tqdm>=4.60" "pytest>=8" "hypothesis>=6.100" "matplotlib>=3.7"
	$(PIP) install -q torch "megatron-core==0.19.2"
	touch $@

venv: $(VENV)/.stamp-deps

$(VENV)/.stamp-build: $(VENV)/.stamp-deps $(PYX) setup.py
	$(PY) setup.py -q build_ext --inplace
	$(PIP) install -q --no-build-isolation --no-deps -e .
	touch $@

build: $(VENV)/.stamp-build

test: build
	$(PY) -m pytest -q tests

test-core: build
	$(PY) -m pytest -q tests -m "not integration"

demo: build
	$(PY) -m poseidon_plugin.cli plan --cluster examples/clusters/paper-setting1.yaml --model llama3-8b --global-batch-size 128 --seq-length 4096
	bash examples/run_emulated.sh

bench: build
	$(PY) benchmarks/bench_simulator.py
	$(PY) benchmarks/bench_search.py --max-seconds 120
	$(PY) benchmarks/bench_scale.py --budget 120

validate: build
	$(PY) -m poseidon_plugin.cli validate

clean:
	rm -rf build *.egg-info poseidon_plugin/*/*.so poseidon_plugin/*/*.c $(VENV)/.stamp-build
