"""Megatron-LM's own ``pretrain_gpt.py`` (the unchanged core_v0.19.0 tree in
``../shared/frameworks``) planned and trained by Poseidon: 4 CPU ranks of two emulated device
types (examples/emulate-2types.yaml), GPT with Llama-style arguments (SwiGLU, RMSNorm, RoPE, GQA,
untied embeddings), the user's ``--tensor-model-parallel-size 2 --pipeline-model-parallel-size
2`` and ``--no-overlap-p2p-communication``.

* under the launcher (``-m poseidon_plugin.launch <tree>/pretrain_gpt.py``; only this repository
  on ``PYTHONPATH``: the launcher puts the script's directory first, so the tree's ``megatron/``
  is imported, not the wheel in the venv): the dry run prints the plan and exits 0; the training
  run, planned from the dry run's profile cache, reaches ``lm loss`` on every iteration, and
  Megatron's own argument dump shows the plan's degrees and layout;
* with the one-line patch (patches/megatron-lm-core-ge-0.18.patch applied to a copy of the
  tree's ``pretrain_gpt.py`` in a temporary folder; the tree itself on ``PYTHONPATH`` for
  ``megatron/``, ``gpt_builders`` and ``model_provider``): plain torchrun, profiled, planned and
  trained by the import.

Run by ``make test-mcore-versions`` (it builds the side environment ``.mcore/venv``, the tree's
pure-Python extras, reaching torch and pybind11 (the tree's dataset helpers are compiled outside
it, into the test's folder) through the main venv, and names it in ``POSEIDON_MCORE_PYTHON``);
every case is skipped, saying why, elsewhere. About 2 minutes on the 2-core box (dry run ~35-50 s,
training ~40 s, patched script ~35 s).
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import time

import pytest

import frameworks as fw
from test_launch_e2e import EMULATE4, GPT_ARGS, free_port, ok, run_tree
from test_mcore_versions import tree_version

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TREE = fw.tree("megatron-lm-core_v0.19.0")
PATCH = os.path.join(fw.ROOT, "patches", "megatron-lm-core-ge-0.18.patch")
PYTHON = os.environ.get("POSEIDON_MCORE_PYTHON", "")
LLAMA = ("--swiglu --normalization RMSNorm --position-embedding-type rope "
         "--group-query-attention --num-query-groups 2 "
         "--untie-embeddings-and-output-weights").split()
USER = ("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
        "--no-overlap-p2p-communication").split()
ARGS = [*GPT_ARGS, *LLAMA, *USER]
TRAIN_ITERS = 3
P2P_LINE = ("interleaved-1f1b pp=2 excluded: Megatron requires pp > 2 with "
            "--no-overlap-p2p-communication")


def skip_reason() -> str | None:
    """Why Megatron-LM core_v0.19.0's own script cannot run here, or None."""
    if not os.path.isdir(fw.FRAMEWORKS):
        return (f"the framework trees are not here ({fw.FRAMEWORKS}): a user's clone; the "
                "workplace CI has them")
    if not os.path.isfile(os.path.join(TREE, "megatron", "core", "__init__.py")) \
            or not os.path.isfile(os.path.join(TREE, "pretrain_gpt.py")):
        return f"{TREE}: no Megatron-LM core_v0.19.0 tree (megatron/core, pretrain_gpt.py) there"
    if not PYTHON:
        return ("run by make test-mcore-versions (it builds Megatron-LM's side environment "
                ".mcore/venv and names it in POSEIDON_MCORE_PYTHON)")
    if not os.access(PYTHON, os.X_OK):
        return f"{PYTHON}: no such Python (make test-mcore-versions builds the side environment)"
    return None


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """The module's folder: one profile cache for the launcher's dry run and training run, one
    cache for the tree's compiled dataset helpers."""
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    return tmp_path_factory.mktemp("megatron-lm-0.19.0")


