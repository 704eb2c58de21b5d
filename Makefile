# Poseidon plugin: set-up, tests, demo and benchmarks.
#   make demo   - create .venv, build, run the emulated 4-rank --poseidon-auto launch
#   make test   - create .venv, build, run the fast tier of the test suite (-m "not slow")
#   make test-slow - the slow tier (-m slow: multi-rank training launches, the heaviest searches);
#                    CI runs make test and make test-slow, so every test runs there
#   make bench  - simulator and search benchmarks (tables for the README)
#   make docs   - the documentation site (mkdocs.yml, docs/) into site/, built with --strict
#   make test-py310 - the torch-free core's tests on Python 3.10 (.venv310; CI runs it too)
#   make test-mcore-versions - the profiler on Megatron-LM core 0.12.1 / 0.15.3 / 0.19.0 trees,
#                              and core_v0.19.0's own pretrain_gpt.py planned and trained (launcher
#                              and one-line patch), saved and resumed under other plans
#                              (../shared/frameworks; skipped where absent)

SHELL := /bin/bash
VENV  := .venv
PY    := $(VENV)/bin/python
PIP   := $(VENV)/bin/pip

# Python 3.12 is required (megatron-core 0.19.2's wheel needs it). Try PATH, then pyenv.
PYTHON312 ?= $(shell for p in python3.12 $${PYENV_ROOT:-$$HOME/.pyenv}/versions/3.12*/bin/python3.12 /usr/bin/python3.12 /usr/local/bin/python3.12; do \
	if $$p -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; then echo $$p; break; fi; done)

PYX := $(wildcard poseidon_plugin/*.pyx poseidon_plugin/*.pxd poseidon_plugin/*/*.pyx poseidon_plugin/*/*.pxd)

# Python 3.10 (MindSpeed-LLM / CANN's Python): the torch-free core is tested on it as well.
PYTHON310 ?= $(shell for p in python3.10 $${PYENV_ROOT:-$$HOME/.pyenv}/versions/3.10*/bin/python3.10 /usr/bin/python3.10 /usr/local/bin/python3.10; do \
	if $$p -c 'import sys; assert sys.version_info[:2] == (3, 10)' >/dev/null 2>&1; then echo $$p; break; fi; done)
VENV310 := .venv310
CORE_DEPS := "cython>=3.0" "numpy>=1.26" "pyyaml>=6" "pytest>=8" "hypothesis>=6.100" "matplotlib>=3.7" \
	"pytest-xdist>=3.5"

# The fast tiers (make test, make test-core, make test-py310) run in TEST_JOBS pytest processes
# (pytest-xdist; a test file stays in one process, so its module fixtures run once). 2 fits the
# 2-core CI host: the fast tier was shown to pass beside two CPU hogs. TEST_JOBS=0: one process.
TEST_JOBS ?= 2
XDIST = -n $(TEST_JOBS) --dist loadfile

# Megatron-LM trees (megatron/ at each tag; the PyPI wheels before 0.18 ship no megatron/training):
# the unchanged checkouts in the workplace's shared/frameworks (FRAMEWORKS, beside the repository;
# no network), and a side environment with their pure-Python extras that reaches torch through
# $(VENV). Where FRAMEWORKS is absent (a user's clone) the target says so and skips.
MCORE_VERSIONS ?= 0.12.1 0.15.3 0.19.0
FRAMEWORKS ?= ../shared/frameworks
MCORE_DIR := .mcore
MCORE_PY := $(MCORE_DIR)/venv/bin/python

.PHONY: all venv build test test-slow test-core test-py310 test-mcore-versions demo bench validate docs clean

all: build

$(VENV)/.stamp-deps: setup.py
	@if [ -z "$(PYTHON312)" ]; then echo "error: Python 3.12 not found (tried python3.12 and pyenv); install it or set PYTHON312=/path/to/python3.12" >&2; exit 2; fi
	@[ -x $(PY) ] || $(PYTHON312) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	$(PIP) install -q $(CORE_DEPS) "pybind11>=2.10"
	$(PIP) install -q torch "megatron-core==0.19.2" psutil   # psutil: megatron-core's torch_dist checkpoint writer
	touch $@

venv: $(VENV)/.stamp-deps

$(VENV)/.stamp-build: $(VENV)/.stamp-deps $(PYX) setup.py
	$(PY) setup.py -q build_ext --inplace
	$(PIP) install -q --no-build-isolation --no-deps -e .
	touch $@

build: $(VENV)/.stamp-build

# MindSpeed-LLM's pure-Python dependencies (the versions its v2.3.0 / v26.1.0 launches were run
# with here) in a side environment that reaches torch, megatron-core's deps and this package
# through $(VENV); built only where the framework trees are (they are what it runs).
MSLLM_DIR := .msllm
MSLLM_PY := $(MSLLM_DIR)/venv/bin/python
MSLLM_DEPS := six==1.17.0 regex einops==0.8.2 tqdm scipy pybind11==3.1.0 transformers==5.24.0 \
	datasets==5.2.0 peft==0.21.2

