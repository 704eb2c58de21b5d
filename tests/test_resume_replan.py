"""When the cluster changes, the job goes on (issue 37): Megatron-LM core_v0.19.0's own
``pretrain_gpt.py`` (the unchanged tree in ``../shared/frameworks``), under the launcher and the
CPU emulation, trained under plan A with ``--save --ckpt-format torch_dist`` and resumed under
other plans on other devices.

* plan A: 4 ranks of two emulated types (examples/emulate-2types.yaml), 8 iterations, saved at
  iteration 4 (``--save-interval 4``): its iterations 5-8 are the uninterrupted run;
* relaunched from iteration 4 (``--load --ckpt-step 4``) on 3 ranks (one slow device removed)
  and on 4 ranks with the two types' speeds swapped and TP 2 (plan A runs TP 1): each time a
  different plan, one line saying what changed, and the losses of iterations 5-8 within 1 % of
  plan A's;
* a MoE (8 experts) saved at EP 2 on 4 ranks, relaunched at EP 1 on 3: Megatron cannot load
  EP 2's optimizer state at EP 1 (one error line naming the fix); with ``--no-load-optim`` the
  experts' weights are resharded and iterations 5-8 match the same relaunch at EP 2 on plan A's
  devices (its optimizer afresh too);
* one shard removed from a copy of the checkpoint: the relaunch (a dry run) ends with one error
  naming it, before any model is built.

Dropout is off (``--hidden-dropout 0 --attention-dropout 0``): Megatron does not reshard the RNG
state across a TP / PP change (the launch says so), so with dropout the masks, not the model,
would differ from the uninterrupted run. Run by ``make test-mcore-versions`` (its side
environment; megatron-core's checkpoint writer needs ``psutil`` there), skipped elsewhere.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import subprocess
import time

import pytest

import frameworks as fw
from test_launch_e2e import EMULATE4, GPT_ARGS, free_port, ok, with_value
from test_megatron_lm_tree_launch import PYTHON, TREE, skip_reason
from test_moe_ep_launch import EP_ARGS
from straggler_run import (LINE, STATUS, check_dead_node_resume, check_restart,
                           dead_node_agent, run_dead_node, run_slowed)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RUN = ["--hidden-dropout", "0", "--attention-dropout", "0", "--ckpt-format", "torch_dist",
       "--train-iters", "8", "--poseidon-tp", "1"]   # TP 1 only: less profiling (CI time)
ARGS = [*GPT_ARGS, *RUN]


def moe_args(ep: int) -> list[str]:
    """The tiny MoE of tests/test_moe_ep_launch.py (2 dense + 6 MoE layers, 8 experts, top-2)
    at the script's ``--expert-model-parallel-size ep`` (kept by the launch)."""
    i = EP_ARGS.index("--expert-model-parallel-size")
    return [*EP_ARGS[:i + 1], str(ep), *EP_ARGS[i + 2:], *RUN]


# one slow device removed
THREE = ({"emu-fast": 1.0, "emu-slow": 0.25}, ["emu-slow", "emu-fast", "emu-fast"])
LOSS = re.compile(r"iteration +(\d+)/ +\d+ \|.*?lm loss: ([0-9.E+-]+)")


def _skip() -> str | None:
    reason = skip_reason()
    if reason:
        return reason
    has = subprocess.run([PYTHON, "-c", "import psutil"], capture_output=True)
    if has.returncode != 0:
        return (f"{PYTHON} has no psutil (megatron-core's torch_dist writer needs it; make venv "
                "installs it)")
    return None


def emulation(path, speeds: dict[str, float], ranks: list[str]) -> str:
    path.write_text("device_types:\n" + "".join(
        f"  {t}: {{speed: {s}, memory_gib: 16}}\n" for t, s in speeds.items())
        + f"ranks: [{', '.join(ranks)}]\n")
    return str(path)


