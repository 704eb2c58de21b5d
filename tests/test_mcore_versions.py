"""The profiler builds the user's real layer on each megatron-core version in the field.

Run by ``make test-mcore-versions`` (not part of ``make test``), on the unchanged Megatron-LM
checkouts of each tag in the workplace's ``../shared/frameworks`` (``megatron-lm-core_v0.12.1``,
``_v0.15.3``, ``_v0.19.0``; MindSpeed-LLM runs on such a copy of core_v0.12.1; the PyPI wheels
before 0.18 ship no ``megatron/training``): the target sets ``POSEIDON_FRAMEWORKS`` (that folder)
and ``POSEIDON_MCORE_VERSIONS``, or ``POSEIDON_MEGATRON_TREES`` names trees directly
(``VERSION=DIR`` separated by spaces), and ``POSEIDON_MCORE_PYTHON`` a side environment that has
the trees' few pure-Python extras and reaches torch through the main venv. Where the folder is
absent (a user's clone) every case is skipped, saying so. Every case runs
``tests/mcore_layer_probe.py`` (Poseidon's profiler, one gloo process on CPU) in a subprocess
with the tree first on ``PYTHONPATH``: the layer Megatron's own spec builds for the user's flags
(norm, MLA, MoE), timed, and the version and tree Poseidon records for it.
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
# POSEIDON_MCORE_VERSIONS is what says "this is make test-mcore-versions" (make test sets
# POSEIDON_FRAMEWORKS too, for other tests, and does not run these)
FRAMEWORKS = os.environ.get("POSEIDON_FRAMEWORKS", "") if "POSEIDON_MCORE_VERSIONS" in os.environ \
    else ""
VERSIONS = os.environ.get("POSEIDON_MCORE_VERSIONS", "0.12.1 0.15.3 0.19.0").split()
TREES = dict(item.split("=", 1) for item in os.environ.get("POSEIDON_MEGATRON_TREES", "").split()
             if "=" in item)
if not TREES and FRAMEWORKS:
    TREES = {v: os.path.join(FRAMEWORKS, f"megatron-lm-core_v{v}") for v in VERSIONS}
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

# the reason every case is skipped, if one is (marked on each case rather than skipping the
# module, so that pytest reports the skips and exits 0, not "no tests collected")
SKIP = ("" if TREES else "run by make test-mcore-versions (it names the Megatron-LM trees: "
        "POSEIDON_FRAMEWORKS + POSEIDON_MCORE_VERSIONS, or POSEIDON_MEGATRON_TREES)")
if not SKIP and FRAMEWORKS and not os.path.isdir(FRAMEWORKS):
    SKIP = (f"{FRAMEWORKS} is absent (a clone outside the project's workplace): the Megatron-LM "
            "core_v0.12.1 / 0.15.3 / 0.19.0 trees are not at hand; name your own checkouts with "
            "POSEIDON_MEGATRON_TREES='0.12.1=DIR ...'")
if not SKIP and not os.access(PYTHON, os.X_OK):
    SKIP = f"{PYTHON}: no such Python (make test-mcore-versions builds the side environment)"
if SKIP:
    pytestmark.append(pytest.mark.skip(reason=SKIP))
    TREES = TREES or {v: "" for v in VERSIONS}


def tree(version: str) -> str:
    path = TREES[version]
    if not os.path.isfile(os.path.join(path, "megatron", "core", "__init__.py")):
        pytest.skip(f"{path}: no Megatron-LM tree (megatron/core) there")
    return path


def probe(version: str, extra: list[str]) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tree(version), ROOT]),
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
    # records and the cache key name this tree: its own package_info, and its path's hash
    info = tree_version(tree(version))
    assert report["recorded"].startswith(info + " (tree "), (info, report)
    assert os.path.samefile(report["recorded_path"], tree(version)), report
    if "timed_param_bytes" in report:   # the profiler timed the layer built here, not another
        assert report["timed_param_bytes"] == report["param_bytes"] > 0, report
    return report


def tree_version(path: str) -> str:
    """MAJOR.MINOR.PATCH+PRE_RELEASE of a tree's megatron/core/package_info.py, read as text."""
    import re

    with open(os.path.join(path, "megatron", "core", "package_info.py"), encoding="utf-8") as f:
        text = f.read()
    parts = {k: re.search(rf"^{k} = (?:'|\")?([^'\"\n]*)", text, re.M).group(1)
             for k in ("MAJOR", "MINOR", "PATCH", "PRE_RELEASE")}
    return f"{parts['MAJOR']}.{parts['MINOR']}.{parts['PATCH']}{parts['PRE_RELEASE']}"


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
