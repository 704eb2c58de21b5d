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
import re
import shutil

import pytest

import frameworks as fw
from test_launch_e2e import EMULATE4, free_port, ok, with_value
from test_mindspeed_llm_launch import ARGS as MSLLM_ARGS, MIXED, launch as msllm_launch
from test_resume_replan import (THREE, check_losses, check_swapped_at_tp_2, emulation, losses,
                                shape)
from straggler_run import (LINE, STATUS, check_dead_node_resume, check_restart,
                           dead_node_agent, run_dead_node, run_slowed)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RELEASE = "26.1.0"
ARGS = [*MSLLM_ARGS, "--hidden-dropout", "0", "--attention-dropout", "0",
        "--ckpt-format", "torch_dist", "--train-iters", "8", "--poseidon-auto",
        "--poseidon-backend", "mindspeed-llm", "--poseidon-tp", "1"]


def launch(work, nproc: int, emulate: str, extra: list[str], base: list[str] | None = None,
           tag: str = ""):
    """``nproc`` ranks of v26.1.0's pretrain_gpt.py: (process, log, plan); one profile cache
    (``tag``: another, for other types' speeds)."""
    plan_file = work / f"plan{tag}-{nproc}.json"
    env = {"POSEIDON_PROFILE_DIR": str(work / f"profiles{tag}"),
           "POSEIDON_HELPERS_CACHE": str(work / "megatron-helpers")}
    proc, out, took = msllm_launch(RELEASE, [*(base or ARGS), *extra, "--poseidon-emulate",
                                             emulate, "--poseidon-save-plan", str(plan_file)],
                                   env, nproc=nproc)
    print(f"{nproc} ranks: {took:.1f} s")
    plan = json.loads(plan_file.read_text()) if plan_file.exists() else None
    return proc, out, plan


@pytest.fixture(scope="module")
def plan_a(tmp_path_factory):
    """Plan A: 4 ranks, 8 iterations, saved at 4 (and at 8): (work folder, plan, losses)."""
    reason = fw.mindspeed_llm_skip_reason(RELEASE)
    if reason:
        pytest.skip(reason)
    work = tmp_path_factory.mktemp("msllm-resume")
    ckpt = work / "ckpt"
    proc, out, plan = launch(work, 4, EMULATE4, ["--save", str(ckpt), "--save-interval", "4"])
    assert proc.returncode == 0, ok(proc, out)
    reference = losses(out)
    assert sorted(reference) == list(range(1, 9)), out[-4000:]
    assert all(0.0 < v < 20.0 for v in reference.values()), reference
    flags = out.split("\nflags:\n", 1)[1].splitlines()[0]
    assert "--num-layer-list" not in flags, flags   # v26.1.0 takes the layout
    record = json.loads((ckpt / "iter_0000004" / "poseidon-plan.json").read_text())
    assert record["iteration"] == 4 and shape(record["plan"]) == shape(plan)
    # its plan and losses, and the profile cache as it was (the tests below change it)
    shutil.copytree(work / "profiles", work / "profiles-plan-a")
    return work, plan, reference


def test_saved_under_plan_a_resumes_on_three_ranks(plan_a):
    tmp_path, plan, reference = plan_a
    ckpt = tmp_path / "ckpt"

    three = emulation(tmp_path / "three.yaml", *THREE)   # one emu-slow removed
    proc, out, new = launch(tmp_path, 3, three, ["--load", str(ckpt), "--ckpt-step", "4"])
    assert proc.returncode == 0, ok(proc, out)
    assert shape(new) != shape(plan), (shape(new), shape(plan))
    (line,) = [ln for ln in out.splitlines() if "resume from iteration 4: " in ln]
    print(line)
    assert "lost 1 x emu-slow (host " in line and " ms predicted" in line, line
    check_losses(losses(out), reference, 5)


def test_resume_with_the_types_speeds_swapped_at_tp_2(plan_a):
    """The same 4 devices with the two types' speeds swapped, relaunched at TP 2 (plan A ran
    TP 1: megatron-core 0.12.1's distributed checkpoint reshards the weights and the optimizer
    state across the TP change under MindSpeed-LLM): the type now fast holds more layers, and
    iterations 5-8 match the uninterrupted run."""
    work, plan, reference = plan_a
    emu = emulation(work / "swapped.yaml", {"emu-fast": 0.25, "emu-slow": 1.0},
                    ["emu-slow", "emu-slow", "emu-fast", "emu-fast"])
    proc, out, new = launch(work, 4, emu, ["--load", str(work / "ckpt"), "--ckpt-step", "4"],
                            base=with_value(ARGS, "--poseidon-tp", "2"), tag="-swap")
    assert proc.returncode == 0, ok(proc, out)
    check_swapped_at_tp_2(plan, new, out)
    check_losses(losses(out), reference, 5)


