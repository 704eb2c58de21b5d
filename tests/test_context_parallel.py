"""Context parallelism: the CP-scoped costs (hand-computed), the search with CP against an
independent brute force, the placement of tp x cp x dp devices, the plan's flags, bad input."""

from __future__ import annotations

import itertools
import re
import math

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from poseidon_plugin import memory as memory_mod
from poseidon_plugin.cluster import cluster_from_dict
from poseidon_plugin.costs import (CostModel, cp_attention_factor, cp_layer_times, kv_width,
                                   simulator_arrays)
from poseidon_plugin.errors import InfeasibleError, PoseidonError
from poseidon_plugin.model import model_from_dict
from poseidon_plugin.plan import Plan
from poseidon_plugin.search import SearchOptions, enumerate_configs, search_plan
from poseidon_plugin.simulator import iteration_time_ms
from poseidon_plugin.simulator.schedules import validate_schedule
from poseidon_plugin.training import TrainingSetup
from test_search import layer_splits

SEQ = 128


def tiny_model(layers: int = 4):
    # MHA, h 256, 8 heads of 32, SwiGLU ffn 1024
    return model_from_dict({"name": "tiny", "num_layers": layers, "hidden_size": 256,
                            "ffn_hidden_size": 1024, "num_attention_heads": 8,
                            "vocab_size": 1024, "seq_length": SEQ})


def cluster_of(types):
    """(peak TFLOP/s, devices per node, nodes, memory GiB) per type."""
    dts, nodes, inter = {}, [], {}
    for i, (tflops, dpn, count, mem) in enumerate(types):
        name = f"T{i}"
        dts[name] = {"memory_gib": mem, "peak_tflops": tflops, "intra_node_gbps": 400}
        nodes.append({"device_type": name, "devices_per_node": dpn, "count": count})
        inter[name] = 100
    return cluster_from_dict({"name": "rand", "device_types": dts, "nodes": nodes,
                              "links": {"inter_node_gbps": inter, "cross_type_gbps": 50,
                                        "latency_ms": 0.01}})


# --------------------------------------------------------------------------- formulas

def test_attention_factor_and_ring_exchange_by_hand():
    m = tiny_model()
    # per rank seq 64, b 1: projections 2*64*256*(256+512) + 2*64*256*256 = 33,554,432;
    # causal core 4*64*64*256/2 = 2,097,152; SwiGLU MLP 2*64*256*1024*3 = 100,663,296;
    # layer 136,314,880 = 65 x core: at CP 2 the core doubles -> factor 66/65
    assert cp_attention_factor(m, micro_batch_size=1, seq_per_rank=64, cp=2) == \
        pytest.approx(66 / 65, rel=1e-12)
    # CP 4 at seq 32 per rank: core 4*32*32*256/2 = 524,288; layer 68,157,440 - ... by hand:
    # proj 2*32*256*768 + 2*32*256*256 = 16,777,216; mlp 50,331,648 -> 67,633,152 = 129 x core
    assert cp_attention_factor(m, micro_batch_size=1, seq_per_rank=32, cp=4) == \
        pytest.approx((129 + 3) / 129, rel=1e-12)
    assert kv_width(m) == 2 * 8 * 32
    # K/V chunk: 2 bytes x 64 tokens x 512 values = 65,536 bytes; 400 Gbit/s + 0.01 ms:
    # 65536 * 8 / 4e8 s = 0.00131072 ms + 0.01 = 0.01131072 ms per forward step, 0.01262144
    # backward (K/V and dK/dV); a step's attention: core share 1/65 of the layer's time
    f, b = cp_layer_times(m, 0.1, 0.2, micro_batch_size=1, seq_per_rank=64, cp=2, tp=1,
                          link_gbps=400.0, latency_ms=0.01)
    assert f == pytest.approx(0.1 * 66 / 65 + (0.01131072 - 0.1 / 65), rel=1e-12)
    assert b == pytest.approx(0.2 * 66 / 65 + (0.01262144 - 0.2 / 65), rel=1e-12)
    # a slow layer hides the exchange: only the attention grows
    f, b = cp_layer_times(m, 10.0, 20.0, micro_batch_size=1, seq_per_rank=64, cp=2, tp=2,
                          link_gbps=400.0, latency_ms=0.01)
    assert (f, b) == (pytest.approx(10.0 * 66 / 65), pytest.approx(20.0 * 66 / 65))
    assert cp_layer_times(m, 1.0, 2.0, micro_batch_size=1, seq_per_rank=64, cp=1, tp=1,
                          link_gbps=1.0, latency_ms=0.0) == (1.0, 2.0)


