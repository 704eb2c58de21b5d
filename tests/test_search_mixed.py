"""The search on models of several layer kinds (issue 29, item 3): a stage costs the layers it
holds (its first layer: the layers of the stages before it). Pruned search == exhaustive ==
brute-force enumeration through the Python cost path (``CostModel.stage_costs``, per kind),
memory from each stage's own layer range."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from poseidon_plugin.costs import CostModel
from poseidon_plugin.errors import InfeasibleError, PoseidonError
from poseidon_plugin.model import model_from_dict
from poseidon_plugin.search import SearchContext, SearchOptions, enumerate_configs, search_plan
from test_search import layer_splits, make_cluster

SCHEDS = ("1f1b", "eager-1f1b", "gpipe")


def make_instance(draw_types, pattern, dense_ffn, moe_ffn):
    cluster = make_cluster(draw_types)
    model = model_from_dict({
        "name": "tiny-mixed", "num_layers": len(pattern), "hidden_size": 256,
        "ffn_hidden_size": dense_ffn, "num_attention_heads": 8, "vocab_size": 1024,
        "seq_length": 128, "num_experts": 4, "moe_top_k": 2, "moe_ffn_hidden_size": moe_ffn,
        "moe_layer_freq": "[" + ",".join(str(v) for v in pattern) + "]"})
    return cluster, model


type_st = st.tuples(st.sampled_from([50.0, 100.0, 150.0]), st.sampled_from([1, 2]),
                    st.integers(1, 2), st.sampled_from([0.02, 0.03, 0.05, 1.0]))
pattern_st = st.lists(st.sampled_from([0, 1]), min_size=2, max_size=6).filter(
    lambda p: 0 in p and 1 in p)
instance_st = st.tuples(st.lists(type_st, min_size=2, max_size=2), pattern_st,
                        st.sampled_from([256, 1024, 2048]), st.sampled_from([256, 1024]),
                        st.sampled_from([2, 4]),
                        st.lists(st.sampled_from(SCHEDS), min_size=1, max_size=2, unique=True),
                        st.sampled_from(["uniform", "per-stage"]))


def _options(gbs, scheds, tp_mode, pruning):
    return SearchOptions(global_batch_size=gbs, seq_length=128, schedules=tuple(scheds),
                         pruning=pruning, tp_mode=tp_mode, micro_batch_sizes=(1, 2),
                         warmup_samples=20, type_order="any", workers=1)


def _run(inst, pruning):
    types, pattern, dff, mff, gbs, scheds, tp_mode = inst
    cluster, model = make_instance(types, pattern, dff, mff)
    try:
        return search_plan(cluster, model, _options(gbs, scheds, tp_mode, pruning))
    except InfeasibleError:
        return None


def _brute_force(inst):
    """Every configuration, every option sequence, every composition of the layers; a plan
    counts when every stage fits its memory as ``CostModel.stage_costs`` (per kind) says."""
    types, pattern, dff, mff, gbs, scheds, tp_mode = inst
    cluster, model = make_instance(types, pattern, dff, mff)
    cm = CostModel(cluster, model, None, seq_length=128)
    assert cm.per_kind
    ctx = SearchContext(cm)
    best = math.inf
    L = model.num_layers
    for cfg in enumerate_configs(cm, _options(gbs, scheds, tp_mode, "none")):
        n = cfg.num_stages
        assert cfg.virtual_stages == 1
        for opts in itertools.product(range(len(cfg.options)), repeat=n):
            types_ = [cfg.options[o][0] for o in opts]
            tps = [cfg.options[o][1] for o in opts]
            for layers in layer_splits(L, n):
                try:
                    stages, _, _ = cm.stage_costs(
                        stage_types=types_, stage_tps=tps, layers=layers, dp=cfg.dp,
                        micro_batch_size=cfg.micro_batch_size,
                        num_microbatches=cfg.num_microbatches, schedule=cfg.schedule,
                        virtual_stages=1, ep=cfg.ep)
                except PoseidonError:
                    break         # the devices do not hold these options
                if any(s.memory_bytes > s.memory_capacity_bytes for s in stages):
                    continue
                best = min(best, ctx.evaluate(cfg, list(opts), layers))
    return best


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(instance_st)
def test_mixed_safe_exhaustive_and_brute_force_agree(inst):
    expected = _brute_force(inst)
    exact = _run(inst, "none")
    safe = _run(inst, "safe")
    if math.isinf(expected):
        assert exact is None and safe is None
        return
    assert exact is not None and safe is not None
    assert exact.predicted_iteration_time_ms == pytest.approx(expected, rel=1e-9)
    assert safe.predicted_iteration_time_ms == pytest.approx(expected, rel=1e-9)
    for plan in (exact, safe):
        assert plan.search["exhaustive"]
        for s in plan.stages:
            assert s.memory_bytes <= s.memory_capacity_bytes


@pytest.mark.parametrize("scheds", [("1f1b",), ("eager-1f1b", "gpipe")])
def test_deepseek_like_first_stage_holds_the_dense_layers(scheds):
    """3 dense + 5 MoE layers (DeepSeek-V3's pattern at CPU size, MoE layers larger and
    slower): the search equals brute force, is no slower than the plan priced at the
    envelope, and its first stage costs what its dense layers cost (less than at the
    envelope)."""
    inst = ([(100.0, 2, 2, 1.0), (150.0, 2, 1, 1.0)], [0, 0, 0, 1, 1, 1, 1, 1], 256, 1024, 4,
            scheds, "uniform")
    expected = _brute_force(inst)
    plan = _run(inst, "safe")
    assert plan.predicted_iteration_time_ms == pytest.approx(expected, rel=1e-9)
    cluster, model = make_instance(*inst[:4])
    dense, moe = model.layer_kinds
    assert dense.forward_flops(1, 128) < moe.forward_flops(1, 128)
    env = CostModel(cluster, model, None, seq_length=128, layer_kinds="envelope")
    per = CostModel(cluster, model, None, seq_length=128)
    names = list(cluster.type_names)
    kw = dict(stage_types=[names.index(s.device_type) for s in plan.stages],
              stage_tps=[s.tp for s in plan.stages], layers=[s.layers for s in plan.stages],
              dp=plan.dp, micro_batch_size=plan.micro_batch_size,
              num_microbatches=plan.num_microbatches, schedule=plan.schedule,
              virtual_stages=1)
    a, e = per.stage_costs(**kw)[0], env.stage_costs(**kw)[0]
    if plan.stages[0].layers <= 3:       # only dense layers on stage 0
        assert a[0].forward_ms < e[0].forward_ms
        assert [p.key.layer_kind for p in a[0].provenance][:1] == ["decoder"]
        assert len([p for p in a[0].provenance if p.key.layer_kind == "decoder"]) == 1
    assert sum(s.forward_ms for s in a) < sum(s.forward_ms for s in e)


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(instance_st, st.integers(0, 10_000))
def test_mixed_bounds_below_every_completion_and_costs_match_python(inst, seed):
    """Random plans of mixed instances through the search's own cost and bound code
    (``replay``): its time is the Python cost path's, every stage bound g is below it, and
    ``bound_parts``' two parts stay below g and monotone in the stage's layers."""
    import random

    from poseidon_plugin.search import _search

    types, pattern, dff, mff, gbs, scheds, tp_mode = inst
    cluster, model = make_instance(types, pattern, dff, mff)
    ctx = SearchContext(CostModel(cluster, model, None, seq_length=128))
    cfgs = list(enumerate_configs(ctx.cm, _options(gbs, scheds, tp_mode, "none")))
    rng = random.Random(seed)
    for _ in range(5):
        if not cfgs:
            return
        cfg = rng.choice(cfgs)
        a = ctx.random_assignment(cfg, rng)
        if a is None:
            continue
        assert ctx.fits(cfg, *a)
        trace, T = ctx.replay(cfg, *a)
        assert T == pytest.approx(ctx.evaluate(cfg, *a), rel=1e-9)
        for g in trace:
            assert g <= T * (1 + 1e-9), (cfg, a, trace, T)
        opts, lay = a
        inst_ = ctx.instance(cfg, pruning="none", blocks=False)
        for x in range(cfg.num_stages - 1):
            rows = _search.bound_parts(inst_, opts, lay, x)
            for l, g, inc, low in rows:
                assert inc <= g * (1 + 1e-12) and low <= g * (1 + 1e-12)
            for (_, _, i1, w1), (_, _, i2, w2) in zip(rows, rows[1:]):
                assert i2 >= i1 * (1 - 1e-12) and w2 <= w1 * (1 + 1e-12)


def test_memory_limits_from_the_stages_first_layer():
    """The memory limit of a stage is its first layer's (``lmax_from``): one more layer from
    there does not fit, and ``lmax`` (what the bounds read) is the maximum over the starts
    stage x can have (x .. L - (N - x))."""
    inst = ([(100.0, 2, 2, 1.0), (150.0, 2, 1, 1.0)], [0, 0, 0, 1, 1, 1, 1, 1], 256, 1024, 4,
            ("1f1b",), "uniform")
    cluster, model = make_instance(*inst[:4])
    ctx = SearchContext(CostModel(cluster, model, None, seq_length=128))
    cfg = next(c for c in enumerate_configs(ctx.cm, _options(4, ("1f1b",), "uniform", "none"))
               if c.num_stages == 2 and c.dp == 1)
    frm = ctx.lmax_from(cfg)
    assert frm is not None and frm.shape == (len(cfg.options), 2, model.num_layers + 1)
    # the limits never grow as the stage starts later on MoE layers only, and lmax is their max
    L = model.num_layers
    assert (ctx.lmax(cfg) == [[frm[o, x, x:L - (2 - x) + 1].max() for x in range(2)]
                              for o in range(len(cfg.options))]).all()
    for o in range(len(cfg.options)):
        for x in range(2):
            row = frm[o, x]
            for a in range(model.num_layers):
                if row[a] < min(model.num_layers - 1, model.num_layers - a):   # memory did
                    assert ctx.cm.stage_memory_bytes(
                        layers=row[a] + 1, stage=x, num_stages=2, tp=cfg.options[o][1],
                        dp=cfg.dp, micro_batch_size=cfg.micro_batch_size,
                        num_microbatches=cfg.num_microbatches, schedule=cfg.schedule,
                        virtual_stages=1, type_index=cfg.options[o][0],
                        kind_counts=model.kind_counts_in(a, a + row[a] + 1)) \
                        > ctx.cm.capacity_bytes[cfg.options[o][0]]