# the small MoE of test_mindspeed_llm_launch.py (4 MoE layers as MindSpeed-LLM builds them: no
# --first-k-dense-replace, whose dense layers its torch_dist save cannot write, refused at launch;
# MTP, aux loss), its embeddings untied: megatron-core cannot save an MTP model with tied
# embeddings at pp > 1 (the search plans pp = 1 only then: search/rules.py), and 3 ranks at
# pp = 1 cannot split the global batch of 8
MOE = [*MIXED, "--untie-embeddings-and-output-weights", "--hidden-dropout", "0",
       "--attention-dropout", "0", "--ckpt-format", "torch_dist", "--train-iters", "8",
       "--poseidon-auto", "--poseidon-backend", "mindspeed-llm", "--poseidon-tp", "1",
       "--poseidon-max-virtual-stages", "1"]


def test_moe_saved_at_ep_2_resumes_at_ep_1_on_three_ranks(plan_a):
    """Issue 37 item 2's MoE on MindSpeed-LLM: v26.1.0's pretrain_gpt.py trains the MoE (EP 2,
    MTP, aux loss) on 4 ranks and saves at 4 (its own --exit-interval 4 stops it there: CI
    time). Megatron cannot load EP 2's expert optimizer into EP 1's single one (the launch
    refuses that in one line, tests/test_resume_replan.py), so both relaunches start the
    optimizer afresh (--no-load-optim): on the same 4 devices at EP 2 (plan A's plan again, the
    reference) and on 3 ranks at EP 1, where megatron-core 0.12.1's distributed checkpoint
    reshards the experts' weights from EP 2 to EP 1 across the new pipeline under MindSpeed-LLM.
    Iterations 5-8 of the two match within 1 % (iteration 5, a forward pass of the loaded
    weights, is the uninterrupted run's own)."""
    work = plan_a[0] / "moe"
    work.mkdir()
    (work / "megatron-helpers").symlink_to(plan_a[0] / "megatron-helpers")   # built once
    ckpt = work / "ckpt"
    proc, out, plan = launch(work, 4, EMULATE4, ["--save", str(ckpt), "--save-interval", "4",
                                                 "--exit-interval", "4"], base=MOE)
    assert proc.returncode == 0, ok(proc, out)
    flags = out.split("\nflags:\n", 1)[1].splitlines()[0]
    assert "--expert-model-parallel-size 2" in flags, flags
    first = losses(out)
    assert sorted(first) == [1, 2, 3, 4] and plan["ep"] == 2, out[-4000:]
    assert all(0.0 < v < 20.0 for v in first.values()), first

    load = ["--load", str(ckpt), "--ckpt-step", "4", "--no-load-optim"]
    proc, out, same = launch(work, 4, EMULATE4, load, base=MOE)
    assert proc.returncode == 0, ok(proc, out)
    assert shape(same) == shape(plan), (shape(same), shape(plan))
    reference = losses(out)

    three = emulation(work / "three.yaml", *THREE)
    proc, out, new = launch(work, 3, three, load,
                            base=with_value(MOE, "--expert-model-parallel-size", "1"))
    assert proc.returncode == 0, ok(proc, out)
    assert new["ep"] == 1 and shape(new) != shape(plan), (shape(new), shape(plan))
    (line,) = [ln for ln in out.splitlines() if "resume from iteration 4: " in ln]
    print(line)
    assert "lost 1 x emu-slow (host " in line and "ep=2" in line, line
    check_losses(losses(out), reference, 5)


