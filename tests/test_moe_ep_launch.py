"""Expert parallelism in a ``--poseidon-auto`` launch (issue 29 items 4 and 6).

* The launch side, pure Python: the script's ``--expert-model-parallel-size`` is kept (or, with
  ``--poseidon-search-ep``, searched), the EP degrees a launch profiles, a MoE layer profiled as
  one EP rank runs it (its local experts), records grouped by the EP they were measured at.
* megatron-core builds the profiled MoE layer of one EP rank: E / EP local experts.
* End to end under CPU emulation: a tiny MoE model (2 dense + 6 MoE layers, 8 experts, top-2)
  trains through ``--poseidon-auto`` with EP = 2 on 4 ranks of two emulated types, on Megatron-LM
  (megatron-core's alltoall token dispatcher over gloo), and the live calibration line compares
  predicted and measured per stage.
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

from poseidon_plugin.errors import PoseidonError
from poseidon_plugin.megatron.launch import argv as A
from poseidon_plugin.megatron.launch.options import extract_options
from poseidon_plugin.model import load_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_MOE = os.path.join(ROOT, "examples/models/tiny-moe.yaml")


# ------------------------------------------------------------------------------ the EP kept

def _ctx(argv, *, search_ep=False, world=4, model=None):
    from poseidon_plugin.megatron.launch import runner

    opts, rest = extract_options(["--poseidon-auto", *(["--poseidon-search-ep"] if search_ep
                                                       else []), *argv])
    return runner, SimpleNamespace(argv=rest, opts=opts, world_size=world,
                                   model=model or load_model(TINY_MOE))


def test_the_scripts_ep_is_kept_or_searched_and_checked():
    runner, ctx = _ctx(["--expert-model-parallel-size", "2"])
    assert runner._expert_parallel(ctx) == (2,)
    assert runner._expert_parallel(_ctx([])[1]) == (1,)          # Megatron's default, kept
    assert runner._expert_parallel(_ctx(["--expert-model-parallel-size", "2"],
                                        search_ep=True)[1]) is None
    for argv, message in (
            (["--expert-model-parallel-size", "3"], "does not divide the model's 8 experts"),
            (["--expert-model-parallel-size", "8"], "more than the launch's 4 ranks")):
        runner, ctx = _ctx(argv)
        with pytest.raises(PoseidonError, match=message):
            runner._expert_parallel(ctx)
    runner, ctx = _ctx(["--expert-model-parallel-size", "2"],
                       model=load_model(TINY_MOE).kind_model(0))   # the dense kind alone
    with pytest.raises(PoseidonError, match="on a model without MoE layers"):
        runner._expert_parallel(ctx)


def test_the_ep_degrees_a_launch_profiles():
    from poseidon_plugin.megatron.launch.runner import profiled_eps

    assert profiled_eps((2,), 8, 4) == (2,)
    assert profiled_eps(None, 8, 4) == (1, 2, 4)       # searched: dividing E, at most the ranks
    assert profiled_eps(None, 6, 8) == (1, 2, 3, 6)
    assert profiled_eps(None, 0, 8) == (1,)            # dense
    assert profiled_eps((4,), 0, 8) == (1,)


def test_offline_plan_and_launch_agree_on_moe_at_tp_above_1():
    """``poseidon plan --megatron-args`` excludes MoE at TP > 1 without --sequence-parallel, as
    the launch does; with no flags given nothing is assumed (plans as before)."""
    from poseidon_plugin.cli import framework_rules
    from poseidon_plugin.megatron.launch import runner

    offline = framework_rules("--bf16", 8, moe=True)
    assert not offline.tp_allowed(2) and offline.tp_allowed(1)
    assert framework_rules("--bf16 --sequence-parallel", 8, moe=True).tp_allowed(2)
    assert framework_rules("", 8, moe=True).tp_allowed(2)
    assert framework_rules("--bf16", 8, moe=False).tp_allowed(2)
    launch = runner.launch_rules(SimpleNamespace(argv=["--bf16"], model=load_model(TINY_MOE),
                                                 backend="megatron"))
    assert launch.tp_lines([1, 2]) == offline.tp_lines([1, 2]) != []


# ------------------------------------------------------------------- one EP rank's MoE layer

def test_a_moe_kind_is_profiled_once_per_ep_and_dense_kinds_at_ep_1():
    from poseidon_plugin.megatron.profile.profiler import ProfiledKind, local_experts

    mixed = load_model(TINY_MOE)
    kinds = ProfiledKind.of_model(mixed, (2, 1))
    assert [(k.name, k.ep, k.moe) for k in kinds] == [("dense", 1, False), ("moe", 1, True),
                                                      ("moe", 2, True)]
    assert [(k.name, k.ep) for k in ProfiledKind.of_model(mixed)] == [("dense", 1), ("moe", 1)]
    uniform_moe = mixed.kind_model(1)
    assert [k.ep for k in ProfiledKind.of_model(uniform_moe, (4,))] == [4]
    assert [k.ep for k in ProfiledKind.of_model(mixed.kind_model(0), (4,))] == [1]
    # E / EP local experts, at least top-k (a router picks k of what it has)
    assert local_experts(256, 8, 8) == 32 and local_experts(8, 2, 2) == 4
    assert local_experts(8, 2, 8) == 2 and local_experts(8, 1, 8) == 1


def test_expert_rank_args_are_one_ep_rank_without_an_ep_group():
    from poseidon_plugin.megatron.profile.profiler import expert_rank_args

    args = SimpleNamespace(num_experts=8, moe_router_topk=2, expert_model_parallel_size=2,
                           moe_router_num_groups=4, moe_router_group_topk=2)
    one = expert_rank_args(args, 2)
    assert (one.num_experts, one.expert_model_parallel_size) == (4, 1)
    assert one.moe_router_num_groups is None and one.moe_router_group_topk is None
    assert (args.num_experts, args.expert_model_parallel_size) == (8, 2)   # not changed
    full = expert_rank_args(args, 1)          # EP 1: every expert, still no EP group
    assert (full.num_experts, full.expert_model_parallel_size) == (8, 1)
    plain = SimpleNamespace(num_experts=8, moe_router_topk=2, expert_model_parallel_size=1)
    assert expert_rank_args(plain, 1) is plain
    with pytest.raises(PoseidonError, match="EP 3 does not divide the model's 8 experts"):
        expert_rank_args(plain, 3)


def test_timings_aggregate_per_ep():
    from poseidon_plugin.megatron.profile.profiler import LayerTiming, aggregate

    def t(ep, f):
        return LayerTiming(1, 1, f, 2 * f, 10, 20, kind="moe", ep=ep)

    aggs, _ = aggregate({0: [t(1, 4.0), t(2, 2.0)], 1: [t(1, 6.0), t(2, 3.0)]},
                        {0: "a", 1: "a"})
    assert [(a.ep, a.forward_ms, a.ranks) for a in aggs] == [(1, 5.0, 2), (2, 2.5, 2)]


def test_records_of_an_ep_profile_are_keyed_by_it():
    from poseidon_plugin.megatron.profile import profile_gather as G
    from poseidon_plugin.megatron.profile.profiler import Aggregate

    if not G.keys_carry_ep():
        with pytest.raises(PoseidonError, match="cannot be keyed by EP 2"):
            G.ep_fields(2)
        pytest.skip("ProfileKey has no EP degree in this tree")
    mixed = load_model(TINY_MOE)
    sigs = G.kind_signatures(mixed)
    aggs = [Aggregate("a", 1, 1, 1.0, 2.0, 10, 20, 1, kind="dense"),
            Aggregate("a", 1, 1, 3.0, 6.0, 10, 20, 1, kind="moe", ep=2)]
    recs = G.measured_records(aggs, 128, sigs)
    assert [(r.key.model_signature, r.key.ep) for r in recs] == [(sigs["dense"], 1),
                                                                 (sigs["moe"], 2)]
    cluster = SimpleNamespace(type_names=("a",))
    keys = G.needed_keys(cluster, mixed, (1,), (1,), 128, eps=(2,))
    assert sorted((k.model_signature == sigs["moe"], k.ep) for k in keys) == [(False, 1),
                                                                             (True, 2)]
    assert {r.key for r in recs} == set(keys)


def test_poseidon_profile_ep_is_checked_before_anything_is_built():
    from poseidon_plugin.megatron.profile import offline
    from poseidon_plugin.megatron.profile.profile_gather import keys_carry_ep

    mixed = load_model(TINY_MOE)
    offline.check_eps(offline.ProfileRequest(mixed, 128, "cpu"))           # EP 1: nothing
    for model, eps, message in ((mixed.kind_model(0), (2,), "the model has no MoE layers"),
                                (mixed, (1, 3), "--ep 3 does not divide the model's 8 experts")):
        with pytest.raises(PoseidonError, match=message):
            offline.check_eps(offline.ProfileRequest(model, 128, "cpu", eps=eps))
    req = offline.ProfileRequest(mixed, 128, "cpu", eps=(2, 4))
    if keys_carry_ep():
        offline.check_eps(req)
    else:
        with pytest.raises(PoseidonError, match="cannot say their EP"):
            offline.check_eps(req)


_EP_LAYER = r"""
import sys, tempfile, warnings
warnings.simplefilter("ignore")
from poseidon_plugin.megatron.emulate import emulation
from poseidon_plugin.megatron.profile import offline, profiler
emulation.install_cpu_shims(local_rank=0, device_count=1, device_name="cpu", memory_bytes=1 << 30)
from poseidon_plugin.model import load_model
from poseidon_plugin.training import TrainingSetup, megatron_flags
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.spec_utils import build_module
model = load_model(sys.argv[1])
flags = offline.model_flags(model, 128, 1)
flags[flags.index("--num-layers") + 1] = str(model.num_layers)
flags += ["--moe-layer-freq", "[0]*2+[1]*6", "--expert-model-parallel-size", "2"]
setup = TrainingSetup(attention="unfused")
args = profiler.parse_megatron_args("check", flags + megatron_flags(setup)
                                    + offline.backend_flags("cpu", setup))
