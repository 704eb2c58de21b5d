#!/usr/bin/env bash
# The files a machine without network needs for examples/gpu_check.sh, fetched here (with
# network) into .whl/ (git-ignored): the megatron-core 0.19.2 wheel for CPython 3.12 on x86-64
# Linux. Everything else gpu_check.sh needs (torch with CUDA, numpy, PyYAML, Cython, a C
# compiler) is assumed on the GPU machine; gpu_check.sh installs the wheel into a private
# folder when megatron-core is missing there and builds this package's Cython core in place.
#
#   bash examples/gpu_kit.sh        # then copy or carry .whl/ along with the repository
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY="$(command -v python3)"; fi
mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "megatron-core==0.19.2"
ls -l .whl
