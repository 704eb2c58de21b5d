"""One profile per distinct layer kind (issue 29, item 2): a model of dense and MoE layers is
profiled once per kind -- by every rank of a launch and by ``poseidon profile`` -- and its
records are keyed by each kind's signature (``ModelSpec.kind_model(i).signature()``), so a mixed
model's DB holds one record per (kind, device type, TP, micro-batch size).

The unit tests need no torch; the ``integration`` ones run megatron-core on the CPU (``poseidon
profile`` in one process, and a 4-rank emulated launch under torchrun)."""

from __future__ import annotations

import functools
import glob
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from poseidon_plugin.model import load_model
from poseidon_plugin.profiles import LayerProfile, ProfileDB, ProfileKey

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_MOE = os.path.join(ROOT, "examples/models/tiny-moe.yaml")
TINY = os.path.join(ROOT, "examples/models/tiny-gpt.yaml")


def _profiler():
    from poseidon_plugin.megatron.profile import profiler  # imports no torch at module level

    return profiler


def _gather():
    from poseidon_plugin.megatron.profile import profile_gather

    return profile_gather


# --------------------------------------------------------------------------- unit


def test_the_kinds_a_rank_profiles_are_the_first_layer_of_each_kind():
    P = _profiler()
    mixed = load_model(TINY_MOE)            # layers 0-1 dense, 2-7 MoE
    kinds = P.ProfiledKind.of_model(mixed)
    assert [(k.name, k.layer_index, k.moe) for k in kinds] == [("dense", 0, False),
                                                                 ("moe", 2, True)]
    (one,) = P.ProfiledKind.of_model(load_model(TINY))
    assert (one.name, one.layer_index, one.moe) == ("", 0, None)    # keyed as before
    # a MoE-only model: one kind, the first layer, the script's one spec
    (moe,) = P.ProfiledKind.of_model(mixed.kind_model(1))
    assert (moe.name, moe.layer_index, moe.moe) == ("", 0, None)


def test_each_kind_is_keyed_by_its_uniform_model_and_every_kind_is_needed():
    from poseidon_plugin.cluster import load_cluster

    G = _gather()
    mixed = load_model(TINY_MOE)
    sigs = G.kind_signatures(mixed)
    assert sigs == {"dense": mixed.kind_model(0).signature(),
                    "moe": mixed.kind_model(1).signature()}
    assert len(set(sigs.values())) == 2 and mixed.signature() not in sigs.values()
    assert "moe" not in sigs["dense"] and "-moe-e8-k2" in sigs["moe"]
    uniform = load_model(TINY)
    assert G.kind_signatures(uniform) == {"": uniform.signature()}   # existing DBs match

    cluster = load_cluster(os.path.join(ROOT, "examples/clusters/paper-setting1.yaml"))
    assert len(cluster.type_names) >= 2
    keys = G.needed_keys(cluster, mixed, [1, 2], [1, 2], 128)
    assert len(keys) == 2 * len(cluster.type_names) * 2 * 2
    for t in cluster.type_names:
        for sig in sigs.values():
            assert ProfileKey(t, "decoder", 2, 1, 128, sig) in keys
    # the cache is complete only with every kind's records
    db = ProfileDB(None)
    for k in keys:
        if k.model_signature == sigs["dense"]:
            db.put(LayerProfile(k, 1.0, 2.0, 1, 1, source="measured"))
    assert not G.all_measured(db, keys)
    for k in keys:
        db.put(LayerProfile(k, 1.0, 2.0, 1, 1, source="measured"))
    assert G.all_measured(db, keys)


def test_aggregate_and_records_keep_the_kinds_apart():
    P, G = _profiler(), _gather()
    T = P.LayerTiming

    def rank(dense_ms, moe_ms, slow=1.0):
        return [T(1, 1, dense_ms, 2 * dense_ms, 100, 10, kind="dense"),
                T(1, 1, moe_ms * slow, 2 * moe_ms * slow, 300, 30, kind="moe")]

    per_rank = {0: rank(1.0, 3.0), 1: rank(1.1, 3.1), 2: rank(1.0, 3.0, slow=4.0)}
    aggs, stragglers = P.aggregate(per_rank, {0: "a", 1: "a", 2: "a"})
    assert [(a.kind, a.forward_ms, a.activation_bytes, a.param_bytes, a.ranks) for a in aggs] \
        == [("dense", 1.0, 100, 10, 3), ("moe", 3.1, 300, 30, 3)]
    # the straggler is rank 2's MoE layer only, and is named as such
    assert len(stragglers) == 1 and "rank 2" in stragglers[0] and "moe layer" in stragglers[0]

    mixed = load_model(TINY_MOE)
    sigs = G.kind_signatures(mixed)
    recs = G.measured_records(aggs, 128, sigs)
    by_sig = {r.key.model_signature: r for r in recs}
    assert set(by_sig) == set(sigs.values())
    assert by_sig[sigs["dense"]].forward_ms == pytest.approx(1.0, rel=0.02)
    assert by_sig[sigs["moe"]].forward_ms == pytest.approx(3.1, rel=0.02)
    assert by_sig[sigs["moe"]].param_bytes == 30
    # the key per-stage costs look a kind up by (lookup_profile with kind_model(i)) finds it
    from poseidon_plugin.profiles import profile_key

    db = ProfileDB(None)
    for r in recs:
        db.put(r)
    for i, kind in enumerate(mixed.layer_kinds):
        found = db.get(profile_key(mixed.kind_model(i), "a", "decoder", 1, 1, 128))
        assert found is not None and found.param_bytes == (30 if kind.is_moe else 10)
    # a kind the model does not have is an error, not a record under someone else's key
    with pytest.raises(ValueError, match="not among"):
        G.measured_records(aggs, 128, {"dense": sigs["dense"]})
    # one signature for all (a uniform model's aggregates, kind "")
    (rec,) = G.measured_records([aggs[0]], 128, "sig")
    assert rec.key.model_signature == "sig"


