#!/usr/bin/env bash
# Rehearse a heterogeneous --poseidon-auto launch on this machine's CPU (no GPU needed):
# four ranks under torchrun, two emulated device types (examples/emulate-2types.yaml: the slow
# type on LOCAL_RANK 0,1, the fast one on 2,3), a tiny GPT trained by Megatron's own pretrain().
# Poseidon discovers the "cluster", profiles the model's layer on every rank, searches the plan,
# renumbers the ranks so the fast devices take the stages the plan gives them, rewrites the
# arguments, and the unmodified examples/pretrain_gpt.py trains with them.
#
#   bash examples/run_emulated.sh              # plan + train (prints the plan, then Megatron's log)
#   bash examples/run_emulated.sh --poseidon-dry-run   # plan only: table, rank map, exact flags
#   bash examples/run_emulated.sh -v           # ... and Megatron's whole log, unfiltered
set -euo pipefail
cd "$(dirname "$0")/.."
VERBOSE=0
if [ "${1:-}" = "-v" ]; then VERBOSE=1; shift; fi

if [ -x .venv/bin/torchrun ]; then TORCHRUN=.venv/bin/torchrun; else TORCHRUN=torchrun; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=1
export POSEIDON_PROFILE_DIR="${POSEIDON_PROFILE_DIR:-$PWD/build/poseidon-profiles}"
PORT="${MASTER_PORT:-$((29500 + RANDOM % 2000))}"

GPT_ARGS=(
  --num-layers 8 --hidden-size 128 --num-attention-heads 4
  --seq-length 128 --max-position-embeddings 128
  --micro-batch-size 1 --global-batch-size 16
  --train-iters 16 --lr 2e-3 --lr-decay-style constant
  --mock-data --tokenizer-type NullTokenizer --vocab-size 512
  --log-interval 1 --eval-iters 0 --eval-interval 1000 --num-workers 0 --bf16 --seed 1234
)

echo "== torchrun --nproc-per-node 4 -m poseidon_plugin.launch examples/pretrain_gpt.py ... --poseidon-auto --poseidon-emulate examples/emulate-2types.yaml"
# Megatron prints its full argument table, per-parameter lines and its DDP / optimizer configs
# (1,400-1,700 characters each); keep the plan, the Poseidon log and the training iterations
# (-v: everything). The lines dropped: examples/demo_log_filter.ere (tests/test_demo_filter.py).
"$TORCHRUN" --nproc-per-node 4 --master-addr 127.0.0.1 --master-port "$PORT" \
    -m poseidon_plugin.launch examples/pretrain_gpt.py "${GPT_ARGS[@]}" \
    --poseidon-auto --poseidon-emulate examples/emulate-2types.yaml "$@" 2>&1 \
  | if [ "$VERBOSE" = 1 ]; then cat; else grep --line-buffered -v -E -f examples/demo_log_filter.ere; fi
exit "${PIPESTATUS[0]}"
