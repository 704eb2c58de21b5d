#!/usr/bin/env bash
# Predicted vs measured on one real GPU: a single-GPU megatron-core training under --poseidon-auto
# (world size 1). Poseidon profiles the model's layer on the GPU, plans, and the training's
# calibration line compares the predicted iteration time and peak memory with the measured ones.
#
#   bash examples/gpu_check.sh            # on a machine with one CUDA GPU (torch + megatron-core)
#   bash examples/gpu_check.sh --cpu      # rehearsal on CPU (one emulated device, tiny model)
#
# First `poseidon profile` of the llama3-8b preset's layer (TP 1, micro-batches 1 and 2, sequence
# 4096; on CPU the tiny model) into llama3-8b-<device>.json, a DB `poseidon plan --profiles`
# reads. Writes build/gpu-check/<device>/: that DB and profile.log, run.log (the whole launch),
# profiles-*.json (the launch's measured profile DB), plan.json, and summary.txt: device,
# driver, torch and megatron-core versions, the profiled records, the plan's predicted
# iteration time and per-stage memory, and the calibration line (predicted vs measured
# iteration time, predicted vs measured peak memory). Send summary.txt and the profile DBs.
# GPU_CHECK_MODEL=moe checks a mixed MoE model instead (examples/models/gpu-moe.yaml on the GPU: one
# dense layer, then three MoE layers of 8 experts, top-2, EP 1; on CPU examples/models/tiny-moe.yaml):
# each layer kind profiled, the plan's per-stage memory parts, into build/gpu-check/<device>-moe/.
# Extra Megatron flags: GPU_CHECK_ARGS="--seq-length 4096 ..." (appended, so they win).
# GPU_CHECK_COPY_TO=DIR also copies those files to DIR; GPU_CHECK_PROFILE_TIMEOUT and
# GPU_CHECK_TRAIN_TIMEOUT (seconds; 900 and 1800) bound the two steps; GPU_CHECK_SKIP_PROFILE=1
# runs the training alone.
#
# On a machine without network (a lent GPU machine with torch but no megatron-core): run
# examples/gpu_kit.sh here first (it fetches the megatron-core wheel into .whl/), take .whl/
# along, and this script installs it into /tmp/poseidon-site; it builds the Cython core in place
# when it is not built (Cython and a C compiler needed there). On this workplace's lent machine:
#   run(command="GPU_CHECK_COPY_TO=$OUT GPU_CHECK_PROFILE_TIMEOUT=100 GPU_CHECK_TRAIN_TIMEOUT=150
#                bash examples/gpu_check.sh", carry=[".whl", <the four built .so files>], timeout_s=300)
# (carrying the Cython modules built here skips the build there). On an H200 (2026-11-26) the
# profile step took ~30 s and the training ~50 s; results in docs/fidelity.md, "On a real GPU".
set -euo pipefail
cd "$(dirname "$0")/.."

MODE=gpu
[ "${1:-}" = "--cpu" ] && MODE=cpu
KIND="${GPU_CHECK_MODEL:-dense}"    # dense (llama3-8b layers) or moe (a dense layer, then MoE layers)
case "$KIND" in dense|moe) ;; *) echo "GPU_CHECK_MODEL: expected dense or moe, got '$KIND'" >&2; exit 2;; esac
if [ -x .venv/bin/torchrun ]; then BIN=.venv/bin/; else BIN=""; fi
if [ -n "$BIN" ]; then PY="${BIN}python"; else PY="$(command -v python3 || command -v python)"; fi
if [ -n "$BIN" ]; then TORCHRUN=("${BIN}torchrun"); else TORCHRUN=("$PY" -m torch.distributed.run); fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PORT="${MASTER_PORT:-$((29500 + RANDOM % 2000))}"

COPY_TO="${GPU_CHECK_COPY_TO:-}"