def launch(work, nproc: int, emulate: str, extra: list[str], tag: str,
           base: list[str] | None = None):
    """``nproc`` ranks of the tree's pretrain_gpt.py under the launcher: (process, log, plan).
    ``tag`` names the profile cache (the types' speeds the same: the same cache)."""
    plan_file = work / f"plan-{tag}-{nproc}.json"
    cmd = [PYTHON, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           "-m", "poseidon_plugin.launch", os.path.join(TREE, "pretrain_gpt.py"),
           *(base or ARGS), *extra,
           "--poseidon-auto", "--poseidon-emulate", emulate,
           "--poseidon-save-plan", str(plan_file)]
    env = {**os.environ, "PYTHONPATH": fw.ROOT, "OMP_NUM_THREADS": "1",
           "PYTHONWARNINGS": "ignore", "POSEIDON_PROFILE_DIR": str(work / f"profiles-{tag}"),
           "POSEIDON_HELPERS_CACHE": str(work / "megatron-helpers")}
    t0, cpu0 = time.monotonic(), _children_cpu_s()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=fw.ROOT)
    out = proc.stdout + proc.stderr
    print(f"{tag} on {nproc} ranks: {time.monotonic() - t0:.1f} s, "
          f"{_children_cpu_s() - cpu0:.1f} CPU-s")
    plan = json.loads(plan_file.read_text()) if plan_file.exists() else None
    return proc, out, plan


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def losses(out: str) -> dict[int, float]:
    return {int(i): float(v) for i, v in LOSS.findall(out)}


def shape(plan: dict) -> tuple:
    """What makes two plans different layouts of the model on the devices."""
    return (plan["schedule"], plan["pp"], plan["tp"], plan["dp"], plan.get("ep", 1),
            tuple(s["layers"] for s in plan["stages"]),
            tuple(s["device_type"] for s in plan["stages"]))


@pytest.fixture(scope="module")
def plan_a(tmp_path_factory):
    """Plan A: 4 ranks, 8 iterations, saved at 4 (and at 8, the end)."""
    reason = _skip()
    if reason:
        pytest.skip(reason)
    work = tmp_path_factory.mktemp("resume-replan")
    ckpt = work / "ckpt"
    proc, out, plan = launch(work, 4, EMULATE4, ["--save", str(ckpt), "--save-interval", "4"],
                             "a")
    assert proc.returncode == 0, ok(proc, out)
    got = losses(out)
    assert sorted(got) == list(range(1, 9)), out[-4000:]
    shutil.copytree(work / "profiles-a", work / "profiles-plan-a")   # as plan A left it
    return work, ckpt, plan, got


def check_resumed(out: str, reference: dict[int, float], start: int = 4, end: int = 8) -> None:
    """Training went on from iteration ``start`` + 1 to ``end``, matching the uninterrupted run.

    Megatron logs a launch's first iteration without resetting its loss accumulators (its
    ``training_log``: ``should_reset = not is_first_iteration``), so a resumed launch's second
    log is the mean of its first two iterations: the uninterrupted run's losses are compared
    as a resumed launch logs them."""
    got = losses(out)
    span = list(range(start + 1, end + 1))
    assert sorted(got) == span, out[-4000:]
    want = dict(reference)
    if len(span) > 1:
        want[start + 2] = (reference[start + 1] + reference[start + 2]) / 2
    print(f"lm loss {start + 1}-{end}: resumed " + ", ".join(f"{got[i]:.6f}" for i in span)
          + "; uninterrupted " + ", ".join(f"{reference[i]:.6f}" for i in span))
    for it in span:
        assert abs(got[it] - want[it]) <= 0.01 * want[it], (it, got, want)


def check_losses(got: dict[int, float], reference: dict[int, float], first: int,
                 last: int = 8) -> None:
    """Iterations ``first``..``last`` logged, each within 1 % of ``reference``'s: logged alike
    (MindSpeed-LLM's loop logs each iteration's own loss; two resumed megatron-core launches
    both log their second iteration as the mean of their first two, see check_resumed)."""
    span = range(first, last + 1)
    print(f"lm loss {first}-{last}: resumed " + ", ".join(f"{got.get(i, float('nan')):.6f}"
                                                          for i in span)
          + "; uninterrupted " + ", ".join(f"{reference[i]:.6f}" for i in span))
    assert sorted(got) == list(span), got
    for i in span:
        assert abs(got[i] - reference[i]) <= 0.01 * reference[i], (i, got, reference)


def test_save_records_the_plan_and_its_devices(plan_a):
    _, ckpt, plan, _ = plan_a
    record = json.loads((ckpt / "iter_0000004" / "poseidon-plan.json").read_text())
    assert record["iteration"] == 4 and shape(record["plan"]) == shape(plan)
    assert sorted((d["device_type"], d["count"]) for d in record["devices"]) == \
        [("emu-fast", 2), ("emu-slow", 2)]
    saved = sorted(n for n in os.listdir(ckpt / "iter_0000004") if n.endswith(".distcp"))
    assert saved and all(record["files"][n]["bytes"] > 0 for n in saved)