def test_a_straggler_restarts_under_torchrun_and_resumes_under_the_measured_speed(plan_a):
    """Issue 37 items 2 and 3 on MindSpeed-LLM: plan A's launch again (its profile cache, and
    its plan kept), one emu-fast device slowed 6x after iteration 2; rank 0 names it, MindSpeed-LLM's
    own loop saves at that iteration (``exit_interval``) and every rank exits with 75;
    torchrun's restart (``--max-restarts 1``) plans with the measured speed -- another plan,
    the types' speeds changed -- loads the checkpoint and trains to 8, its losses within 1 %
    of plan A's uninterrupted run."""
    work, plan, reference = plan_a
    run = work / "straggler"
    run.mkdir()
    shutil.copytree(work / "profiles-plan-a", run / "profiles")
    slow_file, ckpt = run / "slowdown", run / "ckpt"
    plan_file = run / "plan.json"
    cmd = [fw.msllm_python(), "-m", "torch.distributed.run", "--nproc-per-node", "4",
           "--max-restarts", "1", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           "--no-python", "bash", "-c", STATUS, fw.msllm_python(), fw.script(RELEASE), *ARGS,
           "--poseidon-emulate", EMULATE4, "--poseidon-save-plan", str(plan_file),
           "--poseidon-straggler-pct", "200", "--poseidon-straggler-iters", "2",
           "--poseidon-replan-on-straggler", "--save", str(ckpt), "--load", str(ckpt),
           "--save-interval", "100", "--poseidon-keep-plan-within", "10"]
    env = fw.mindspeed_llm_env(RELEASE, {
        "POSEIDON_PROFILE_DIR": str(run / "profiles"),
        "POSEIDON_HELPERS_CACHE": str(work / "megatron-helpers"),
        "POSEIDON_EMULATE_SLOWDOWN_FILE": str(slow_file)})
    rc, out = run_slowed(cmd, env, slow_file, 8, "3 6", timeout=900, cwd=fw.ROOT)
    found = list(LINE.finditer(out))
    assert len(found) == 1, out[-6000:]          # named once; the relaunch's plan fits it
    it, rank, launch_rank, dtype, _, measured, planned = found[0].groups()
    # the slowed device first (slowest first); its DP partner on the last stage may follow:
    # MindSpeed-LLM's loss_func all-reduces each micro-batch's loss over the DP group inside
    # forward_step, so the partner's measured compute includes its wait
    assert (launch_rank or rank) == "3" and dtype == "emu-fast", found[0].group(0)
    assert float(measured) > 3 * float(planned)
    it = int(it)
    assert 4 <= it < 8                           # slowed after 2, named after K=2 slow ones
    relaunch = check_restart(out, it, 4, 8)
    assert rc == 0, out[-6000:]
    # the first group trained plan A (plan A's calibration moved the costs a little: the 10 %
    # window keeps its plan, so iterations 1..it are plan A's), the relaunch another plan
    first = out.partition(f"checkpoint at iteration {it}, then every rank exits")[0]
    assert re.search(r"the previous launch's plan \(.*\) is .* ms: kept \(window 10%", first), \
        first[-6000:]
    new = json.loads(plan_file.read_text())      # the relaunch's (it overwrote plan A's)
    assert shape(new) != shape(plan), (shape(new), shape(plan))
    # the first group logs iteration `it` after the straggler line: the relaunch's own losses
    check_losses(losses(relaunch.partition(f"resume from iteration {it}: ")[2]), reference,
                 it + 1)


def test_a_dead_node_is_replanned_around_and_the_job_resumes(plan_a):
    """Issue 37 item 4 on MindSpeed-LLM: plan A's launch again on two torchrun agents standing
    for two nodes (2 ranks each; its profile cache, its plan kept), saving every 2 iterations;
    once MindSpeed-LLM has saved at 2 the second node (agent and ranks) is killed, the first
    agent restarts its ranks with the one node left, and the relaunch plans for its 2 devices
    (one line saying what was lost), loads the last checkpoint and trains to 4 (its own loop's
    ``--exit-interval 4``, status 0: CI time; ``--train-iters`` stays plan A's), its losses
    within 1 % of plan A's uninterrupted run; the agent exits 0."""
    work, plan, reference = plan_a
    assert plan["pp"] * plan["tp"] * plan["dp"] == 4, plan   # every device used (else the
    # unused node's ranks exit 0 and nothing is restarted)
    run = work / "dead-node"
    run.mkdir()
    shutil.copytree(work / "profiles-plan-a", run / "profiles")
    ckpt = run / "ckpt"
    # plan A's types and speeds, the fast pair first: the relaunch's ranks 0, 1 (the node
    # left) are the fast pair, the slow pair is the one lost (CI time)
    emu = emulation(run / "emu.yaml", {"emu-fast": 1.0, "emu-slow": 0.25},
                    ["emu-fast", "emu-fast", "emu-slow", "emu-slow"])
    # window 20 % (the most the flag takes): plan A's first launch plans on uncalibrated costs,
    # and its calibration once put plan A's plan 23.5 % over the fastest, so the first group may
    # re-plan; the losses match across plans within 1 % all the same (the resume tests)
    script = [fw.script(RELEASE), *ARGS, "--poseidon-emulate", emu,
              "--poseidon-keep-plan-within", "20", "--save", str(ckpt), "--load", str(ckpt),
              "--save-interval", "2", "--exit-interval", "4"]
    env = fw.mindspeed_llm_env(RELEASE, {
        "POSEIDON_PROFILE_DIR": str(run / "profiles"),
        "POSEIDON_HELPERS_CACHE": str(work / "megatron-helpers"), "POSEIDON_STRAGGLER": "0"})
    rc, out, node_b = run_dead_node(
        lambda port: dead_node_agent(fw.msllm_python(), port, script), env, run, cwd=fw.ROOT,
        record=ckpt / "iter_0000002" / "poseidon-plan.json")
    assert re.search(r"the previous launch's plan \(.*\) is .* ms: (kept|replaced) \(window 20%",
                     out + node_b), out[-6000:]      # the first group planned from plan A's cache
    it, relaunch = check_dead_node_resume(out, 2, 8, lost="2 x emu-slow", until=4)
    assert rc == 0, out[-6000:]
    check_losses(losses(relaunch), reference, it + 1, 4)