# A machine without network (a lent GPU machine): megatron-core from the wheel in .whl/
# (examples/gpu_kit.sh fetched it) into a private folder, and the Cython core built in place.
if ! "$PY" -c "import megatron.core" 2>/dev/null; then
  if ls .whl/megatron_core-*.whl >/dev/null 2>&1; then
    echo "== megatron-core missing: installing .whl/ into /tmp/poseidon-site"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/poseidon-site .whl/megatron_core-*.whl
    export PYTHONPATH="$PYTHONPATH:/tmp/poseidon-site"
  else
    echo "megatron-core is not importable here and .whl/ holds no wheel of it (run" \
         "examples/gpu_kit.sh where there is network, or pip install megatron-core==0.19.2)" >&2
    exit 3
  fi
fi
if ! "$PY" -c "import poseidon_plugin._core, poseidon_plugin.search._search" 2>/dev/null; then
  echo "== building the Cython core in place"
  "$PY" setup.py -q build_ext --inplace -j "$(nproc 2>/dev/null || echo 2)" > build-ext.log 2>&1 || {
    echo "could not build the Cython core (build-ext.log)" >&2; tail -20 build-ext.log >&2; exit 3; }
fi

if [ "$MODE" = gpu ]; then
  "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)" || {
    echo "no CUDA GPU visible to torch; rehearse on CPU with: bash examples/gpu_check.sh --cpu" >&2
    exit 3; }
  DEVICE=$("$PY" -c "import torch; print(torch.cuda.get_device_name(0).replace(' ', '-'))")
  IMPL=local
  "$PY" -c "import transformer_engine" 2>/dev/null && IMPL=transformer_engine
  # four llama3-8b layers (GQA, SwiGLU, RMSNorm, RoPE) with a 32k vocabulary: ~1.1 B parameters,
  # ~20 GiB of weights, gradients and Adam states on one device
  MODEL_ARGS=(--num-layers 4 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
              --group-query-attention --num-query-groups 8 --swiglu --normalization RMSNorm
              --position-embedding-type rope --untie-embeddings-and-output-weights
              --disable-bias-linear --seq-length 2048 --max-position-embeddings 2048
              --vocab-size 32000 --transformer-impl "$IMPL")
  TRAIN_ARGS=(--micro-batch-size 1 --global-batch-size 8 --train-iters 20)
  if [ "$KIND" = moe ]; then
    # examples/models/gpu-moe.yaml: one dense layer, then three MoE layers of 8 experts (top-2),
    # GQA 16/4, SwiGLU, RMSNorm, RoPE, 32k vocabulary: ~1.1 B parameters, ~0.6 B active
    MODEL_ARGS=(--num-layers 4 --hidden-size 2048 --ffn-hidden-size 8192 --num-attention-heads 16
                --group-query-attention --num-query-groups 4 --swiglu --normalization RMSNorm
                --position-embedding-type rope --untie-embeddings-and-output-weights
                --disable-bias-linear --seq-length 2048 --max-position-embeddings 2048
                --vocab-size 32000 --transformer-impl "$IMPL"
                --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 2048
                --moe-layer-freq "[0]*1+[1]*3" --moe-token-dispatcher-type alltoall)
  fi
  EMU=()
else
  DEVICE=cpu-emulated
  MODEL_ARGS=(--num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128
              --max-position-embeddings 128 --vocab-size 512)
  TRAIN_ARGS=(--micro-batch-size 1 --global-batch-size 4 --train-iters 10)
  if [ "$KIND" = moe ]; then   # examples/models/tiny-moe.yaml (2 dense + 6 MoE layers, 8 experts)
    MODEL_ARGS=(--num-layers 8 --hidden-size 256 --num-attention-heads 8 --ffn-hidden-size 1024
                --seq-length 128 --max-position-embeddings 128 --vocab-size 1024
                --disable-bias-linear --untie-embeddings-and-output-weights
                --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 256
                --moe-layer-freq "[0]*2+[1]*6" --moe-shared-expert-intermediate-size 256
                --moe-token-dispatcher-type alltoall)
  fi
  export OMP_NUM_THREADS=1
fi