def torchrun(target: list[str], args: list[str], env: dict[str, str], pythonpath: list[str],
             timeout: float = 480):
    """4 local CPU ranks of the side environment's torchrun: (process, stdout + stderr, s)."""
    cmd = [PYTHON, "-m", "torch.distributed.run", "--nproc-per-node", "4",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *target, *args]
    full = {**os.environ, "PYTHONPATH": os.pathsep.join(pythonpath), "OMP_NUM_THREADS": "1",
            "PYTHONWARNINGS": "ignore", **env}
    t0 = time.monotonic()
    proc = run_tree(cmd, timeout, env=full, cwd=fw.ROOT)
    took = time.monotonic() - t0
    print(f"{' '.join(target[-1:])}: {took:.1f} s")
    return proc, proc.stdout + proc.stderr, took


def launcher(args: list[str], work, profiles: str = "profiles", tree: str = TREE):
    env = {"POSEIDON_PROFILE_DIR": str(work / profiles),
           "POSEIDON_HELPERS_CACHE": str(work / "megatron-helpers"),
           # megatron-core 0.15.x builds a CUDA allocator at import; without a GPU torch finds
           # no architecture unless one is named
           "TORCH_CUDA_ARCH_LIST": os.environ.get("TORCH_CUDA_ARCH_LIST", "8.0")}
    return torchrun(["-m", "poseidon_plugin.launch", os.path.join(tree, "pretrain_gpt.py")],
                    args, env, [fw.ROOT])


def check_records_name_the_tree(profile_dir) -> None:
    """The profile records (and so the cache key) name the tree's megatron, not the wheel's."""
    want = tree_version(TREE) + " (tree "
    caches = glob.glob(os.path.join(profile_dir, "profiles-*.json"))
    assert len(caches) == 1, caches
    with open(caches[0], encoding="utf-8") as f:
        records = json.load(f)["records"]
    assert records and all(r["env"]["megatron_core"].startswith(want) for r in records), \
        {r["env"]["megatron_core"] for r in records}


def check_plan_and_warnings(out: str, plan: dict) -> None:
    """The user's TP 2 / PP 2 gave way to the plan with one warning naming each change; the
    framework's up-front rule kept interleaved pp=2 out and its validate_args took the plan."""
    changed = [f"{flag} 2 -> {plan[key]}" for flag, key in
               (("--tensor-model-parallel-size", "tp"), ("--pipeline-model-parallel-size", "pp"))
               if plan[key] != 2]
    # TP 2 is measured >2x slower per layer than TP 1 over gloo on the CPU: the plan takes TP 1
    assert plan["tp"] == 1, plan["tp"]
    (line,) = [ln for ln in out.splitlines() if "the plan overrides your" in ln]
    assert all(c in line for c in changed), (changed, line)
    assert P2P_LINE in out, out[-4000:]
    assert not (plan["schedule"] == "interleaved-1f1b" and plan["pp"] <= 2), plan["schedule"]
    assert "searching again" not in out and "not checked by Megatron's validate_args" not in out


def check_training(out: str, plan: dict) -> None:
    """``lm loss`` on every iteration, and Megatron's own argument dump holds the plan."""
    losses = re.findall(r"iteration +(\d+)/ +\d+ \|.*?lm loss: ([0-9.E+-]+)", out)
    assert [int(i) for i, _ in losses] == list(range(1, TRAIN_ITERS + 1)), out[-4000:]
    assert all(0.0 < float(v) < 20.0 for _, v in losses), losses

    def dumped(name: str) -> str:
        m = re.search(rf"^\s*{name} \.+ (\S+)$", out, re.M)
        assert m, f"Megatron printed no {name}"
        return m.group(1)

    assert int(dumped("tensor_model_parallel_size")) == plan["tp"]
    assert int(dumped("pipeline_model_parallel_size")) == plan["pp"]
    assert dumped("normalization") == "RMSNorm" and dumped("swiglu") == "True"
    assert int(dumped("num_query_groups")) == 2 and int(dumped("world_size")) == 4
    flags = out.split("\nflags:\n", 1)[1].splitlines()[0]
    layout = re.search(r"--pipeline-model-parallel-layout '?([^' ]+)'?", flags)
    if layout:   # an uneven split reached Megatron as the plan wrote it
        assert dumped("pipeline_model_parallel_layout") == layout.group(1), flags


