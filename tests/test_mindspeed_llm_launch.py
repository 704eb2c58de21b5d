"""MindSpeed-LLM's own ``pretrain_gpt.py`` (v26.1.0 and v2.3.0, real trees, Megatron-LM
core_v0.12.1) launched with ``--poseidon-auto`` under torchrun: 4 CPU ranks of two emulated
device types, NPU libraries from tests/npu_fakes, everything else the frameworks' own code. The
dry run prints the plan and exits 0; the training run (planned from the dry run's profile cache)
reaches ``lm loss`` on every iteration."""

from __future__ import annotations

import os
import re
import time

import pytest

import frameworks as fw
from test_launch_e2e import EMULATE4, free_port, ok, run_tree, with_value

pytestmark = pytest.mark.integration

# Megatron 0.12.1's mock data draws token ids up to 4095: the vocabulary must hold them
ARGS = ("--num-layers 8 --hidden-size 128 --num-attention-heads 4 --seq-length 128 "
        "--max-position-embeddings 128 --micro-batch-size 1 --global-batch-size 16 "
        "--lr 2e-3 --lr-decay-style constant --mock-data --tokenizer-type NullTokenizer "
        "--vocab-size 4096 --log-interval 1 --eval-iters 0 --eval-interval 1000 --bf16 "
        "--num-workers 0 --seed 1234").split()
TRAIN_ITERS = 3