def test_cp_scoped_costs_and_memory():
    m = tiny_model()
    cluster = cluster_of([(100.0, 4, 1, 1.0)])
    setup = TrainingSetup(attention="flash", distributed_optimizer=True)
    base = CostModel(cluster, m, None, seq_length=SEQ, training=setup)
    cm = base.at_cp(2)
    assert cm is base.at_cp(2) and cm.at_cp(1) is base and base.at_cp(1) is base
    assert (cm.seq_length, cm.full_seq_length, cm.cp) == (64, SEQ, 2)
    # activations per rank: seq / cp (flash attention: linear in the sequence) -> half
    kw = dict(micro_batch_size=1, tp=1)
    a1 = memory_mod.layer_activation_bytes(m, seq_length=SEQ, setup=setup, **kw)
    a2 = memory_mod.layer_activation_bytes(m, seq_length=64, setup=setup, **kw)
    assert a2 == pytest.approx(a1 / 2)
    common = dict(layers=2, stage=0, num_stages=1, tp=1, micro_batch_size=1,
                  num_microbatches=2, schedule="1f1b", virtual_stages=1)
    one = base.stage_memory(dp=1, **common)
    two = cm.stage_memory(dp=2, **common)           # DP 1 x CP 2: the optimizer over 2 ranks
    assert two.weights_bytes == one.weights_bytes and two.gradients_bytes == one.gradients_bytes
    assert two.optimizer_bytes == pytest.approx(one.optimizer_bytes / 2, rel=1e-6)
    assert two.activations_bytes == pytest.approx(one.activations_bytes / 2, rel=1e-6)
    # a layer's time: the estimate at seq 64 x 66/65 + the exposed ring (intra-node, 400)
    lc1 = base.at_cp(1)._layer_costs_of(0, 1, 1, m, m.signature())
    rec = CostModel(cluster, m, None, seq_length=64, training=setup).layer_costs(0, 1, 1)
    lc2 = cm.layer_costs(0, 1, 1)
    want_f, want_b = cp_layer_times(m, rec.forward_ms, rec.backward_ms, micro_batch_size=1,
                                    seq_per_rank=64, cp=2, tp=1, link_gbps=400.0,
                                    latency_ms=0.01)
    assert (lc2.forward_ms, lc2.backward_ms) == (pytest.approx(want_f), pytest.approx(want_b))
    # half the tokens per rank: the compute falls; this tiny layer cannot hide the ring's
    # 0.01 ms latency, so the exchange is exposed and the layer is slower than at CP 1
    assert rec.forward_ms * 66 / 65 < lc1.forward_ms < lc2.forward_ms
    assert lc2.grad_bytes == lc1.grad_bytes       # parameters do not shard over CP
    assert cm.activation_bytes(2) == base.activation_bytes(2) / 2
    with pytest.raises(PoseidonError, match="divisible by 2 x CP = 6"):
        base.at_cp(3)


# --------------------------------------------------------------------------- search

def _brute_force(cluster, model, gbs, cps, schedules=("1f1b",)):
    """Every (schedule, V, CP, micro-batch, DP, N, uniform TP, type sequence, layer split): CP c
    takes options whose TP x c divides every node of the type, each stage d x c x t devices (the
    placement raising where they do not fit), timed with the CP-scoped costs at DP x CP."""
    base = CostModel(cluster, model, None, seq_length=SEQ)
    L = model.num_layers
    best = math.inf
    names = cluster.type_names
    sizes = {k: [n.num_devices for n in cluster.nodes_of_type(name)]
             for k, name in enumerate(names)}
    for sched, c, b, t in itertools.product(schedules, cps, (1, 2), (1, 2, 4)):
        v = 2 if sched == "interleaved-1f1b" else 1
        cm = base.at_cp(c)
        if model.num_attention_heads % t:
            continue
        ks = [k for k in range(len(names)) if all(s % (t * c) == 0 for s in sizes[k])]
        for d in range(1, gbs + 1):
            if gbs % (d * b):
                continue
            m = gbs // (d * b)
            for n in range(1, L // v + 1):
                if v > 1:
                    try:
                        validate_schedule(sched, n, m, v)
                    except PoseidonError:
                        continue
                for types in itertools.product(ks, repeat=n):
                    for layers in layer_splits(L, n, v):
                        try:
                            stages, places, _ = cm.stage_costs(
                                stage_types=list(types), stage_tps=[t] * n, layers=layers,
                                dp=d * c, micro_batch_size=b, num_microbatches=m,
                                schedule=sched, virtual_stages=v)
                        except PoseidonError:
                            continue
                        if any(s.memory_bytes > s.memory_capacity_bytes for s in stages):
                            continue
                        wrap = cm.wrap_send_ms(places, b) if v > 1 else 0.0
                        F, B, Pf, Pb, R = simulator_arrays(stages, v, wrap)
                        best = min(best, iteration_time_ms(F, B, Pf, Pb, R, m, sched, v,
                                                           engine=True))
    return best


type_st = st.tuples(st.sampled_from([50.0, 100.0, 150.0]), st.sampled_from([1, 2, 4]),
                    st.integers(1, 2), st.sampled_from([0.02, 0.05, 1.0]))


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(type_st, min_size=1, max_size=2), st.integers(2, 4), st.sampled_from([2, 4]),
       st.sampled_from([(1, 2), (2,)]), st.sampled_from(["none", "safe"]),
       st.sampled_from([("1f1b",), ("1f1b", "interleaved-1f1b")]))
