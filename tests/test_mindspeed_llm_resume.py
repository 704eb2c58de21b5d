"""When the cluster changes, a MindSpeed-LLM job goes on (issue 37): MindSpeed-LLM v26.1.0's own
``pretrain_gpt.py`` (the unchanged tree, Megatron-LM core_v0.12.1, NPU libraries from
tests/npu_fakes) under the launcher and the CPU emulation, trained under plan A on 4 ranks of
two emulated types with ``--save --ckpt-format torch_dist`` (8 iterations, saved at 4), then
relaunched from iteration 4 on 3 ranks (one slow device removed): another plan, one line saying
what changed, and the losses of iterations 5-8 within 1 % of plan A's.

Two things stopped this before: MindSpeed-LLM *spawns* the checkpoint writer (a fresh
interpreter, so the launch's binding of torch's ``serialization_format`` has to travel with the
save function: ``resume._BoundInWriterProcess``), and megatron-core 0.12.1 ends a load across a
PP change with ``sys.exit()`` (status 0, no training) unless ``--no-load-rng`` is given, which
the launch adds (``resume.rng_flag``). Plan A's training also stands for v26.1.0's plain
training run (``test_mindspeed_llm_launch.py::test_training_reaches_lm_loss`` runs v2.3.0).
"""

from __future__ import annotations

import json

import pytest

import frameworks as fw
from test_launch_e2e import EMULATE4, ok
from test_mindspeed_llm_launch import ARGS as MSLLM_ARGS, launch as msllm_launch
from test_resume_replan import THREE, emulation, losses, shape

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RELEASE = "26.1.0"
ARGS = [*MSLLM_ARGS, "--hidden-dropout", "0", "--attention-dropout", "0",
        "--ckpt-format", "torch_dist", "--train-iters", "8", "--poseidon-auto",
        "--poseidon-backend", "mindspeed-llm", "--poseidon-tp", "1"]


def launch(work, nproc: int, emulate: str, extra: list[str]):
    """``nproc`` ranks of v26.1.0's pretrain_gpt.py: (process, log, plan); one profile cache."""
    plan_file = work / f"plan-{nproc}.json"
    env = {"POSEIDON_PROFILE_DIR": str(work / "profiles"),
           "POSEIDON_HELPERS_CACHE": str(work / "megatron-helpers")}
    proc, out, took = msllm_launch(RELEASE, [*ARGS, *extra, "--poseidon-emulate", emulate,
                                             "--poseidon-save-plan", str(plan_file)],
                                   env, nproc=nproc)
    print(f"{nproc} ranks: {took:.1f} s")
    plan = json.loads(plan_file.read_text()) if plan_file.exists() else None
    return proc, out, plan


def test_saved_under_plan_a_resumes_on_three_ranks(tmp_path):
    reason = fw.mindspeed_llm_skip_reason(RELEASE)
    if reason:
        pytest.skip(reason)
    ckpt = tmp_path / "ckpt"
    proc, out, plan = launch(tmp_path, 4, EMULATE4, ["--save", str(ckpt), "--save-interval", "4"])
    assert proc.returncode == 0, ok(proc, out)
    reference = losses(out)
    assert sorted(reference) == list(range(1, 9)), out[-4000:]
    assert all(0.0 < v < 20.0 for v in reference.values()), reference
    flags = out.split("\nflags:\n", 1)[1].splitlines()[0]
    assert "--num-layer-list" not in flags, flags   # v26.1.0 takes the layout
    record = json.loads((ckpt / "iter_0000004" / "poseidon-plan.json").read_text())
    assert record["iteration"] == 4 and shape(record["plan"]) == shape(plan)

    three = emulation(tmp_path / "three.yaml", *THREE)   # one emu-slow removed
    proc, out, new = launch(tmp_path, 3, three, ["--load", str(ckpt), "--ckpt-step", "4"])
    assert proc.returncode == 0, ok(proc, out)
    assert shape(new) != shape(plan), (shape(new), shape(plan))
    (line,) = [ln for ln in out.splitlines() if "resume from iteration 4: " in ln]
    print(line)
    assert "lost 1 x emu-slow (host " in line and " ms predicted" in line, line
    got = losses(out)
    # MindSpeed-LLM's training loop logs each iteration's own loss (no mean over the first two)
    print("lm loss 5-8: resumed " + ", ".join(f"{got.get(i, float('nan')):.6f}"
                                              for i in range(5, 9))
          + "; uninterrupted " + ", ".join(f"{reference[i]:.6f}" for i in range(5, 9)))
    assert sorted(got) == [5, 6, 7, 8], out[-4000:]
    for it in range(5, 9):
        assert abs(got[it] - reference[it]) <= 0.01 * reference[it], (it, got, reference)