def launch(release: str, args: list[str], env: dict[str, str], timeout: float = 420,
           nproc: int = 4):
    cmd = [fw.msllm_python(), "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           "-m", "poseidon_plugin.launch", fw.script(release), *args]
    t0 = time.monotonic()
    proc = run_tree(cmd, timeout, env=fw.mindspeed_llm_env(release, env), cwd=fw.ROOT)
    return proc, proc.stdout + proc.stderr, time.monotonic() - t0


@pytest.fixture(scope="module", params=sorted(fw.MINDSPEED_LLM_RELEASES))
def release(request, tmp_path_factory):
    reason = fw.mindspeed_llm_skip_reason(request.param)
    if reason:
        pytest.skip(reason)
    return request.param, tmp_path_factory.mktemp(f"msllm-{request.param}")


def _env(tmp) -> dict[str, str]:
    return {"POSEIDON_PROFILE_DIR": str(tmp / "profiles"),
            "POSEIDON_HELPERS_CACHE": str(tmp.parent / "megatron-helpers")}


def test_dry_run_prints_the_plan_and_exits_0(release):
    name, tmp = release
    args = [*ARGS, "--train-iters", "2", "--num-layers-per-virtual-pipeline-stage", "2",
            "--poseidon-auto", "--poseidon-dry-run", "--poseidon-emulate", EMULATE4,
            "--poseidon-backend", "mindspeed-llm", "--poseidon-max-virtual-stages", "2",
            "--poseidon-tp", "1", "--use-fused-rmsnorm", "--use-ascend-mc2"]
    proc, out, _ = launch(name, args, _env(tmp))
    assert proc.returncode == 0, ok(proc, out)
    assert ("emulation: MindSpeed's Ascend-only kernels are off (no NPU here): dropping "
            "--use-fused-rmsnorm --use-ascend-mc2") in out
    llm_tree = fw.MINDSPEED_LLM_RELEASES[name][0]
    assert f"adaptor mindspeed_llm.tasks.megatron_adaptor_v2 ({fw.tree(llm_tree)}" in out, out[-3000:]
    assert "Poseidon plan (mindspeed-llm)" in out
    assert "dry run: exiting before any model is built" in out
    flags = out.split("\nflags:\n", 1)[1].splitlines()[0]
    assert "--num-layers-per-virtual-pipeline-stage" not in flags
    assert "the plan overrides your" in out
    if name in fw.LAYOUT_RELEASES:
        assert "--pipeline-model-parallel-layout registered" in out
        # megatron-core 0.12.1's interleaved schedule frees outputs in flight: under the
        # emulation every send goes from a private copy, and interleaving stays in the search
        assert ("emulation: megatron-core 0.12.1's interleaved schedule frees a pipeline output "
                "before its isend has finished") in out, out[-3000:]
        assert "interleaved-1f1b excluded" not in out, out[-3000:]
        # the split is the layout (it numbers layers right), never --num-layer-list
        assert "--num-layer-list" not in flags, flags
        assert "--pipeline-model-parallel-layout" in flags \
            or "--pipeline-model-parallel-size 1" in flags, flags
    else:
        assert "--pipeline-model-parallel-layout not registered" in out
        assert "interleaved plans are not searched (V = 1)" in out
        assert "--pipeline-model-parallel-layout" not in flags, flags
    assert "lm loss" not in out
    script_line = out.split("\ncommand line the script runs with:\n", 1)[1].splitlines()[0]
    assert "--use-fused-rmsnorm" not in script_line and "--use-ascend-mc2" not in script_line


def test_training_reaches_lm_loss(release):
    name, tmp = release
    if name == "26.1.0":
        pytest.skip("v26.1.0 trains 8 iterations under plan A of tests/test_mindspeed_llm_resume.py")
    args = [*ARGS, "--train-iters", str(TRAIN_ITERS), "--poseidon-auto",
            "--poseidon-emulate", EMULATE4, "--poseidon-backend", "mindspeed-llm",
            "--poseidon-tp", "1"]
    proc, out, _ = launch(name, args, _env(tmp))
    assert proc.returncode == 0, ok(proc, out)
    losses = re.findall(r"iteration +(\d+)/ +\d+ \|.*?lm loss: ([0-9.E+-]+)", out)
    assert [int(i) for i, _ in losses] == list(range(1, TRAIN_ITERS + 1)), out[-4000:]
    assert all(0.0 < float(v) < 20.0 for _, v in losses), losses
    flags = out.split("\nflags:\n", 1)[1].splitlines()[0]
    pp = int(re.search(r"--pipeline-model-parallel-size (\d+)", flags).group(1))
    if pp > 1:  # MindSpeed-LLM took the plan's split: the layout where it registers it
        assert re.search(r"--pipeline-model-parallel-layout \S+" if name in fw.LAYOUT_RELEASES
                         else r"--num-layer-list [0-9,]+", flags), flags


EP_RELEASE = "26.1.0"


def test_expert_parallel_dry_run():
    """A MoE model with --expert-model-parallel-size 2 (megatron-core's alltoall dispatcher,
    no linear biases: MindSpeed's MoE refuses them) is planned, MindSpeed-LLM's own
    validate_args accepts the plan (rank 0 judges it), and the flags carry EP 2. One release
    (the cheap check; the EP flag path is the backend's, not the release's)."""
    reason = fw.mindspeed_llm_skip_reason(EP_RELEASE)
    if reason:
        pytest.skip(reason)
    from pathlib import Path
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="msllm-ep-"))
    args = [*ARGS, "--train-iters", "2", "--num-experts", "4", "--moe-router-topk", "2",
            "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall",
            "--disable-bias-linear", "--poseidon-auto", "--poseidon-dry-run",
            "--poseidon-emulate", EMULATE4, "--poseidon-backend", "mindspeed-llm",
            "--poseidon-tp", "1", "--poseidon-max-virtual-stages", "1"]
    proc, out, _ = launch(EP_RELEASE, args, _env(tmp))
    assert proc.returncode == 0, ok(proc, out)
    assert "Poseidon plan (mindspeed-llm)" in out and "lm loss" not in out
    flags = out.split("\nflags:\n", 1)[1].splitlines()[0].split()
    script = out.split("\ncommand line the script runs with:\n", 1)[1].splitlines()[0].split()
    from poseidon_plugin.megatron.launch.argv import flag_value

    assert flag_value(flags, "--expert-model-parallel-size") == "2", flags
    assert script.count("--expert-model-parallel-size") == 1
    assert flag_value(script, "--expert-model-parallel-size") == "2", script
    dp = int(re.search(r"Plan for .*?, dp=(\d+),", out).group(1))
    assert dp % 2 == 0, flags   # EP divides DP


# ------------------------------------------------------------------ MoE, interleaving (issue 36)

MOE_RELEASE = "26.1.0"
# a small mixed model as MindSpeed-LLM makes one: the first layer dense (--first-k-dense-replace),
# 3 MoE layers (4 experts, top-2, all-to-all), EP 2, an aux loss, one MTP layer (at pp > 1 the
# layout carries it as 'm', or megatron's TransformerConfig refuses it: "Number of mtp layers in
# layout must match mtp_num_layers")
MIXED = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 128 "
         "--seq-length 64 --max-position-embeddings 64 --micro-batch-size 1 "
         "--global-batch-size 8 --lr 2e-3 --lr-decay-style constant --mock-data "
         "--tokenizer-type NullTokenizer --vocab-size 4096 --log-interval 1 --eval-iters 0 "
         "--eval-interval 1000 --bf16 --num-workers 0 --seed 1234 --disable-bias-linear "
         "--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 64 "
         "--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall "
         "--moe-aux-loss-coeff 0.01 --position-embedding-type rope --mtp-num-layers 1").split()


