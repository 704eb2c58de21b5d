"""The profiler builds the user's real layer on each megatron-core version in the field.

Run by ``make test-mcore-versions`` (not part of ``make test``): it checks out Megatron-LM's
``megatron/`` tree at each tag (MindSpeed-LLM runs on such a copy of core_v0.12.1; the PyPI wheels
before 0.18 ship no ``megatron/training``) and points ``POSEIDON_MEGATRON_TREES`` at them
(``VERSION=DIR`` separated by spaces) and ``POSEIDON_MCORE_PYTHON`` at a side environment that
has the trees' few pure-Python extras and reaches torch through the main venv. Every case runs
``tests/mcore_layer_probe.py`` (Poseidon's profiler, one gloo process on CPU) in a subprocess
with the tree first on ``PYTHONPATH``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBE = os.path.join(ROOT, "tests", "mcore_layer_probe.py")
TREES = dict(item.split("=", 1) for item in os.environ.get("POSEIDON_MEGATRON_TREES", "").split()
             if "=" in item)
PYTHON = os.environ.get("POSEIDON_MCORE_PYTHON") or sys.executable

BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--max-position-embeddings 32 --micro-batch-size 1 --global-batch-size 1 "
        "--transformer-impl local --no-gradient-accumulation-fusion --no-persist-layer-norm "
        "--no-masked-softmax-fusion --no-bias-swiglu-fusion --no-bias-dropout-fusion "
        "--no-rope-fusion --swiglu --position-embedding-type rope --disable-bias-linear "
        "--tokenizer-type NullTokenizer --vocab-size 128 --lr 1e-4").split()
MLA = ("--multi-latent-attention --kv-lora-rank 32 --qk-head-dim 16 --qk-pos-emb-head-dim 8 "
       "--v-head-dim 16").split()
MOE = "--num-experts 4 --moe-router-topk 2 --moe-token-dispatcher-type allgather".split()

if not TREES:
    pytest.skip("POSEIDON_MEGATRON_TREES is not set (make test-mcore-versions sets it)",
                allow_module_level=True)


def probe(version: str, extra: list[str]) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TREES[version], ROOT]),
               OMP_NUM_THREADS="1", PROBE_PORT=str(29500 + os.getpid() % 2000),
               # megatron-core 0.15.x builds a CUDA allocator at import; without a GPU torch finds
               # no architecture and raises an IndexError unless one is named
               TORCH_CUDA_ARCH_LIST=os.environ.get("TORCH_CUDA_ARCH_LIST", "8.0"))
    proc = subprocess.run([PYTHON, "-W", "ignore", PROBE, *BASE, *extra], capture_output=True,
                          text=True, timeout=300, env=env, cwd=ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE ")]
    assert proc.returncode == 0 and lines, (proc.stdout + proc.stderr)[-4000:]
    report = json.loads(lines[-1][len("PROBE "):])
    assert report["megatron_file"].startswith(TREES[version]), report  # the tree, not the venv's
    assert report["megatron_core"].startswith(version.rsplit(".", 1)[0]), report
    return report


@pytest.mark.parametrize("version", sorted(TREES))
def test_normalization_is_the_users(version):
    rms = probe(version, ["--normalization", "RMSNorm"])
    assert "RMSNorm" in rms["modules"] and "LayerNorm" not in rms["modules"], rms
    assert rms["forward_ms"] > 0 and rms["backward_ms"] > 0, rms
    ln = probe(version, ["--normalization", "LayerNorm"])
    assert "RMSNorm" not in ln["modules"], ln


@pytest.mark.parametrize("version", sorted(TREES))
def test_multi_latent_attention_is_profiled_as_mla(version):
    """The spec is MLA's; building it needs Transformer Engine's attention (no CPU path in
    any of these versions' local spec), so only the spec is checked here."""
    r = probe(version, ["--normalization", "RMSNorm", *MLA])
    assert r["multi_latent_attention"] and "MLASelfAttention" in r["spec_modules"], r
    assert "SelfAttention" not in r["spec_modules"], r


@pytest.mark.parametrize("version", sorted(TREES))
def test_moe_layer_is_profiled_as_moe(version):
    r = probe(version, ["--normalization", "RMSNorm", *MOE])
    assert r["num_experts"] == 4 and {"MoELayer", "TopKRouter", "RMSNorm"} <= set(r["modules"]), r
    if version.startswith("0.15."):  # router_gating_linear reads te_general_gemm, unset without TE
        assert "forward_ms" in r or "te_general_gemm" in r.get("time_error", ""), r
    else:
        assert r.get("forward_ms", 0) > 0, r