def test_resume_on_three_ranks_after_losing_one(plan_a, tmp_path):
    work, ckpt, plan, reference = plan_a
    emu = emulation(tmp_path / "three.yaml", *THREE)
    proc, out, new = launch(work, 3, emu, ["--load", str(ckpt), "--ckpt-step", "4"], "a")
    assert proc.returncode == 0, ok(proc, out)
    assert shape(new) != shape(plan), (shape(new), shape(plan))
    (line,) = [ln for ln in out.splitlines() if "resume from iteration 4: " in ln]
    print(line)
    assert "lost 1 x emu-slow (host " in line and " ms predicted" in line, line
    check_resumed(out, reference)


def test_resume_with_the_types_speeds_swapped_at_tp_2(plan_a, tmp_path):
    """The same 4 devices with the two types' speeds swapped, relaunched at TP 2 (plan A ran
    TP 1: Megatron reshards the weights and the optimizer state across the TP change): the
    type now fast holds more layers, and iterations 5-8 match the uninterrupted run."""
    work, ckpt, plan, reference = plan_a
    emu = emulation(tmp_path / "swapped.yaml", {"emu-fast": 0.25, "emu-slow": 1.0},
                    ["emu-slow", "emu-slow", "emu-fast", "emu-fast"])
    proc, out, new = launch(work, 4, emu, ["--load", str(ckpt), "--ckpt-step", "4"], "swap",
                            base=with_value(ARGS, "--poseidon-tp", "2"))
    assert proc.returncode == 0, ok(proc, out)
    check_swapped_at_tp_2(plan, new, out)
    check_resumed(out, reference)


def check_swapped_at_tp_2(plan: dict, new: dict, out: str) -> None:
    """The relaunch with the types' speeds swapped runs TP 2 where plan A ran TP 1, gives the
    type now fast (emu-slow) no fewer layers and says what changed on the same devices."""
    assert (plan["tp"], new["tp"]) == (1, 2), (shape(plan), shape(new))
    layers = {t: sum(s["layers"] for s in new["stages"] if s["device_type"] == t)
              for t in ("emu-fast", "emu-slow")}
    # emu-slow is now the fast one: it never holds fewer layers (an even split happens: at TP 2
    # the last stage's output layer weighs as much as layers; MindSpeed-LLM's CI run, 4 / 4)
    assert layers["emu-slow"] >= layers["emu-fast"], new["stages"]
    (line,) = [ln for ln in out.splitlines() if "resume from iteration 4: " in ln]
    print(line)
    assert "the same devices; plan " in line and "tp=1" in line and "tp=2" in line, line


def test_moe_saved_at_ep_2_resumes_at_ep_1_on_three_ranks(plan_a, tmp_path):
    """A MoE job saved at EP 2 on 4 ranks (Megatron's --exit-interval 4 stops it at the save:
    CI time), relaunched on 3 at EP 1. Megatron cannot load EP 2's optimizer state at EP 1
    (expert parameters in an optimizer of their own at EP > 1): the launch refuses it in one
    line naming the fix. With --no-load-optim the experts' weights are resharded from EP 2 to
    EP 1 and training goes on; iterations 5-8 match those of the same relaunch on plan A's
    4 devices at EP 2, its optimizer started afresh too (iteration 5, a forward pass of the
    loaded weights, is the uninterrupted run's own)."""
    work = plan_a[0]
    ckpt = work / "moe-ckpt"
    proc, out, plan = launch(work, 4, EMULATE4, ["--save", str(ckpt), "--save-interval", "4",
                                                 "--exit-interval", "4"], "moe", base=moe_args(2))
    assert proc.returncode == 0, ok(proc, out)
    assert sorted(losses(out)) == [1, 2, 3, 4] and plan["ep"] == 2, out[-4000:]
    emu = emulation(tmp_path / "three.yaml", *THREE)
    load = ["--load", str(ckpt), "--ckpt-step", "4"]
    proc, out, _ = launch(work, 3, emu, [*load, "--poseidon-dry-run"], "moe", base=moe_args(1))
    assert proc.returncode != 0
    (error,) = [ln for ln in out.splitlines() if "[poseidon rank 0] error:" in ln]
    assert "saved at EP 2 and this plan runs EP 1" in error and "--no-load-optim" in error, error
    proc, out, same = launch(work, 4, EMULATE4, [*load, "--no-load-optim"], "moe",
                             base=moe_args(2))
    assert proc.returncode == 0, ok(proc, out)
    assert shape(same) == shape(plan), (shape(same), shape(plan))
    reference = losses(out)
    proc, out, new = launch(work, 3, emu, [*load, "--no-load-optim"], "moe", base=moe_args(1))
    assert proc.returncode == 0, ok(proc, out)
    assert new["ep"] == 1 and shape(new) != shape(plan), (shape(new), shape(plan))
    (line,) = [ln for ln in out.splitlines() if "resume from iteration 4: " in ln]
    print(line)
    assert "lost 1 x emu-slow (host " in line and "ep=2" in line, line
    assert sorted(reference) == [5, 6, 7, 8], reference
    # both are resumed launches: Megatron logs their iteration 6 alike (the mean of 5 and 6)
    check_losses(losses(out), reference, 5)