# ------------------------------------------------------------------------------------------

def test_launcher_dry_run_prints_the_plan_and_exits_0(work):
    plan_file = work / "dry-plan.json"
    args = [*ARGS, "--train-iters", str(TRAIN_ITERS), "--poseidon-auto", "--poseidon-dry-run",
            "--poseidon-emulate", EMULATE4, "--poseidon-save-plan", str(plan_file)]
    proc, out, _ = launcher(args, work)
    assert proc.returncode == 0, ok(proc, out)
    assert "profiling:" in out and "Poseidon plan (megatron)" in out
    assert "Plan for pretrain_gpt.py" in out and "command line the script runs with" in out
    assert "dry run: exiting before any model is built" in out
    assert "lm loss" not in out and "building GPT model" not in out
    check_plan_and_warnings(out, json.loads(plan_file.read_text()))
    check_records_name_the_tree(work / "profiles")


def test_launcher_training_reaches_lm_loss(work):
    plan_file = work / "train-plan.json"
    args = [*ARGS, "--train-iters", str(TRAIN_ITERS), "--poseidon-auto",
            "--poseidon-emulate", EMULATE4, "--poseidon-save-plan", str(plan_file)]
    had_cache = bool(glob.glob(str(work / "profiles" / "profiles-*.json")))
    proc, out, _ = launcher(args, work)
    assert proc.returncode == 0, ok(proc, out)
    if had_cache:   # the dry run's profiles (same tree, model and cluster): nothing measured
        assert "from the cache" in out and "profiling:" not in out, out[-4000:]
    plan = json.loads(plan_file.read_text())
    check_plan_and_warnings(out, plan)
    # the tree's helpers.cpp, compiled outside the read-only tree for Megatron's mock dataset
    assert "helpers_cpp built from " + os.path.join(TREE, "megatron") in out, out[-4000:]
    check_training(out, plan)


@pytest.mark.skipif(shutil.which("patch") is None, reason="GNU patch is not installed")
def test_one_line_patch_plans_and_trains(work):
    script_dir = work / "patched"
    script_dir.mkdir()
    shutil.copy(os.path.join(TREE, "pretrain_gpt.py"), script_dir / "pretrain_gpt.py")
    with open(PATCH, "rb") as f:
        applied = subprocess.run(["patch", "-p1", "--batch"], stdin=f, cwd=script_dir,
                                 capture_output=True, text=True, timeout=30)
    assert applied.returncode == 0 and "fuzz" not in applied.stdout, applied.stdout
    plan_file = work / "patch-plan.json"
    # its own profile cache (the import profiles the layer itself); TP 1 only, to keep it short
    env = {"POSEIDON_PROFILE_DIR": str(work / "profiles-patched"),
           "POSEIDON_HELPERS_CACHE": str(work / "megatron-helpers")}
    args = [*ARGS, "--train-iters", str(TRAIN_ITERS), "--poseidon-auto", "--poseidon-tp", "1",
            "--poseidon-emulate", EMULATE4, "--poseidon-save-plan", str(plan_file)]
    proc, out, _ = torchrun([str(script_dir / "pretrain_gpt.py")], args, env, [TREE, fw.ROOT])
    assert proc.returncode == 0, ok(proc, out)
    assert "profiling:" in out and "Poseidon plan (megatron)" in out
    plan = json.loads(plan_file.read_text())
    check_plan_and_warnings(out, plan)
    check_training(out, plan)
    check_records_name_the_tree(work / "profiles-patched")


# ------------------------------------------------------------------ MoE, interleaving (issue 36)