def test_search_with_cp_matches_brute_force(types, layers, gbs, cps, pruning, scheds):
    cluster, model = cluster_of(types), tiny_model(layers)
    expected = _brute_force(cluster, model, gbs, cps, scheds)
    try:
        got = search_plan(cluster, model, SearchOptions(
            global_batch_size=gbs, seq_length=SEQ, schedules=scheds, pruning=pruning,
            micro_batch_sizes=(1, 2), warmup_samples=10, workers=1, context_parallel=cps,
            max_virtual_stages=2, runner_up=False))
    except InfeasibleError:
        assert math.isinf(expected)
        return
    assert got.predicted_iteration_time_ms == pytest.approx(expected, rel=1e-9)
    assert got.cp in cps
    assert got.rederived_iteration_time_ms() == pytest.approx(got.predicted_iteration_time_ms,
                                                              rel=1e-6)


def test_cp_plan_places_tp_cp_dp_devices_and_emits_the_flag():
    # 2 nodes x 4 devices; 4 layers; CP fixed at 2
    cluster, model = cluster_of([(100.0, 4, 2, 1.0)]), tiny_model(4)
    plan = search_plan(cluster, model, SearchOptions(
        global_batch_size=4, seq_length=SEQ, schedules=("1f1b",), micro_batch_sizes=(1,),
        warmup_samples=10, workers=1, context_parallel=(2,), runner_up=False))
    assert plan.cp == 2
    slots = [d for st_ in plan.stages for grp in st_.devices for d in grp]
    assert len(slots) == len(set(slots)) == plan.world_size
    for st_ in plan.stages:
        assert len(st_.devices) == st_.dp * 2 and all(len(g) == st_.tp for g in st_.devices)
        # a CP group (consecutive TP groups) stays on one node
        for r in range(st_.dp):
            assert len({d.node for g in st_.devices[2 * r:2 * r + 2] for d in g}) == 1
    assert plan.world_size == sum(s.tp * s.dp * 2 for s in plan.stages)
    assert len(plan.rank_order()) == plan.world_size
    args = plan.megatron_args()
    assert args[args.index("--context-parallel-size") + 1] == "2"
    ms = plan.mindspeed_llm_args()
    assert ms[ms.index("--context-parallel-algo") + 1] == "megatron_cp_algo"
    back = Plan.from_json(plan.to_json())
    assert back.cp == 2 and back.to_json() == plan.to_json()
    assert "cp=2" in plan.table() and plan.seq_length == SEQ


def test_cp_one_is_the_default_and_leaves_plans_unchanged():
    cluster, model = cluster_of([(100.0, 4, 2, 1.0), (50.0, 2, 2, 1.0)]), tiny_model(4)
    kw = dict(global_batch_size=4, seq_length=SEQ, schedules=("1f1b",), warmup_samples=10,
              workers=1, runner_up=False)
    cm = CostModel(cluster, model, None, seq_length=SEQ)
    default = enumerate_configs(cm, SearchOptions(**kw))
    assert default == enumerate_configs(cm, SearchOptions(**kw, context_parallel=(1,)))
    assert all(c.cp == 1 for c in default)
    plan = search_plan(cluster, model, SearchOptions(**kw))
    assert plan.cp == 1 and "cp" not in plan.to_dict()
    assert "--context-parallel-size" not in plan.megatron_args()
    both = search_plan(cluster, model, SearchOptions(**kw, context_parallel=(1, 2)))
    assert both.predicted_iteration_time_ms <= plan.predicted_iteration_time_ms * (1 + 1e-12)