def test_calibration_reads_every_kinds_records():
    from poseidon_plugin.megatron.launch import discovery as D

    G = _gather()
    mixed = load_model(TINY_MOE)
    infos = [D.DeviceInfo(r, r % 2, host, t, 16 << 30, "emulated", 0.5 if t == "slow" else 1.0)
             for r, (host, t) in enumerate([("a", "slow"), ("a", "slow"), ("b", "fast"),
                                            ("b", "fast")])]
    cluster = D.discover_cluster(D.group_nodes(infos), D.LinkMeasurements())
    sigs = G.kind_signatures(mixed)
    db = ProfileDB(None)
    for t, ms in (("slow", 20.0), ("fast", 10.0)):
        # the MoE kind only: the mixed model's own signature has no records, and still the
        # type's speed is calibrated (from the MoE kind's FLOPs)
        db.put(LayerProfile(ProfileKey(t, "decoder", 1, 1, 128, sigs["moe"]), ms, 2 * ms, 1, 1,
                            source="measured"))
    out = G.calibrate(cluster, db, mixed, [1], [1], 128, estimated_peak=["slow", "fast"])
    flops = mixed.kind_model(1).layer_forward_flops(1, 128)
    assert out.device_types["fast"].peak_tflops == pytest.approx(flops / 10e-3 / 1e12, rel=1e-4)
    assert out.device_types["fast"].calibrated and out.device_types["slow"].calibrated


def test_emulated_speed_check_compares_one_kind():
    from poseidon_plugin.megatron.emulate.contention import emulated_speed_checks
    from poseidon_plugin.megatron.profile.profiler import Aggregate

    aggs = [Aggregate("fast", 1, 1, 1.0, 2.0, 0, 0, 2, kind="dense"),
            Aggregate("fast", 1, 1, 5.0, 10.0, 0, 0, 2, kind="moe"),
            Aggregate("slow", 1, 1, 2.0, 4.0, 0, 0, 2, kind="dense"),
            Aggregate("slow", 1, 1, 10.0, 20.0, 0, 0, 2, kind="moe")]
    (check,) = emulated_speed_checks(aggs, {"fast": 1.0, "slow": 0.5}, {})
    # dense against dense: 2x, not the MoE layer of one type against the other's dense one
    assert (check.device_type, check.reference) == ("slow", "fast")
    assert check.forward == pytest.approx(2.0) and check.backward == pytest.approx(2.0)


class MoELayer:            # stand-ins named as megatron-core's classes
    pass


class MLP:
    @classmethod
    def as_mlp_submodule(cls, **kw):
        return cls


def test_moe_spec_is_recognised_in_every_form_megatron_uses():
    P = _profiler()

    def layer(mlp):
        return SimpleNamespace(submodules=SimpleNamespace(mlp=mlp))

    assert P.is_moe_spec(layer(SimpleNamespace(module=MoELayer, submodules=None)))
    assert P.is_moe_spec(layer(functools.partial(MoELayer, submodules=None)))       # core 0.19
    assert not P.is_moe_spec(layer(functools.partial(MLP.as_mlp_submodule, submodules=None)))
    assert not P.is_moe_spec(layer(SimpleNamespace(module=MLP, submodules=None)))
    assert not P.is_moe_spec(layer(None))


def test_balanced_routing_is_set_where_the_config_has_it():
    P = _profiler()
    cfg = SimpleNamespace(num_moe_experts=8, moe_router_force_load_balancing=False)
    assert P.balanced_routing(cfg) and cfg.moe_router_force_load_balancing is True
    assert not P.balanced_routing(SimpleNamespace(num_moe_experts=8))      # older core: as built
    dense = SimpleNamespace(num_moe_experts=None, moe_router_force_load_balancing=False)
    assert not P.balanced_routing(dense) and dense.moe_router_force_load_balancing is False