DEST="build/gpu-check/$DEVICE"
[ "$KIND" = moe ] && DEST="build/gpu-check/$DEVICE-moe"
mkdir -p "$DEST"
if [ "$MODE" = cpu ]; then
  printf 'device_types:\n  emu-one: {speed: 1.0, memory_gib: 16}\nranks: [emu-one]\n' > "$DEST/emulate-1rank.yaml"
  EMU=(--poseidon-emulate "$DEST/emulate-1rank.yaml")
fi
export POSEIDON_PROFILE_DIR="$PWD/$DEST"
read -r -a EXTRA <<< "${GPU_CHECK_ARGS:-}"

# the offline profiler on this device: one decoder layer, TP 1, micro-batches 1 and 2, into a DB
# that `poseidon plan --profiles` reads (the GPU: the llama3-8b preset at sequence 4096, with the
# training's attention: unfused with Megatron's local spec, flash with Transformer Engine)
if [ "$MODE" = gpu ]; then
  ATTN=unfused; [ "$IMPL" = transformer_engine ] && ATTN=flash   # as the training's layer spec
  PROF=(--model llama3-8b --seq-length 4096 --device cuda --attention "$ATTN")
  DB="$DEST/llama3-8b-$DEVICE.json"
  if [ "$KIND" = moe ]; then   # each layer kind of the training's model (dense, MoE) at its sequence
    PROF=(--model examples/models/gpu-moe.yaml --seq-length 2048 --device cuda --attention "$ATTN")
    DB="$DEST/gpu-moe-$DEVICE.json"
  fi
else
  PROF=(--model examples/models/tiny-gpt.yaml --seq-length 128 --device cpu); DB="$DEST/tiny-gpt-$DEVICE.json"
  if [ "$KIND" = moe ]; then
    PROF=(--model examples/models/tiny-moe.yaml --seq-length 128 --device cpu); DB="$DEST/tiny-moe-$DEVICE.json"
  fi
fi
PROF_RC=skipped
if [ -z "${GPU_CHECK_SKIP_PROFILE:-}" ]; then   # GPU_CHECK_SKIP_PROFILE=1: the training alone
  echo "== poseidon profile ${PROF[*]} --device-type $DEVICE --tp 1 --micro-batch-sizes 1 2 -o $DB"
  rm -f "$DB"
  set +e
  timeout "${GPU_CHECK_PROFILE_TIMEOUT:-900}" "$PY" -m poseidon_plugin profile "${PROF[@]}" --device-type "$DEVICE" --tp 1 \
      --micro-batch-sizes 1 2 -o "$DB" > "$DEST/profile.log" 2>&1
  PROF_RC=$?
  set -e
  grep -E "decoder tp|wrote|error" "$DEST/profile.log" || true
fi

# GPU_CHECK_REUSE_CACHE=1: a second launch, planned from the first one's cached profiles and the
# per-iteration overhead its calibration wrote (otherwise every launch profiles afresh)
REPROFILE=(--poseidon-reprofile)
[ -n "${GPU_CHECK_REUSE_CACHE:-}" ] && REPROFILE=()
echo "== $MODE check on $DEVICE: torchrun --nproc-per-node 1 -m poseidon_plugin.launch examples/pretrain_gpt.py ... --poseidon-auto"
set +e
timeout "${GPU_CHECK_TRAIN_TIMEOUT:-1800}" "${TORCHRUN[@]}" --nproc-per-node 1 --master-addr 127.0.0.1 --master-port "$PORT" \
    -m poseidon_plugin.launch examples/pretrain_gpt.py "${MODEL_ARGS[@]}" "${TRAIN_ARGS[@]}" \
    --lr 1e-4 --lr-decay-style constant --mock-data --tokenizer-type NullTokenizer \
    --log-interval 1 --eval-iters 0 --eval-interval 100000 --num-workers 0 --bf16 --seed 1234 \
    "${EXTRA[@]}" --poseidon-auto "${REPROFILE[@]}" --poseidon-save-plan "$DEST/plan.json" \
    "${EMU[@]}" > "$DEST/run.log" 2>&1