def test_cp_options_keep_a_cp_group_in_one_node():
    # nodes of 2 devices: CP 2 allows TP 1 only; CP 4 nothing
    cluster, model = cluster_of([(100.0, 2, 4, 1.0)]), tiny_model(4)
    cm = CostModel(cluster, model, None, seq_length=SEQ)
    cfgs = enumerate_configs(cm, SearchOptions(global_batch_size=4, seq_length=SEQ,
                                               context_parallel=(2, 4)))
    assert cfgs and {c.cp for c in cfgs} == {2}
    assert all(t == 1 for c in cfgs for _, t in c.options)
    assert all(c.num_stages * c.dp * c.cp <= 8 for c in cfgs)


def test_bad_cp_is_one_clear_error():
    with pytest.raises(PoseidonError, match=r"--cp / context_parallel\): CP 3 needs the "
                                            r"sequence length \(128\) divisible by 2 x CP = 6"):
        SearchOptions(global_batch_size=4, seq_length=SEQ, context_parallel=(3,))
    with pytest.raises(PoseidonError, match="context_parallel"):
        SearchOptions(global_batch_size=4, seq_length=SEQ, context_parallel=(0,))
    assert SearchOptions.search_cp_degrees(128) == (1, 2, 4, 8, 16, 32, 64)
    assert SearchOptions.search_cp_degrees(24) == (1, 2, 4)
    assert SearchOptions.search_cp_degrees(24, start=3) == (1, 2, 3, 4)


# --------------------------------------------------------------------------- launch (dry run)

@pytest.mark.integration
def test_launch_keeps_the_scripts_context_parallelism_in_a_dry_run(tmp_path):
    """4 emulated ranks, ``--context-parallel-size 2``: the launch profiles the layer as a CP
    rank computes it, at seq / CP = 64 tokens and without a CP group (megatron-core's local
    attention refuses CP), plans CP 2 on those measured records and hands it to the script.
    Only a dry run: training with CP on the CPU stops
    in megatron-core ("Context parallelism is only supported by TEDotProductAttention!")."""
    import json

    from test_launch_e2e import EMULATE4, GPT_ARGS, ok, torchrun

    out_plan = tmp_path / "plan.json"
    proc, out, _ = torchrun(4, [*GPT_ARGS, "--train-iters", "2", "--poseidon-dry-run",
                                "--poseidon-emulate", EMULATE4, "--context-parallel-size", "2",
                                "--poseidon-save-plan", str(out_plan)],
                            {"POSEIDON_PROFILE_DIR": str(tmp_path / "profiles")})
    assert proc.returncode == 0, ok(proc, out)
    plan = Plan.from_json(out_plan.read_text())
    assert plan.cp == 2 and plan.world_size == 4 and plan.seq_length == 128
    assert "--context-parallel-size 2" in out and "cp=2" in out
    # the layer records: measured at a CP rank's seq 64
    for stage in json.loads(out_plan.read_text())["stages"]:
        dec = stage["provenance"]["decoder"]
        assert dec["source"] == "measured" and "seq64 " in dec["record"], dec


# --------------------------------------------------------------------------- poseidon plan

def test_poseidon_plan_cp_flags(capsys):
    import os

    from poseidon_plugin import cli

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    base = ["plan", "--cluster", os.path.join(root, "examples/clusters/paper-setting1.yaml"),
            "--model", "llama3-8b", "--global-batch-size", "16", "--seq-length", "8192",
            "--workers", "1", "--no-baselines", "--no-runner-up"]
    assert cli.main(base + ["--cp", "2"]) == 0
    out = capsys.readouterr().out
    assert "cp=2" in out and "--context-parallel-size 2" in out
    assert "DP x CP gradient all-reduce" in out and "per CP rank: seq 4096 tokens" in out
    assert cli.main(base + ["--cp", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "CP 3 needs the sequence length (8192) divisible by 2 x CP = 6" \
        in err[0]
    # a memory-bound case: 8B at seq 32768, TP 1, fits no CP-1 plan on these 16 devices of
    # 64 GiB; CP divides the activations and fits
    long = [*base[:-6], "--seq-length", "32768", "--tp", "1", "--workers", "1",
            "--no-baselines", "--no-runner-up"]
    assert cli.main(long) == 2
    assert "no plan fits" in capsys.readouterr().err
    assert cli.main(long + ["--search-cp"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"cp=(2|4|8|16)\b", out), out