def test_live_calibration_writes_no_per_layer_records_for_a_mixed_model():
    from poseidon_plugin.megatron.calibrate import calibration as C

    plan = SimpleNamespace(stages=[], predicted_iteration_time_ms=1.0)
    assert C.LiveCalibration(plan, layer_records=False).layer_records is False
    assert C.LiveCalibration(plan).layer_records is True


# --------------------------------------------------------------------------- integration


def _poseidon(*argv, cwd):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "poseidon_plugin", *argv], capture_output=True,
                          text=True, cwd=cwd, env=env, timeout=400)


@pytest.mark.integration
def test_poseidon_profile_writes_a_record_per_kind(tmp_path):
    pytest.importorskip("megatron.core")
    db = str(tmp_path / "db.json")
    proc = _poseidon("profile", "--model", TINY_MOE, "--seq-length", "128", "--device-type",
                     "cpu", "--device", "cpu", "--micro-batch-sizes", "1", "--iters", "2",
                     "-o", db, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    model = load_model(TINY_MOE)
    sigs = _gather().kind_signatures(model)
    recs = {r.key.model_signature: r for r in ProfileDB.load(db).profiles()}
    assert set(recs) == set(sigs.values())
    dense, moe = recs[sigs["dense"]], recs[sigs["moe"]]
    for rec in (dense, moe):
        assert rec.source == "measured" and rec.key.device_type == "cpu"
        assert rec.forward_ms > 0 and rec.backward_ms > 0
    # each record is its own kind's layer: megatron-core's parameters of it (bf16)
    assert dense.param_bytes == 2 * model.layer_kinds[0].params()
    assert moe.param_bytes == 2 * model.layer_kinds[1].params()
    assert (dense.forward_ms, dense.backward_ms) != (moe.forward_ms, moe.backward_ms)


MOE_ARGS = ("--num-layers 8 --hidden-size 256 --num-attention-heads 8 --group-query-attention "
            "--num-query-groups 4 --ffn-hidden-size 1024 --seq-length 128 "
            "--max-position-embeddings 128 --disable-bias-linear "
            "--untie-embeddings-and-output-weights --num-experts 8 --moe-router-topk 2 "
            "--moe-ffn-hidden-size 256 --moe-layer-freq [0]*2+[1]*6 "
            "--moe-shared-expert-intermediate-size 256 --micro-batch-size 1 "
            "--global-batch-size 8 --lr 2e-3 --lr-decay-style constant --mock-data "
            "--tokenizer-type NullTokenizer --vocab-size 1024 --log-interval 1 --eval-iters 0 "
            "--eval-interval 1000 --bf16 --num-workers 0 --seed 1234").split()


@pytest.mark.integration
def test_emulated_launch_profiles_both_kinds_and_the_dry_run_plans(tmp_path):
    pytest.importorskip("megatron.core")
    from test_launch_e2e import EMULATE4, ok, torchrun

    plan_file = tmp_path / "plan.json"
    env = {"POSEIDON_PROFILE_DIR": str(tmp_path / "profiles")}
    args = [*MOE_ARGS, "--train-iters", "2", "--poseidon-auto", "--poseidon-dry-run",
            "--poseidon-emulate", EMULATE4, "--poseidon-save-plan", str(plan_file)]
    proc, out, _ = torchrun(4, args, env, timeout=480)
    assert proc.returncode == 0, ok(proc, out)
    assert "x 2 layer kinds" in out and "dry run" in out
    assert "tokens routed evenly" in out

    (cache,) = glob.glob(str(tmp_path / "profiles" / "profiles-*.json"))
    recs = [r for r in json.loads(open(cache).read())["records"]
            if r["layer_kind"] == "decoder"]
    by = {}
    for r in recs:
        by.setdefault((r["device_type"], r["tp"], r["micro_batch_size"]), {})[
            r["model_signature"]] = r
    types = {t for t, _, _ in by}
    assert types == {"emu-fast", "emu-slow"}
    # every (type, tp, mbs) measured holds exactly one record of each kind, the MoE one with
    # the MoE layer's parameters (more than the dense layer's: 8 experts of 256 + a shared one)
    for (t, tp, mbs), kinds in by.items():
        assert len(kinds) == 2, (t, tp, mbs, list(kinds))
        (moe_sig,) = [s for s in kinds if "-moe-e8-k2" in s]
        (dense_sig,) = [s for s in kinds if s != moe_sig]
        assert "-layers-" not in moe_sig and "-layers-" not in dense_sig   # per kind, not mixed
        moe, dense = kinds[moe_sig], kinds[dense_sig]
        assert moe["param_bytes"] > dense["param_bytes"]
        assert (moe["forward_ms"], moe["backward_ms"]) != (dense["forward_ms"],
                                                           dense["backward_ms"])
    plan = json.loads(plan_file.read_text())
    assert sum(s["layers"] for s in plan["stages"]) == 8
    # the plan's decoder costs rest on the kinds' measurements (measured per kind once the
    # search costs stages per kind; the types' speed calibrated from them meanwhile), never
    # on an uncalibrated estimate
    for st in plan["stages"]:
        decoder = [e for k, v in st["provenance"].items() if k.startswith("decoder")
                   for e in (v if isinstance(v, list) else [v])]
        assert decoder, st
        assert all(e["source"] in ("measured", "calibrated", "scaled") for e in decoder), st


def test_moe_at_tp_above_1_without_sequence_parallelism_is_tp_1_only():
    from poseidon_plugin.errors import PoseidonError
    from poseidon_plugin.megatron.profile import offline
    from poseidon_plugin.megatron.profile.profile_tps import Processes
    from poseidon_plugin.megatron.launch import runner
    from poseidon_plugin.search.rules import FrameworkRules

    mixed = load_model(TINY_MOE)

    def launch_tp_ok(model, argv):   # what the launch profiles and plans (runner.launch_rules)
        return runner.launch_rules(SimpleNamespace(argv=argv, model=model, backend="megatron")
                                   ).tp_allowed(2)

    assert not launch_tp_ok(mixed, [])
    assert launch_tp_ok(mixed, ["--sequence-parallel"])
    assert launch_tp_ok(mixed.kind_model(0), [])
    # poseidon plan --megatron-args: the same rule from the flags (or --num-experts)
    assert not FrameworkRules.from_argv(["--bf16"], moe=True).tp_allowed(2)
    assert not FrameworkRules.from_argv(["--num-experts", "8"]).tp_allowed(2)
    assert FrameworkRules.from_argv(["--num-experts", "8", "--sequence-parallel"]).tp_allowed(2)
    # poseidon profile: one error line before anything is built
    req = offline.ProfileRequest(mixed, 128, "cpu", tps=(1, 2))
    with pytest.raises(PoseidonError, match="profile the MoE model at --tp 1"):
        offline.profile_layers(req, Processes(0, 2, 0, 2))


_SPEC_CHECK = r"""
import sys, tempfile, warnings
warnings.simplefilter("ignore")
from poseidon_plugin.megatron.emulate import emulation
from poseidon_plugin.megatron.profile import offline, profiler
emulation.install_cpu_shims(local_rank=0, device_count=1, device_name="cpu", memory_bytes=1 << 30)
from poseidon_plugin.errors import PoseidonError
from poseidon_plugin.model import load_model
from poseidon_plugin.training import TrainingSetup, megatron_flags
from megatron.core import parallel_state
model = load_model(sys.argv[1])
flags = offline.model_flags(model, 128, 1)
flags[flags.index("--num-layers") + 1] = str(model.num_layers)
flags += ["--moe-layer-freq", "[0]*2+[1]*6"]
setup = TrainingSetup(attention="unfused")
args = profiler.parse_megatron_args("check", flags + megatron_flags(setup)
                                    + offline.backend_flags("cpu", setup))
offline._init_alone("cpu", tempfile.mkdtemp())
parallel_state.initialize_model_parallel(1)
va = profiler.profiling_args(args, 1, 1, 1, 0)
for index, moe in ((0, False), (1, False), (2, True), (7, True)):
    _, spec = profiler.layer_config_and_spec(va, index, moe)
    assert profiler.is_moe_spec(spec) == moe, (index, moe)
for index, moe in ((0, True), (2, False), (8, None)):
    try:
        profiler.layer_config_and_spec(va, index, moe)
    except PoseidonError as e:
        print("refused", index, e)
    else:
        raise SystemExit(f"layer {index} as moe={moe} was not refused")
print("ok")
"""


@pytest.mark.integration
def test_the_layer_of_each_kind_comes_from_megatrons_block_spec_and_is_checked(tmp_path):
    """megatron-core's block spec of tiny-moe: layers 1-2 dense, 3-8 MoE; a layer the planner
    reads as the other kind (or one the block does not have) is refused, not mislabelled."""
    pytest.importorskip("megatron.core")
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-c", _SPEC_CHECK, TINY_MOE], capture_output=True,
                          text=True, cwd=tmp_path, env=env, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), \
        proc.stdout[-2000:] + proc.stderr[-3000:]
    refused = [line for line in proc.stdout.splitlines() if line.startswith("refused")]
    assert len(refused) == 3
    assert "layer 1 of the model as Megatron builds it is a dense layer" in refused[0]
    assert "layer 3 of the model as Megatron builds it is a MoE layer" in refused[1]
    assert "no layer 8 to profile" in refused[2]