offline._init_alone("cpu", tempfile.mkdtemp())
parallel_state.initialize_model_parallel(1)
tensor_parallel.model_parallel_cuda_manual_seed(1234)
for ep in (1, 2, 4, 8):
    va = profiler.profiling_args(profiler.expert_rank_args(args, ep), 1, 1, 1, 0)
    config, spec = profiler.layer_config_and_spec(va, 2, True)
    layer = build_module(spec, config=config, layer_number=3)
    experts = len(list(layer.mlp.experts.local_experts)) if hasattr(layer.mlp.experts,
        "local_experts") else layer.mlp.num_local_experts
    size = sum(p.numel() * p.element_size() for p in layer.parameters())
    expert = sum(p.numel() * p.element_size() for p in layer.mlp.experts.parameters()) // experts
    kept = profiler._ep_rank_param_bytes(layer, size, args, profiler.ProfiledKind(ep=ep))
    print("ep", ep, experts, size, kept, expert)
"""


@pytest.mark.integration
def test_megatron_builds_one_ep_ranks_local_experts(tmp_path):
    """megatron-core builds the profiled MoE layer of one EP rank with E / EP experts (at least
    top-k): the parameters fall by one expert's each time an expert goes."""
    pytest.importorskip("megatron.core")
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-c", _EP_LAYER, TINY_MOE], capture_output=True,
                          text=True, cwd=tmp_path, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = {int(ep): tuple(map(int, rest)) for _, ep, *rest in
            (line.split() for line in proc.stdout.splitlines() if line.startswith("ep "))}
    assert {ep: r[0] for ep, r in rows.items()} == {1: 8, 2: 4, 4: 2, 8: 2}
    size = {ep: r[1] for ep, r in rows.items()}
    (expert,) = {r[3] for r in rows.values()}
    assert expert > 0 and size[1] - size[2] == 2 * (size[2] - size[4]) > 4 * expert
    assert size[8] == size[4]   # top-2: two experts built at least ...
    # ... and the record keeps what one rank of EP 8 holds: E / EP = 1 expert
    assert rows[8][2] == size[8] - expert
    assert all(rows[ep][2] == size[ep] for ep in (1, 2, 4))