RC=$?
set -e

set +e
PROF_RC="$PROF_RC" "$PY" - "$DEST" "$RC" <<'EOF'
import json, os, re, subprocess, sys

out, rc = sys.argv[1], int(sys.argv[2])
log = open(os.path.join(out, "run.log"), encoding="utf-8", errors="replace").read()
lines = []

def versions():
    import torch
    try:
        from importlib.metadata import version
        mcore = version("megatron-core")
    except Exception:  # noqa: BLE001
        mcore = "source checkout"
    driver = "n/a"
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                 "--format=csv,noheader"], capture_output=True, text=True,
                                timeout=20).stdout.strip() or "n/a"
    except (OSError, subprocess.SubprocessError):
        pass
    cuda = torch.version.cuda or "none"
    return f"torch {torch.__version__} (CUDA {cuda}), megatron-core {mcore}, GPU/driver: {driver}"

lines.append(f"launch exit code: {rc}")
prof_log = os.path.join(out, "profile.log")
if os.path.exists(prof_log):
    plines = [l.strip() for l in open(prof_log, encoding="utf-8", errors="replace")
              if re.search(r"decoder tp\d|wrote \d|error", l)]
    lines.append("poseidon profile (exit code " + os.environ.get("PROF_RC", "?") + "):")
    lines += ["  " + l for l in plines]
lines.append(versions())
plan_path = os.path.join(out, "plan.json")
if os.path.exists(plan_path):
    plan = json.load(open(plan_path, encoding="utf-8"))
    lines.append(f"plan: {plan['schedule']} pp={plan['pp']} dp={plan['dp']} tp={plan['tp']} "
                 f"mbs={plan['micro_batch_size']} x {plan['num_microbatches']}; predicted "
                 f"iteration {plan['predicted_iteration_time_ms']:.1f} ms")
    for s in plan["stages"]:
        lines.append(f"  stage {s['index']}: {s['layers']} layers, fwd {s['forward_ms']:.2f} ms, "
                     f"bwd {s['backward_ms']:.2f} ms, optimizer {s.get('optimizer_ms', 0):.2f} ms, "
                     f"predicted memory {s['memory_bytes'] / 2**30:.2f} GiB")
        parts = s.get("memory") or {}
        if isinstance(parts, list):
            parts = dict(parts)
        if parts:
            lines.append("    memory parts: " + ", ".join(
                f"{k} {v / 2**30:.2f} GiB" for k, v in parts.items()
                if k.endswith("_bytes") and k != "total_bytes" and isinstance(v, (int, float)) and v))
# the launch's own profile of each layer kind (a mixed model: "dense" / "moe" after the type)
lines += [l.strip() for l in log.splitlines()
          if re.search(r"\] +\S+ +(\S+ +)?tp=\d+ mbs=\d+ ", l) or "profiled MoE layer" in l]
# the calibration report is logged folded (continuations indented by four spaces): one line here
unfolded = re.sub(r"\n {4}(?=\S)", " ", log)
cal = list(dict.fromkeys(l.strip() for l in unfolded.splitlines() if "calibration: iteration" in l))
lines += cal or ["no calibration line (the training failed or ran fewer than 4 iterations; see "
                 "run.log)"]
text = "\n".join(lines) + "\n"
open(os.path.join(out, "summary.txt"), "w", encoding="utf-8").write(text)
sys.stdout.write(text)
sys.exit(rc if rc else (0 if cal else 1))
EOF
SUM_RC=$?
if [ -n "$COPY_TO" ]; then   # e.g. GPU_CHECK_COPY_TO=$OUT on a lent machine: what comes back
  mkdir -p "$COPY_TO"
  cp "$DEST"/summary.txt "$DEST"/run.log "$DEST"/profile.log "$COPY_TO"/ 2>/dev/null
  cp "$DEST"/plan.json "$DEST"/profiles-*.json "$DB" "$COPY_TO"/ 2>/dev/null
  ls -l "$COPY_TO"
fi
exit "$SUM_RC"
