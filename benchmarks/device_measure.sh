#!/usr/bin/env bash
# Quiet-machine measurements on a lent 16-core machine (no network), in one call:
# four jobs side by side, each pinned to its own cores with taskset, so each sees a quiet host.
#
#   cores 0-1   bench_search.py paper settings (the 2-core reference shape), then per-stage TP,
#               then bench_budget.py --cli (the whole poseidon plan run against --time-budget 10)
#   cores 2-3   bench_scale.py close-4096 / close-1024 / memtight-2048, then 405b-4096 /
#               dsv3-1024, at a 60 s budget
#   cores 4-11  bench_distributed.py: P processes x 2 threads (P hosts of 2 cores) vs one
#   cores 12-15 poseidon validate (CPU emulation of megatron-core pipelines, up to 4 ranks),
#               then an emulated 4-rank --poseidon-auto dry run (its launch measures the
#               per-op and per-call costs) and validate's search column timed with them
#
# Needs: python3 with torch, numpy, PyYAML, Cython and a C compiler; megatron-core 0.19.2
# from .whl/ (examples/gpu_kit.sh fetches it) when missing. Results: $OUT (or ./device-out).
#   run(command="bash benchmarks/device_measure.sh", carry=[".whl"], timeout_s=560)
# DEVICE_JOBS picks jobs (default "search scale validate distributed").
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-device-out}"; mkdir -p "$OUT"
JOBS="${DEVICE_JOBS:-search scale validate distributed}"
PY=python3
if ! $PY -c 'import megatron.core' 2>/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
        || { echo "megatron-core wheel missing: run examples/gpu_kit.sh"; exit 2; }
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
( nproc; lscpu | grep -E 'Model name|^CPU\(s\)'; uptime ) > "$OUT/machine.txt" 2>&1
$PY setup.py -q build_ext --inplace > "$OUT/build.log" 2>&1 || { cat "$OUT/build.log"; exit 2; }
pids=()
has() { [[ " $JOBS " == *" $1 "* ]]; }
if has search; then
    ( taskset -c 0,1 timeout 200 $PY benchmarks/bench_search.py --workers 2 --max-seconds 60 --no-baselines
      taskset -c 0,1 timeout 330 $PY benchmarks/bench_search.py --workers 2 --per-stage-tp --max-seconds 60 \
          --no-baselines --cases 1 2 3 4 5
      taskset -c 0,1 timeout 120 $PY benchmarks/bench_budget.py --cli --cli-budget 10 ) \
        > "$OUT/search.log" 2>&1 & pids+=($!)
fi
if has scale; then
    ( taskset -c 2,3 timeout 420 $PY benchmarks/bench_scale.py --workers 2 --budget 60 \
          --cases close-4096 close-1024 405b-memtight-2048
      taskset -c 2,3 timeout 200 $PY benchmarks/bench_scale.py --workers 2 --budget 60 \
          --cases 405b-4096 dsv3-1024 ) > "$OUT/scale.log" 2>&1 & pids+=($!)
fi
if has validate; then
    ( taskset -c 12-15 timeout 240 $PY -m poseidon_plugin.cli validate --json "$OUT/validate.json"
      rm -rf build/launch-calls
      taskset -c 12-15 timeout 150 $PY -m torch.distributed.run --nproc-per-node 4 \
          -m poseidon_plugin.launch examples/pretrain_gpt.py --num-layers 8 --hidden-size 128 \
          --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 \
          --micro-batch-size 2 --global-batch-size 16 --lr 2e-3 --mock-data \
          --tokenizer-type NullTokenizer --vocab-size 512 --bf16 --train-iters 2 --poseidon-auto \
          --poseidon-dry-run --poseidon-emulate examples/emulate-2types.yaml \
          --poseidon-profile-dir build/launch-calls > "$OUT/launch.log" 2>&1
      tail -n 5 "$OUT/launch.log"
      taskset -c 12-15 timeout 240 $PY -m poseidon_plugin.cli validate \
          --calls-from build/launch-calls/profiles-*.json ) > "$OUT/validate.log" 2>&1 & pids+=($!)
fi
if has distributed; then
    ( taskset -c 4-11 timeout 420 $PY benchmarks/bench_distributed.py --processes 1 2 4 \
          --workers-per-process 2 --cases 6-288 405b-512 --budget 30 ) > "$OUT/distributed.log" 2>&1 & pids+=($!)
fi
for p in "${pids[@]}"; do wait "$p"; done
uptime >> "$OUT/machine.txt"
tail -n 40 "$OUT"/*.log