def test_a_removed_shard_is_one_error_naming_it(plan_a, tmp_path):
    work, ckpt, _, _ = plan_a
    copy = tmp_path / "ckpt"
    shutil.copytree(ckpt / "iter_0000004", copy / "iter_0000004")
    (copy / "latest_checkpointed_iteration.txt").write_text("4")
    (copy / "iter_0000004" / "__1_0.distcp").unlink()
    proc, out, _ = launch(work, 4, EMULATE4, ["--load", str(copy), "--poseidon-dry-run"], "a")
    assert proc.returncode != 0
    errors = [ln for ln in out.splitlines() if "[poseidon rank 0] error:" in ln]
    assert errors == [f"[poseidon rank 0] error: --load {copy}/iter_0000004: shard "
                      "__1_0.distcp is missing (the checkpoint's .metadata lists it)"], out[-3000:]
    # torchrun's own agent prints a traceback for any child exiting non-zero; no rank does
    assert not re.search(r"^\[rank\d+\]: Traceback", out, re.M), out[-3000:]
    assert "building GPT model" not in out


def test_a_straggler_restarts_under_torchrun_and_resumes_under_the_measured_speed(plan_a):
    """Issue 37 item 3 on the tree's own script: plan A's launch again under torchrun's
    ``--max-restarts 1`` (its profile cache, its plan kept), one emu-fast device slowed 6x after
    iteration 2 (the emulation's live slowdown file); rank 0 names it, Megatron saves at that
    iteration (``exit_interval``), every rank exits with 75, torchrun relaunches the group, the
    relaunch plans with the measured speed rank 0 wrote into the profile cache (another plan:
    the device stays slow), loads the checkpoint and trains to 8, its losses within 1 % of
    plan A's uninterrupted run; no straggler is named in the relaunch."""
    work, _, plan, reference = plan_a
    run = work / "straggler"
    run.mkdir()
    shutil.copytree(work / "profiles-plan-a", run / "profiles")
    slow_file, ckpt, plan_file = run / "slowdown", run / "ckpt", run / "plan.json"
    cmd = [PYTHON, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--max-restarts",
           "1", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           "--no-python", "bash", "-c", STATUS, PYTHON, os.path.join(TREE, "pretrain_gpt.py"),
           *ARGS, "--poseidon-auto", "--poseidon-emulate", EMULATE4,
           "--poseidon-save-plan", str(plan_file), "--poseidon-keep-plan-within", "10",
           "--poseidon-straggler-pct", "200", "--poseidon-straggler-iters", "2",
           "--poseidon-replan-on-straggler", "--save", str(ckpt), "--load", str(ckpt),
           "--save-interval", "100"]
    env = {**os.environ, "PYTHONPATH": fw.ROOT, "OMP_NUM_THREADS": "1",
           "PYTHONWARNINGS": "ignore", "POSEIDON_PROFILE_DIR": str(run / "profiles"),
           "POSEIDON_HELPERS_CACHE": str(work / "megatron-helpers"),
           "POSEIDON_EMULATE_SLOWDOWN_FILE": str(slow_file)}
    rc, out = run_slowed(cmd, env, slow_file, 8, "3 6", cwd=fw.ROOT)
    found = list(LINE.finditer(out))
    assert len(found) == 1, out[-6000:]          # named once; the relaunch's plan fits it
    it, rank, launch_rank, dtype, _, measured, planned = found[0].groups()
    assert (launch_rank or rank) == "3" and dtype == "emu-fast", found[0].group(0)
    assert float(measured) > 3 * float(planned)
    it = int(it)
    assert 4 <= it < 8                           # slowed after 2, named after K=2 slow ones
    relaunch = check_restart(out, it, 4, 8)
    assert rc == 0, out[-6000:]
    # the first group trained plan A (plan A's calibration moved the costs a little: the 10 %
    # window keeps its plan, so iterations 1..it are plan A's); the relaunch another plan
    first = out.partition(f"checkpoint at iteration {it}, then every rank exits")[0]
    assert re.search(r"the previous launch's plan \(.*\) is .* ms: kept \(window 10%", first), \
        first[-6000:]
    new = json.loads(plan_file.read_text())      # the relaunch's (it overwrote the first's)
    assert shape(new) != shape(plan), (shape(new), shape(plan))
    check_resumed(relaunch.partition(f"resume from iteration {it}: ")[2], reference, it)