@pytest.mark.integration
def test_poseidon_profile_writes_a_moe_record_per_ep(tmp_path):
    """``poseidon profile --ep 1 2 4`` on one CPU process: the dense kind once (EP 1), the MoE
    kind once per EP, keyed by it, each with one EP rank's experts (8, 4, 2 of 8)."""
    pytest.importorskip("megatron.core")
    from poseidon_plugin.profiles import ProfileDB

    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    db = str(tmp_path / "db.json")
    proc = subprocess.run([sys.executable, "-m", "poseidon_plugin", "profile", "--model",
                           TINY_MOE, "--seq-length", "128", "--device-type", "cpu", "--device",
                           "cpu", "--micro-batch-sizes", "1", "--iters", "2", "--ep", "1", "2",
                           "4", "-o", db], capture_output=True, text=True, cwd=tmp_path,
                          env=env, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "(one rank of EP 2)" in proc.stdout and "(one rank of EP 4)" in proc.stdout
    from poseidon_plugin.megatron.profile.profile_gather import kind_signatures

    sigs = kind_signatures(load_model(TINY_MOE))
    recs = {(r.key.model_signature, r.key.ep): r for r in ProfileDB.load(db).profiles()}
    assert set(recs) == {(sigs["dense"], 1), (sigs["moe"], 1), (sigs["moe"], 2),
                         (sigs["moe"], 4)}
    p = {ep: recs[(sigs["moe"], ep)].param_bytes for ep in (1, 2, 4)}
    assert p[1] - p[2] == 2 * (p[2] - p[4]) > 0   # 4 experts fewer, then 2 fewer
    assert all(recs[k].source == "measured" and recs[k].forward_ms > 0 for k in recs)


# ------------------------------------------------------------------ end to end, EP = 2

EP_ARGS = ("--num-layers 8 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 128 "
           "--seq-length 64 --max-position-embeddings 64 --disable-bias-linear "
           "--untie-embeddings-and-output-weights --num-experts 8 --moe-router-topk 2 "
           "--moe-ffn-hidden-size 64 --moe-layer-freq [0]*2+[1]*6 "
           "--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall "
           "--micro-batch-size 1 --global-batch-size 8 --lr 2e-3 --lr-decay-style constant "
           "--mock-data --tokenizer-type NullTokenizer --vocab-size 256 --log-interval 1 "
           "--eval-iters 0 --eval-interval 1000 --bf16 --num-workers 0 --seed 1234").split()


@pytest.mark.integration
def test_emulated_moe_training_with_expert_parallelism(tmp_path):
    pytest.importorskip("megatron.core")
    from test_launch_e2e import EMULATE4, ok, torchrun

    plan_file = tmp_path / "plan.json"
    proc, out, took = torchrun(4, [*EP_ARGS, "--train-iters", "6", "--poseidon-auto",
                                   "--poseidon-emulate", EMULATE4,
                                   "--poseidon-save-plan", str(plan_file)],
                               {"POSEIDON_PROFILE_DIR": str(tmp_path / "profiles")}, timeout=480)
    assert proc.returncode == 0, ok(proc, out)
    print(f"EP launch took {took:.1f} s")
    plan = json.loads(plan_file.read_text())
    assert plan["ep"] == 2 and plan["dp"] % 2 == 0, {k: plan[k] for k in ("ep", "dp", "pp")}
    assert sum(s["layers"] for s in plan["stages"]) == 8
    # Megatron ran what the plan says: EP 2 on the command line and in its own arguments
    flags = out.split("\nflags:\n", 1)[1].splitlines()[0].split()
    line = out.split("\ncommand line the script runs with:\n", 1)[1].splitlines()[0].split()
    assert A.flag_value(flags, "--expert-model-parallel-size") == "2", flags
    assert line.count("--expert-model-parallel-size") == 1
    assert A.flag_value(line, "--expert-model-parallel-size") == "2"
    assert re.search(r"expert_model_parallel_size \.+ 2\b", out), out[-3000:]
    # the MoE layer was profiled as one rank of EP 2 (4 of the 8 experts), the records say so
    assert "as one rank of EP 2 runs it: 4 local expert(s) of 8" in out
    (cache,) = glob.glob(str(tmp_path / "profiles" / "profiles-*.json"))
    recs = [r for r in json.loads(open(cache).read())["records"] if r["layer_kind"] == "decoder"]
    moe = [r for r in recs if "-moe-e8-k2" in r["model_signature"]]
    assert moe and all(r.get("ep") == 2 for r in moe), moe
    assert all(r.get("ep", 1) == 1 for r in recs if r not in moe)
    # Megatron's training log: every iteration, a finite loss
    losses = [float(m.group(1)) for m in re.finditer(r"iteration\s+\d+/\s*\d+ \|.*?lm loss: "
                                                     r"([0-9.eE+-]+)", out)]
    assert len(losses) >= 5 and all(math.isfinite(x) for x in losses), out[-4000:]
    # the live calibration: predicted vs measured, and per stage the measured / planned
    # forward / backward ratios and the measured times
    # the report is logged folded (continuations indented by four spaces): one line again
    (cal,) = [l[l.index("calibration:"):] for l in re.sub(r"\n {4}(?=\S)", " ", out).splitlines()
              if "calibration: iteration" in l]
    print(re.search(r"Plan for .*", out).group(0))
    print(cal)
    assert re.search(r"predicted [0-9.]+ ms, measured [0-9.]+ ms", cal), cal
    for s in range(plan["pp"]):
        assert re.search(rf"\bs{s} x[0-9.]+/x[0-9.]+", cal), cal
        assert re.search(rf"\bs{s} F [0-9.]+/B [0-9.]+", cal), cal
