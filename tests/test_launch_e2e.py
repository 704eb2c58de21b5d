"""End-to-end: torchrun on CPU, two emulated device types, examples/pretrain_gpt.py with --poseidon-auto.

Real Megatron all the way: megatron.training's argument parsing and validation and its
``pretrain()`` train a tiny GPT on mock data; Poseidon profiles, plans, renumbers ranks and rewrites
the arguments before any of that runs. Budget on a 2-core CI box: about 1.5 minutes for the file.
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
import socket
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "pretrain_gpt.py")
EMULATE4 = os.path.join(ROOT, "examples", "emulate-2types.yaml")
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")

GPT_ARGS = ("--num-layers 8 --hidden-size 128 --num-attention-heads 4 --seq-length 128 "
            "--max-position-embeddings 128 --micro-batch-size 1 --global-batch-size 16 "
            "--lr 2e-3 --lr-decay-style constant --mock-data --tokenizer-type NullTokenizer "
            "--vocab-size 512 --log-interval 1 --eval-iters 0 --eval-interval 1000 --bf16 "
            "--num-workers 0 --seed 1234").split()


def with_value(args, flag: str, value: str) -> list[str]:
    """``args`` with ``flag``'s value replaced by ``value``."""
    return [(value if prev == flag else a) for prev, a in zip(["", *args[:-1]], args)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, args: list[str], env: dict[str, str], timeout: float = 240,
             module: list[str] | None = None, cwd: str = ROOT):
    """``torchrun`` of ``module`` (default: the launch of examples/pretrain_gpt.py) on ``nproc``
    local CPU processes: (process, stdout + stderr, seconds)."""
    module = module or ["poseidon_plugin.launch", SCRIPT]
    cmd = [TORCHRUN, "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "-m", *module, *args]
    full_env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", **env}
    t0 = time.monotonic()
    proc = run_tree(cmd, timeout, env=full_env, cwd=cwd)
    return proc, proc.stdout + proc.stderr, time.monotonic() - t0


def run_tree(cmd: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, timeout=...)``, but a launch past
    its timeout fails the test with the tail of its output, and every process under it is
    killed first: torchrun starts each rank in a session of its own, so killing torchrun alone
    left hung ranks running after the test."""
    import psutil

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for child in psutil.Process(proc.pid).children(recursive=True):
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(cmd[:8])} ...: no exit within {timeout:g} s (every process "
                    f"under it killed)\n----- tail -----\n{(out + err)[-6000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def ok(proc, out: str) -> str:
    """Assertion message for a failed launch: the error lines first, then the tail of the log."""
    if proc.returncode == 0:
        return ""
    errors = [l for l in out.splitlines() if re.search(r"error|Error|Traceback|exitcode", l)]
    return "\n".join(errors[-40:]) + "\n----- tail -----\n" + out[-5000:]


def write_emulation(path, ranks: list[str], slow_memory_gib: float = 16,
                    slow_speed: float = 0.5) -> str:
    path.write_text("device_types:\n  emu-fast: {speed: 1.0, memory_gib: 16}\n"
                    f"  emu-slow: {{speed: {slow_speed}, memory_gib: {slow_memory_gib}}}\n"
                    f"ranks: [{', '.join(ranks)}]\n")
    return str(path)


def expected_layers(plan: dict) -> list[list[list[int]]]:
    """Per pipeline stage: the 1-based decoder layer numbers of each of its model chunks."""
    from poseidon_plugin.plan import Plan

    p = Plan.from_json(json.dumps(plan))
    segs = p.layout_segments()  # chunk-major: index c * pp + s
    offsets = [sum(segs[:k]) for k in range(len(segs))]
    out = []
    for s in range(p.pp):
        chunks = []
        for c in range(p.virtual_stages):
            k = c * p.pp + s
            if segs[k]:
                chunks.append(list(range(offsets[k] + 1, offsets[k] + segs[k] + 1)))
        out.append(chunks)
    return out


# ------------------------------------------------------------------------------------------

def test_emulated_heterogeneous_training(tmp_path):
    # Three slow ranks (4x slower) and one fast: the fast device alone takes 16 x 8 layer times
    # an iteration, a four-stage pipeline about 16 x 5 + 3 x 4 (5/1/1/1 layers), so mixing wins
    # by >= 11 % for any measured slow/fast ratio up to 6. (With two of each type, as in
    # examples/emulate-2types.yaml, the two fast devices alone come within 6 % of the best mixed
    # plan, and the noise of CPU profiling, measured ratios 1.7-3.9 at a nominal 2x, decided
    # between them: CI twice got the fast devices alone.)
    emu = write_emulation(tmp_path / "emu.yaml", ["emu-slow", "emu-slow", "emu-slow", "emu-fast"],
                          slow_speed=0.25)
    report = tmp_path / "report"
    plan_file = tmp_path / "plan.json"
    proc, out, took = torchrun(4, [*GPT_ARGS, "--train-iters", "8", "--poseidon-auto",
                                   "--poseidon-emulate", emu,
                                   "--poseidon-save-plan", str(plan_file)],
                               {"POSEIDON_EXAMPLE_REPORT": str(report),
                                "POSEIDON_PROFILE_DIR": str(tmp_path / "profiles")})
    assert proc.returncode == 0, ok(proc, out)
    print(f"e2e run took {took:.1f} s")
    plan = json.loads(plan_file.read_text())
    types = [s["device_type"] for s in plan["stages"]]

    # the plan uses both types and gives the fast stage more layers than any slow stage
    assert set(types) == {"emu-fast", "emu-slow"}, plan["stages"]
    most = {t: max(s["layers"] for s in plan["stages"] if s["device_type"] == t) for t in types}
    assert min(s["layers"] for s in plan["stages"] if s["device_type"] == "emu-fast") \
        > most["emu-slow"], plan["stages"]

    # every rank built exactly the layers of its planned stage, on the device the plan put there
    nodes = [[0, 1, 2], [3]]  # discovery: node 0 = the slow ranks (local 0-2), node 1 = the fast
    reports = {r["rank"]: r for r in (json.loads(open(f).read())
                                      for f in glob.glob(str(report / "rank*.json")))}
    assert sorted(reports) == [0, 1, 2, 3]
    want = expected_layers(plan)
    for slot in plan["rank_order"]:
        rep = reports[slot["rank"]]
        assert rep["launch_rank"] == nodes[slot["node"]][slot["local_device"]], (slot, rep)
        stage = plan["stages"][rep["pp_rank"]]
        assert rep["device_type"] == stage["device_type"], (rep, stage)
        assert rep["layer_numbers"] == want[rep["pp_rank"]], (rep, want)
        assert rep["pp_size"] == plan["pp"] and rep["tp_size"] == plan["tp"]
    # the fast device (launch rank 3 on LOCAL_RANK 3) had to move to the fast stage
    fast_stages = {i for i, t in enumerate(types) if t == "emu-fast"}
    assert {reports[r]["pp_rank"] for r in reports if reports[r]["launch_rank"] == 3} <= fast_stages

    # Megatron's own training log: >= 5 iterations, finite loss going down
    losses = [float(m.group(2)) for m in
              re.finditer(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.eE+-]+)", out)]
    assert len(losses) >= 5, out[-4000:]
    assert all(math.isfinite(x) for x in losses)
    half = len(losses) // 2
    assert losses[-1] < losses[0] and sum(losses[half:]) / (len(losses) - half) < sum(losses[:half]) / half, losses
    assert "profiling:" in out

    # the host's contention was measured, not assumed; the live calibration fitted the stage
    # compute and the per-iteration overhead to iterations 2-4, checked them on 5-7 and wrote
    # the overhead to the profile cache, where the next plan of this model and cluster finds it
    assert "host contention: 4 rank(s) running at once" in out
    # each emulated type's measured slowdown is compared with its speed (within 10 %, or a
    # warning; which one depends on the host's load, so only the line is required here)
    assert re.search(r"emulated speed: emu-slow forward x[0-9.]+, backward x[0-9.]+ of "
                     r"emu-fast's; expected x[0-9.]+ \(x4\.00 configured", out), out
    # the report is logged folded (continuations indented by four spaces): one line again
    (cal,) = {l[l.index("calibration:"):] for l in re.sub(r"\n {4}(?=\S)", " ", out).splitlines()
              if "calibration: iteration 7" in l}
    # the warm-up is iteration 1, or longer where the periods had not settled (choose_windows)
    m = re.search(r"fitted to iterations? (\d+)(?:-\d+)? after a warm-up of iterations? "
                  r"(?:1-)?(\d+) \(", cal)
    assert m and int(m.group(1)) == int(m.group(2)) + 1, cal
    warm = int(m.group(2))
    assert warm > 1 or ("over iterations 5-7" in cal and "fitted to iterations 2-4" in cal), cal
    assert plan["iteration_overhead"] is None           # a fresh cache has none
    (cache,) = glob.glob(str(tmp_path / "profiles" / "profiles-*.json"))
    (over,) = json.loads(open(cache).read())["overheads"]
    assert over["source"] == "calibrated"
    assert over["calibrated_on"].endswith(f"iterations {warm + 1}-7"), over
    again = tmp_path / "plan2.json"
    proc, out, _ = torchrun(4, [*GPT_ARGS, "--train-iters", "2", "--poseidon-auto",
                                "--poseidon-dry-run", "--poseidon-emulate", emu,
                                "--poseidon-save-plan", str(again)],
                            {"POSEIDON_PROFILE_DIR": str(tmp_path / "profiles")})
    assert proc.returncode == 0, ok(proc, out)
    plan2 = json.loads(again.read_text())
    assert plan2["iteration_overhead"]["source"] == "calibrated", plan2["iteration_overhead"]
    assert plan2["iteration_overhead"]["ms"] == pytest.approx(over["overhead_ms"])
    assert all(s["overhead_ms"] == pytest.approx(over["overhead_ms"]) for s in plan2["stages"])
    assert "iteration calibrated" in " ".join(out.split())
    # the first launch's plan was offered to the second, under the calibrated costs
    assert "the previous launch's plan" in out and ("kept (window 2%" in out
                                                   or "replaced (window 2%" in out), out


def test_dry_run_prints_flags_builds_nothing_and_second_launch_uses_the_cache(tmp_path):
    report = tmp_path / "report"
    env = {"POSEIDON_EXAMPLE_REPORT": str(report), "POSEIDON_PROFILE_DIR": str(tmp_path / "profiles")}
    args = [*GPT_ARGS, "--train-iters", "2", "--poseidon-auto", "--poseidon-dry-run",
            "--poseidon-emulate", EMULATE4, "--pipeline-model-parallel-size", "4",
            "--poseidon-save-plan", str(tmp_path / "plan.json")]
    proc, out, _ = torchrun(4, args, env)
    assert proc.returncode == 0, ok(proc, out)
    assert "--tensor-model-parallel-size" in out and "command line the script runs with" in out
    assert "rank -> stage" in out and "dry run" in out
    assert "profiling:" in out
    assert not report.exists()                      # no rank reached the script
    assert "lm loss" not in out and "building GPT model" not in out
    # megatron's per-op overheads (each emulated type: the median over its ranks) and the p2p
    # call costs of each link kind the launch has (two types on one host: intra-node of each,
    # one cross-type pair) at the activation size, in the cache; the search charged them
    from poseidon_plugin.callcosts import engine_calls
    from poseidon_plugin.profiles import ProfileDB

    (cache,) = glob.glob(str(tmp_path / "profiles" / "profiles-*.json"))
    db = ProfileDB.load(cache)
    assert [(o.device_type, o.source) for o in db.op_overheads()] == [
        ("emu-fast", "measured"), ("emu-slow", "measured")]
    assert all(0 < o.forward_ms < 100 and 0 < o.backward_ms < 100 for o in db.op_overheads())
    act = 2 * 1 * 128 * 128   # bf16 x micro-batch 1 x seq 128 x hidden 128
    assert sorted(c.key for c in db.p2p_calls()) == [
        ("emu-fast", "intra-node", act), ("emu-slow", "cross-type", act),
        ("emu-slow", "intra-node", act)]
    assert all(c.send_call_ms > 0 and c.recv_ready_ms > 0 for c in db.p2p_calls())
    assert "megatron's per-op overheads and p2p call costs: 2 op overhead and 3 p2p call" in out
    tm = json.loads((tmp_path / "plan.json").read_text())["timing_model"]
    want = engine_calls(db, ["emu-fast", "emu-slow"], act)
    assert (tm["op_forward_ms"], tm["op_backward_ms"], tm["send_call_ms"],
            tm["recv_ready_ms"]) == pytest.approx(want.as_tuple(), abs=1e-6)
    assert tm["source"] == want.source and "p2p_calls emu-" in tm["source"]
    proc2, out2, _ = torchrun(4, args, env)
    assert proc2.returncode == 0, ok(proc2, out2)
    assert "from the cache" in out2 and "profiling:" not in out2
    assert "megatron's per-op overheads" not in out2   # cached too
    # a cache of the layers alone (written before these records existed): the layers come
    # from it, the per-op and per-call costs are measured and added
    raw = json.loads(open(cache).read())
    del raw["op_overheads"], raw["p2p_calls"]
    with open(cache, "w") as f:
        json.dump(raw, f)
    proc3, out3, _ = torchrun(4, args, env)
    assert proc3.returncode == 0, ok(proc3, out3)
    assert "from the cache" in out3 and "profiling:" not in out3
    assert "megatron's per-op overheads and p2p call costs: 2 op overhead and 3 p2p call" in out3
    again = ProfileDB.load(cache)
    assert sorted(c.key for c in again.p2p_calls()) == sorted(c.key for c in db.p2p_calls())
    assert len(again.op_overheads()) == 2
    # the same layer costs (the links are probed again each launch, so the sends move a
    # little: a layout one near-tie away may now be faster by a fraction of a per cent): the
    # first launch's plan is within the window of the fastest, and kept
    m = re.search(r"previous plan: kept \([0-9.]+ ms under these costs, \+([0-9.]+)% over the "
                  r"fastest", out2)
    assert m and float(m.group(1)) <= 2.0 and "kept (window 2%" in out2, out2

    def layout(o: str) -> str:
        return re.search(r"--pipeline-model-parallel-layout (\S+)", o).group(1)

    assert layout(out2) == layout(out)


def test_every_link_kind_gets_its_p2p_call_costs(tmp_path):
    """Two emulated hosts, two types: one rank pair per link kind the launch has (intra-node,
    inter-node, cross-type) measures megatron's per-call p2p costs, every rank its per-op
    overheads; the cache holds them and the plan's timing model charged them."""
    from poseidon_plugin.callcosts import engine_calls
    from poseidon_plugin.profiles import ProfileDB

    emu = tmp_path / "emu.yaml"
    emu.write_text("device_types:\n  emu-fast: {speed: 1.0, memory_gib: 16}\n"
                   "  emu-slow: {speed: 0.5, memory_gib: 16}\n"
                   "ranks: [emu-fast, emu-fast, emu-fast, emu-slow]\n"
                   "hosts: [node-a, node-a, node-b, node-b]\n")
    args = [*GPT_ARGS, "--train-iters", "2", "--poseidon-auto", "--poseidon-dry-run",
            "--poseidon-emulate", str(emu), "--poseidon-tp", "1",
            "--poseidon-save-plan", str(tmp_path / "plan.json")]
    proc, out, _ = torchrun(4, args, {"POSEIDON_PROFILE_DIR": str(tmp_path / "profiles")})
    assert proc.returncode == 0, ok(proc, out)
    (cache,) = glob.glob(str(tmp_path / "profiles" / "profiles-*.json"))
    db = ProfileDB.load(cache)
    act = 2 * 1 * 128 * 128
    assert sorted(c.key for c in db.p2p_calls()) == [
        ("emu-fast", "cross-type", act), ("emu-fast", "inter-node", act),
        ("emu-fast", "intra-node", act)]
    assert [o.device_type for o in db.op_overheads()] == ["emu-fast", "emu-slow"]
    tm = json.loads((tmp_path / "plan.json").read_text())["timing_model"]
    assert tm["source"] == engine_calls(db, ["emu-fast", "emu-slow"], act).source
    assert tm["send_call_ms"] == pytest.approx(max(c.send_call_ms for c in db.p2p_calls()),
                                               abs=1e-6)


def test_corrupt_profile_cache_is_set_aside_and_reprofiled(tmp_path):
    emu = write_emulation(tmp_path / "emu.yaml", ["emu-slow", "emu-fast"])
    env = {"POSEIDON_PROFILE_DIR": str(tmp_path / "profiles")}
    args = [*GPT_ARGS, "--train-iters", "2", "--poseidon-dry-run", "--poseidon-emulate", emu]
    proc, out, _ = torchrun(2, args, env)
    assert proc.returncode == 0, ok(proc, out)
    (cache,) = glob.glob(str(tmp_path / "profiles" / "profiles-*.json"))
    # each type's records name the device of the ranks that measured it, not rank 0's
    recs = json.loads(open(cache).read())["records"]
    assert {r["device_type"] for r in recs} == {"emu-slow", "emu-fast"}
    assert all(r["env"]["device"] == r["device_type"] for r in recs), recs
    with open(cache, "w") as f:
        f.write('{"version": 1, "records": [{"oops"')
    proc, out, _ = torchrun(2, args, env)
    assert proc.returncode == 0, ok(proc, out)
    assert "profile cache is unreadable, re-profiling" in out
    assert glob.glob(cache + ".corrupt-*")
    json.loads(open(cache).read())  # rewritten, valid


@pytest.mark.parametrize("phase", ["profiling", "p2p-calls"])
def test_a_rank_that_never_answers_is_named(tmp_path, phase):
    emu = write_emulation(tmp_path / "emu.yaml", ["emu-slow", "emu-fast"])
    env = {"POSEIDON_PROFILE_DIR": str(tmp_path / "profiles"),
           "POSEIDON_FAULT_INJECT": f"{phase}:1:hang"}
    # the 20 s wait is the product's (named in the error); the run's own wall time, torch's and
    # megatron-core's start-up included, is not asserted: a hang still fails at the timeout. It
    # bounds every barrier, the profiling turns' too (one rank profiles while the other waits:
    # at 3 s, a loaded host's turn outlasted it and the wrong phase timed out first)
    args = [*GPT_ARGS, "--train-iters", "2", "--poseidon-auto", "--poseidon-emulate", emu,
            "--poseidon-timeout", "20"]
    proc, out, _ = torchrun(2, args, env, timeout=300)
    assert proc.returncode != 0
    assert re.search(r"timed out after 20 s .*rank 1 \(host [^,]+, local rank 1, emu-fast\) "
                     rf"\(last seen entering '{phase}'", out), out[-4000:]


def _single(args: list[str], tmp_path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "POSEIDON_PROFILE_DIR": str(tmp_path)}
    return subprocess.run([sys.executable, "-m", "poseidon_plugin.launch", SCRIPT, *args],
                          capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)


@pytest.mark.parametrize("flag", [["--use-checkpoint-args"], ["--inprocess-restart"],
                                  ["--yaml-cfg", "cfg.yaml"]])
def test_refused_flags_exit_2_with_a_clear_message(flag, tmp_path):
    proc = _single([*GPT_ARGS, *flag, "--poseidon-auto"], tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"--poseidon-auto cannot be combined with {flag[0]}" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_global_batch_no_plan_can_divide(tmp_path):
    emu = write_emulation(tmp_path / "emu.yaml", ["emu-fast"])
    args = [a if a != "16" else "7" for a in GPT_ARGS]
    proc = _single([*args, "--poseidon-micro-batch-sizes", "2,4", "--poseidon-emulate", emu,
                    "--poseidon-dry-run"], tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "--global-batch-size 7 is not divisible by any micro-batch size candidate (2, 4)" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_ranks_the_plan_does_not_use_exit_0_and_megatron_sees_only_the_used_ones(tmp_path):
    # the real search on a 3-device launch: the slow device (1 MiB of memory) holds no stage, so
    # the plan is DP=2 on the two fast ones (TP pinned to 1: a TP=2 plan would be estimated only)
    emu = write_emulation(tmp_path / "emu.yaml", ["emu-slow", "emu-fast", "emu-fast"],
                          slow_memory_gib=0.001)
    report = tmp_path / "report"
    env = {"POSEIDON_PROFILE_DIR": str(tmp_path / "profiles"), "POSEIDON_EXAMPLE_REPORT": str(report)}
    proc, out, _ = torchrun(3, [*GPT_ARGS, "--train-iters", "2", "--poseidon-auto",
                                "--poseidon-emulate", emu, "--poseidon-tp", "1"], env)
    assert proc.returncode == 0, ok(proc, out)
    assert re.search(r"\[poseidon rank 0\] this device \(launch rank 0 \(host [^,]+, local rank 0, emu-slow\)\) "
                     r"is not used by the plan \(2 of 3 devices train\); exiting with 0", out), out[-4000:]
    reps = [json.loads(open(f).read()) for f in glob.glob(str(report / "rank*.json"))]
    assert sorted((r["rank"], r["launch_rank"]) for r in reps) == [(0, 1), (1, 2)]
    assert all(r["world_size"] == 2 and r["dp_size"] == 2 for r in reps)
    assert re.search(r"iteration\s+2/\s*2 \|.*lm loss", out)


def test_a_refusal_on_rank_0_exits_every_rank_with_2(tmp_path):
    """No plan fits (1 MiB per device): rank 0's search refuses, the other rank learns it was a
    refusal; each prints its one error line and exits 2 (torchrun itself exits 1 and adds
    its ChildFailedError summary, naming each rank's exitcode: docs/launch.md)."""
    emu = tmp_path / "emu.yaml"
    emu.write_text("device_types:\n  emu-fast: {speed: 1.0, memory_gib: 0.001}\n"
                   "  emu-slow: {speed: 0.5, memory_gib: 0.001}\n"
                   "ranks: [emu-slow, emu-fast]\n")
    proc, out, _ = torchrun(2, [*GPT_ARGS, "--train-iters", "2", "--poseidon-auto",
                                "--poseidon-emulate", str(emu), "--poseidon-dry-run"],
                            {"POSEIDON_PROFILE_DIR": str(tmp_path / "profiles")})
    assert proc.returncode == 1, ok(proc, out)           # torchrun's own code
    errors = [l for l in out.splitlines() if re.match(r"\[poseidon rank \d\] error: ", l)]
    assert len(errors) == 2, out[-4000:]
    assert any("no plan fits" in l for l in errors), errors
    codes = re.findall(r"exitcode\s*: (\d+)", out)
    assert codes and set(codes) == {"2"}, out[-3000:]