def test_a_dead_node_is_replanned_around_and_the_job_resumes(plan_a):
    """Issue 37 item 4 on the tree's own script: plan A's launch again on two torchrun agents
    standing for two nodes (2 ranks each; plan A's profile cache, its plan kept), saving every 2
    iterations. Once Megatron has saved at 2 the second node (its agent and its ranks) is
    killed; the first node's ranks fail on their next collective, its agent restarts them in a
    new rendezvous with the one node left, and the relaunch discovers 2 devices, plans for them
    (one line saying what was lost), loads the last checkpoint and trains to 4
    (``--exit-interval 4``, Megatron's own early exit, status 0: CI time; ``--train-iters``
    stays plan A's, so the data are), its losses within 1 % of plan A's uninterrupted run; the
    agent exits 0."""
    work, _, plan, reference = plan_a
    assert plan["pp"] * plan["tp"] * plan["dp"] == 4, plan   # every device used: a node's
    # ranks left out of the plan exit 0, and nothing would be left to restart
    run = work / "dead-node"
    run.mkdir()
    shutil.copytree(work / "profiles-plan-a", run / "profiles")
    ckpt = run / "ckpt"
    # plan A's two types and speeds (its profiles, its plan), the fast pair on launch ranks 0, 1:
    # the relaunch's ranks 0, 1 are the node left, so the slow pair is the one lost (the
    # relaunch trains on the fast pair: CI time)
    emu = emulation(run / "emu.yaml", {"emu-fast": 1.0, "emu-slow": 0.25},
                    ["emu-fast", "emu-fast", "emu-slow", "emu-slow"])
    # window 20 % (the most the flag takes): plan A's first launch plans on uncalibrated costs,
    # and its calibration once put plan A's plan 23.5 % over the fastest, so the first group may
    # re-plan; the losses match across plans within 1 % all the same (the resume tests)
    script = [os.path.join(TREE, "pretrain_gpt.py"), *ARGS, "--poseidon-auto",
              "--poseidon-emulate", emu, "--poseidon-keep-plan-within", "20",
              "--save", str(ckpt), "--load", str(ckpt), "--save-interval", "2",
              "--exit-interval", "4"]
    env = {**os.environ, "PYTHONPATH": fw.ROOT, "OMP_NUM_THREADS": "1",
           "PYTHONWARNINGS": "ignore", "POSEIDON_PROFILE_DIR": str(run / "profiles"),
           "POSEIDON_HELPERS_CACHE": str(work / "megatron-helpers"), "POSEIDON_STRAGGLER": "0"}
    rc, out, node_b = run_dead_node(lambda port: dead_node_agent(PYTHON, port, script), env,
                                    run, cwd=fw.ROOT,
                                    record=ckpt / "iter_0000002" / "poseidon-plan.json")
    # the first group planned from plan A's cache (its rank 0 on either node)
    assert re.search(r"the previous launch's plan \(.*\) is .* ms: (kept|replaced) \(window 20%",
                     out + node_b), out[-6000:]
    it, relaunch = check_dead_node_resume(out, 2, 8, lost="2 x emu-slow", until=4)
    assert rc == 0, out[-6000:]
    check_resumed(relaunch, reference, it, end=4)