# a small mixed model: 1 dense + 3 MoE layers (4 experts, top-2, all-to-all), MTP, EP 2, an aux
# loss (--moe-aux-loss-coeff, as most MoE recipes set it)
MIXED = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 128 "
         "--seq-length 64 --max-position-embeddings 64 --micro-batch-size 1 "
         "--global-batch-size 8 --lr 2e-3 --lr-decay-style constant --mock-data "
         "--tokenizer-type NullTokenizer --vocab-size 512 --log-interval 1 --eval-iters 0 "
         "--eval-interval 1000 --bf16 --num-workers 0 --seed 1234 --disable-bias-linear "
         "--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 64 "
         "--moe-layer-freq [0]*1+[1]*3 --expert-model-parallel-size 2 "
         "--moe-token-dispatcher-type alltoall --moe-router-load-balancing-type aux_loss "
         "--moe-aux-loss-coeff 0.01 --mtp-num-layers 1 --position-embedding-type rope").split()


def losses_of(out: str) -> list[tuple[int, float]]:
    return [(int(i), float(v)) for i, v in
            re.findall(r"iteration +(\d+)/ +\d+ \|.*?lm loss: ([0-9.E+-]+|nan)", out)]


def test_mixed_moe_training_with_an_aux_loss(work):
    """Issue 36 items 9 and build 6: the profiled MoE layer's backward left a 0-dim aux-loss
    scale on MoEAuxLossAutoScaler; every rank then died in initialize_megatron
    (set_loss_scale: "output with shape [] doesn't match the broadcast shape [1]"). Now the
    tree's own pretrain_gpt.py trains the mixed model (dense + MoE + MTP, EP 2) to lm loss."""
    plan_file = work / "mixed-plan.json"
    args = [*MIXED, "--train-iters", str(TRAIN_ITERS), "--poseidon-auto", "--poseidon-tp", "1",
            "--poseidon-emulate", EMULATE4, "--poseidon-save-plan", str(plan_file)]
    proc, out, _ = launcher(args, work, "profiles-mixed")
    assert proc.returncode == 0, ok(proc, out)
    assert "doesn't match the broadcast shape" not in out
    plan = json.loads(plan_file.read_text())
    assert plan["ep"] == 2 and plan["dp"] % 2 == 0, plan
    losses = losses_of(out)
    assert [i for i, _ in losses] == list(range(1, TRAIN_ITERS + 1)), out[-4000:]
    assert all(0.0 < v < 20.0 for _, v in losses), losses
    assert re.search(r"load_balancing_loss: [0-9.E+-]+", out), out[-3000:]
    assert re.search(r"expert_model_parallel_size \.+ 2\b", out)
    assert re.search(r"mtp_num_layers \.+ 1\b", out)


def test_interleaved_training_on_megatron_core_0_15_3(work):
    """Issue 36 item 12: megatron-core 0.15.3's interleaved schedule (overlap_p2p_comm) frees an
    output whose isend has not finished; over gloo the next stage got garbage and the loss was
    NaN at iteration 2. Under the emulation every pipeline send now goes from a private copy:
    Megatron-LM core_v0.15.3's own pretrain_gpt.py trains an interleaved plan."""
    tree = fw.tree("megatron-lm-core_v0.15.3")
    if not os.path.isfile(os.path.join(tree, "pretrain_gpt.py")):
        pytest.skip(f"{tree}: no Megatron-LM core_v0.15.3 tree there")
    plan_file = work / "interleaved-plan.json"
    # its mock data draws token ids up to 4095: the vocabulary must hold them
    args = [*GPT_ARGS, "--vocab-size", "4096", "--train-iters", str(TRAIN_ITERS),
            "--poseidon-auto", "--poseidon-tp", "1", "--poseidon-schedules", "interleaved-1f1b", "--poseidon-emulate", EMULATE4,
            "--poseidon-save-plan", str(plan_file)]
    proc, out, _ = launcher(args, work, "profiles-0.15.3", tree=tree)
    assert proc.returncode == 0, ok(proc, out)
    assert ("emulation: megatron-core 0.15.3's interleaved schedule frees a pipeline output "
            "before its isend has finished") in out, out[-3000:]
    plan = json.loads(plan_file.read_text())
    assert plan["schedule"] == "interleaved-1f1b" and plan["virtual_stages"] > 1, plan
    losses = losses_of(out)
    assert [i for i, _ in losses] == list(range(1, TRAIN_ITERS + 1)), out[-4000:]
    assert all(0.0 < v < 20.0 for _, v in losses), losses