def _moe_release(tag: str):
    reason = fw.mindspeed_llm_skip_reason(MOE_RELEASE)
    if reason:
        pytest.skip(reason)
    import tempfile
    from pathlib import Path

    return Path(tempfile.mkdtemp(prefix=f"msllm-{tag}-"))


def _losses(out: str) -> list[tuple[int, float]]:
    return [(int(i), float(v)) for i, v in
            re.findall(r"iteration +(\d+)/ +\d+ \|.*?lm loss: ([0-9.E+-]+|nan)", out)]


def test_mixed_moe_training_with_first_k_dense():
    """Issue 36 items 9, 10, 11 and build 6: MindSpeed-LLM v26.1.0's pretrain_gpt.py trains a
    first-k-dense MoE model with an aux loss and EP 2 under --poseidon-auto: the dense layer is
    profiled as MindSpeed-LLM builds it (it was refused: "layer 1 ... is a MoE layer, but the
    planner reads it as dense"), the aux-loss scale the profiling left no longer kills
    initialize_megatron, the split (if any) is the layout flag, and the built blocks match the
    plan (the check would stop the rank otherwise)."""
    tmp = _moe_release("mixed")
    args = [*MIXED, "--first-k-dense-replace", "1", "--train-iters", str(TRAIN_ITERS),
            "--poseidon-auto", "--poseidon-emulate", EMULATE4, "--poseidon-backend",
            "mindspeed-llm", "--poseidon-tp", "1", "--poseidon-max-virtual-stages", "1"]
    proc, out, _ = launch(MOE_RELEASE, args, _env(tmp))
    assert proc.returncode == 0, ok(proc, out)
    assert "doesn't match the broadcast shape" not in out and "not launching a model" not in out
    flags = out.split("\nflags:\n", 1)[1].splitlines()[0]
    assert "--num-layer-list" not in flags and "--expert-model-parallel-size 2" in flags, flags
    losses = _losses(out)
    assert [i for i, _ in losses] == list(range(1, TRAIN_ITERS + 1)), out[-4000:]
    assert all(0.0 < v < 20.0 for _, v in losses), losses


def test_a_moe_layer_freq_mindspeed_llm_ignores_is_one_line():
    """Issue 36 item 10: MindSpeed-LLM's pretrain_gpt.py builds every layer of a MoE model as
    MoE and reads --moe-layer-freq only with --first-k-dense-replace; the plan would have costed
    dense layers the training never builds. One line, exit 2, before any profiling."""
    tmp = _moe_release("freq")
    args = [*MIXED, "--moe-layer-freq", "[0]*1+[1]*3", "--train-iters", "2", "--poseidon-auto",
            "--poseidon-dry-run", "--poseidon-emulate", EMULATE4, "--poseidon-backend",
            "mindspeed-llm", "--poseidon-tp", "1"]
    proc, out, _ = launch(MOE_RELEASE, args, _env(tmp))
    assert proc.returncode != 0
    assert ("error: MindSpeed-LLM builds the layers as [1]*4 (1: MoE), not [0]+[1]*3 as the "
            "flags read") in out, out[-3000:]
    assert "] profiling: " not in out     # refused before any layer was profiled


def test_interleaved_training_on_megatron_core_0_12_1():
    """Issue 36 item 12: megatron-core 0.12.1's interleaved schedule frees outputs whose isend
    is in flight (NaN losses over gloo, plain MindSpeed-LLM alike); under the emulation every
    pipeline send goes from a private copy, and MindSpeed-LLM v26.1.0 trains an interleaved
    plan."""
    tmp = _moe_release("interleaved")
    gbs8 = with_value(ARGS, "--global-batch-size", "8")   # 8 micro-batches: shorter steps
    args = [*gbs8, "--train-iters", str(TRAIN_ITERS), "--poseidon-auto", "--poseidon-emulate",
            EMULATE4, "--poseidon-backend", "mindspeed-llm", "--poseidon-tp", "1",
            "--poseidon-schedules", "interleaved-1f1b", "--poseidon-max-virtual-stages", "2"]
    proc, out, _ = launch(MOE_RELEASE, args, _env(tmp))
    assert proc.returncode == 0, ok(proc, out)
    assert "emulation: megatron-core 0.12.1's interleaved schedule frees" in out, out[-3000:]
    flags = out.split("\nflags:\n", 1)[1].splitlines()[0]
    assert "--pipeline-model-parallel-layout" in flags and "|" in flags, flags
    losses = _losses(out)
    assert [i for i, _ in losses] == list(range(1, TRAIN_ITERS + 1)), out[-4000:]
    assert all(0.0 < v < 20.0 for _, v in losses), losses