$(MSLLM_DIR)/venv/.stamp: $(VENV)/.stamp-deps
	rm -rf $(MSLLM_DIR)/venv
	$(PY) -m venv --without-pip $(MSLLM_DIR)/venv
	$(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' \
	  > "$$($(MSLLM_PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/zz_poseidon_main_venv.pth"
	$(PIP) --python $(MSLLM_PY) install -q $(MSLLM_DEPS)
	touch $@

TEST_ENV = POSEIDON_FRAMEWORKS=$(abspath $(FRAMEWORKS)) \
	$(if $(wildcard $(FRAMEWORKS)),POSEIDON_MSLLM_PYTHON=$(abspath $(MSLLM_PY)))

test: build $(if $(wildcard $(FRAMEWORKS)),$(MSLLM_DIR)/venv/.stamp)
	$(TEST_ENV) $(PY) -m pytest -q -rs $(XDIST) tests -m "not slow"

# the slow searches (no torch, one core each) in TEST_JOBS processes, test by test, then the
# launches one at a time (each is 2-4 ranks on the CPU, and their emulated timings want the cores)
test-slow: build $(if $(wildcard $(FRAMEWORKS)),$(MSLLM_DIR)/venv/.stamp)
	$(TEST_ENV) $(PY) -m pytest -q -rs -n $(TEST_JOBS) tests -m "slow and not integration"
	$(TEST_ENV) $(PY) -m pytest -q -rs tests -m "slow and integration"

test-core: build
	$(PY) -m pytest -q -rs $(XDIST) tests -m "not integration and not slow"

$(VENV310)/.stamp-deps: setup.py
	@if [ -z "$(PYTHON310)" ]; then echo "error: Python 3.10 not found (tried python3.10 and pyenv); install it or set PYTHON310=/path/to/python3.10" >&2; exit 2; fi
	@[ -x $(VENV310)/bin/python ] || $(PYTHON310) -m venv $(VENV310)
	$(VENV310)/bin/pip install -q --upgrade pip "setuptools>=69" wheel
	$(VENV310)/bin/pip install -q $(CORE_DEPS)
	touch $@

test-py310: $(VENV310)/.stamp-deps
	$(VENV310)/bin/pip install -q --no-build-isolation --no-deps -e .
	$(VENV310)/bin/python -m pytest -q -rs $(XDIST) -p no:cacheprovider tests -m "not integration and not slow"

$(MCORE_DIR)/venv/.stamp: $(VENV)/.stamp-deps
	rm -rf $(MCORE_DIR)/venv
	$(PY) -m venv --without-pip $(MCORE_DIR)/venv
	$(PIP) --python $(MCORE_PY) install -q --no-deps six regex einops
	$(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' \
	  > "$$($(MCORE_PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/zz_poseidon_main_venv.pth"
	touch $@

test-mcore-versions: build $(if $(wildcard $(FRAMEWORKS)),$(MCORE_DIR)/venv/.stamp)
	POSEIDON_FRAMEWORKS=$(abspath $(FRAMEWORKS)) POSEIDON_MCORE_VERSIONS="$(MCORE_VERSIONS)" \
	POSEIDON_MCORE_PYTHON=$(abspath $(MCORE_PY)) \
	  $(PY) -m pytest -q -rs tests/test_mcore_versions.py tests/test_megatron_lm_tree_launch.py \
	  tests/test_resume_replan.py "tests/test_memory_harness.py::test_memory_model_holds_on_megatron_core_012"

demo: build
	$(PY) -m poseidon_plugin.cli plan --cluster examples/clusters/paper-setting1.yaml --model llama3-8b --global-batch-size 128 --seq-length 4096
	@echo "== launch 1 of 2: profiles every rank, trains 16 iterations and calibrates the per-iteration overhead into the profile DB (build/poseidon-profiles; its plan and calibration lines only)"
	bash -o pipefail -c "bash examples/run_emulated.sh | awk '/calibration:/ {print; c = 1; next} c && /^    [^ ]/ {print; next} {c = 0} /^predicted iteration|^  iteration / {print}'"
	@echo "== launch 2 of 2: plans from the calibrated profile DB and trains"
	bash examples/run_emulated.sh

bench: build
	$(PY) benchmarks/bench_simulator.py
	$(PY) benchmarks/bench_search.py --max-seconds 120
	$(PY) benchmarks/bench_search.py --per-stage-tp --max-seconds 60 --no-baselines
	$(PY) benchmarks/bench_scale.py --budget 120
	$(PY) benchmarks/bench_scale.py --budget 60 --cases 70b-10240

validate: build
	$(PY) -m poseidon_plugin.cli validate

# The documentation site: mkdocs in its own small environment (any Python 3.8+), --strict so a
# broken link, a broken anchor or a page left out of mkdocs.yml's nav fails the build.
DOCS_VENV := .venv-docs
$(DOCS_VENV)/.stamp:
	@[ -x $(DOCS_VENV)/bin/python ] || $(or $(PYTHON312),python3) -m venv $(DOCS_VENV)
	$(DOCS_VENV)/bin/pip install -q "mkdocs>=1.5"
	touch $@

docs: $(DOCS_VENV)/.stamp
	$(DOCS_VENV)/bin/mkdocs build --strict

clean:
	rm -rf build *.egg-info poseidon_plugin/*.so poseidon_plugin/*.c poseidon_plugin/*/*.so poseidon_plugin/*/*.c $(VENV)/.stamp-build $(MCORE_DIR) $(MSLLM_DIR)
