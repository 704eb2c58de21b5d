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

SCHEDS = ("1f1b", "eager-1f1b", "gpipe", "interleaved-1f1b")


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
                         warmup_samples=20, type_order="any", workers=1,
                         max_virtual_stages=2)


def _run(inst, pruning):
    types, pattern, dff, mff, gbs, scheds, tp_mode = inst
    cluster, model = make_instance(types, pattern, dff, mff)
    try:
        return search_plan(cluster, model, _options(gbs, scheds, tp_mode, pruning))
    except InfeasibleError:
        return None


def _brute_force(inst):
    """Every configuration, every option sequence, every composition of the layers (>= V
    per stage); a plan counts when every stage fits its memory as ``CostModel.stage_costs``
    (per kind, each chunk's layers in Megatron's chunk-major layout) says. The configurations
    are those of the model without its kinds (``layer_kinds="envelope"``: interleaving
    included whatever the search's enumeration does with several kinds)."""
    types, pattern, dff, mff, gbs, scheds, tp_mode = inst
    cluster, model = make_instance(types, pattern, dff, mff)
    cm = CostModel(cluster, model, None, seq_length=128)
    assert cm.per_kind
    ctx = SearchContext(cm)
    best = math.inf
    L = model.num_layers
    env = CostModel(cluster, model, None, seq_length=128, layer_kinds="envelope")
    for cfg in enumerate_configs(env, _options(gbs, scheds, tp_mode, "none")):
        n, v = cfg.num_stages, cfg.virtual_stages
        assert not getattr(cfg, "chunk_totals", ())
        for opts in itertools.product(range(len(cfg.options)), repeat=n):
            types_ = [cfg.options[o][0] for o in opts]
            tps = [cfg.options[o][1] for o in opts]
            for layers in layer_splits(L, n, v):
                try:
                    stages, _, _ = cm.stage_costs(
                        stage_types=types_, stage_tps=tps, layers=layers, dp=cfg.dp,
                        micro_batch_size=cfg.micro_batch_size,
                        num_microbatches=cfg.num_microbatches, schedule=cfg.schedule,
                        virtual_stages=v, ep=cfg.ep)
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
    for _ in range(12):
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


# --------------------------------------------------------------------------- interleaved

ilv_instance_st = st.tuples(
    st.lists(type_st, min_size=2, max_size=2),
    st.lists(st.sampled_from([0, 1]), min_size=4, max_size=7).filter(lambda p: 0 in p and 1 in p),
    st.sampled_from([256, 1024, 2048]), st.sampled_from([256, 1024]), st.sampled_from([2, 4]),
    st.sampled_from([("interleaved-1f1b",), ("1f1b", "interleaved-1f1b")]),
    st.sampled_from(["uniform", "per-stage"]))


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(ilv_instance_st)
def test_mixed_interleaved_safe_exhaustive_and_brute_force_agree(inst):
    """Interleaving on a model of several kinds (issue 36, item 4): a chunk's layers are those
    Megatron's chunk-major layout gives it, so a stage's kinds depend on every stage's layers;
    pruned == exhaustive == brute force over every split (>= V layers per stage)."""
    expected = _brute_force(inst)
    exact = _run(inst, "none")
    safe = _run(inst, "safe")
    if math.isinf(expected):
        assert exact is None and safe is None
        return
    assert exact is not None and safe is not None
    assert exact.predicted_iteration_time_ms == pytest.approx(expected, rel=1e-9)
    assert safe.predicted_iteration_time_ms == pytest.approx(expected, rel=1e-9)
    assert safe.search["exhaustive"] and exact.search["exhaustive"]


# 2 + 1 dense, then MoE: interleaved, the dense layers land in two chunks of stage 0 and 1
ILV = ([(100.0, 2, 2, 1.0), (150.0, 2, 1, 1.0)], [0, 0, 1, 1, 1, 0, 1, 1], 256, 1024, 4,
       ("interleaved-1f1b",), "uniform")


def test_interleaved_plan_of_a_mixed_model_equals_brute_force():
    """A mixed model gets interleaved plans (before: none, 'interleaved-1f1b excluded'), the
    best one of the brute force, each (stage, chunk) costed by the kinds of its own layers."""
    expected = _brute_force(ILV)
    plan = _run(ILV, "safe")
    assert plan is not None and plan.virtual_stages == 2
    assert plan.predicted_iteration_time_ms == pytest.approx(expected, rel=1e-9)
    assert not any("interleaved-1f1b excluded" in line
                   for line in plan.search.get("excluded", ()))


def _megatron_chunks(plan, model):
    """Per PP rank, per virtual stage: megatron-core 0.19.0's (layer ids, MoE or not) of the
    plan's printed layout (``tests/mcore_layout_probe.py`` on the framework tree)."""
    import json
    import os
    import subprocess
    import sys

    from frameworks import ROOT, tree

    meg = tree("megatron-lm-core_v0.19.0")
    if not os.path.isdir(meg):
        pytest.skip(f"{meg} is not here: a user's clone; the workplace CI has it")
    layout = plan.megatron_args()[plan.megatron_args().index(
        "--pipeline-model-parallel-layout") + 1]
    req = dict(layout=layout, pp=plan.pp, num_layers=model.num_layers,
               moe_layer_freq=list(model.moe_layer_freq))
    out = subprocess.run([sys.executable, "-W", "ignore",
                          os.path.join(ROOT, "tests", "mcore_layout_probe.py"), json.dumps(req)],
                         capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": meg})
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["vpp"] == plan.virtual_stages
    return got["stages"]


@pytest.mark.integration   # torch / megatron-core
def test_interleaved_mixed_layout_is_megatrons_and_costs_its_kinds():
    """The printed ``--pipeline-model-parallel-layout`` of an interleaved mixed plan passes
    megatron-core 0.19.0's own parser (``PipelineParallelLayerLayout``, its
    ``validate_layer_layout`` and the ``TransformerConfig`` checks), and the layer specs
    megatron builds for each (PP rank, virtual stage) from ``moe_layer_freq`` are the kinds
    the plan costed: each chunk's forward / backward ms is the sum of those layers' own
    kinds' costs (plus the embedding / output layer), each stage's memory the memory of
    those kinds."""
    plan = _run(ILV, "safe")
    assert plan is not None and plan.virtual_stages == 2
    cluster, model = make_instance(*ILV[:4])
    cm = CostModel(cluster, model, None, seq_length=128)
    chunks = _megatron_chunks(plan, model)
    names = list(cm.type_names)
    dense, moe = (i for i, _ in enumerate(model.layer_kinds))
    seen = []
    for s, st_ in enumerate(plan.stages):
        k = names.index(st_.device_type)
        kcs = cm.kind_layer_costs(k, st_.tp, plan.micro_batch_size, plan.ep)
        counts = [0] * len(kcs)
        for c, chunk in enumerate(chunks[s]):
            assert len(chunk["ids"]) == st_.chunk_layers[c]
            seen += chunk["ids"]
            kinds = [moe if m else dense for m in chunk["moe"]]
            assert kinds == [model.layer_kind_of[i] for i in chunk["ids"]]
            fwd = sum(kcs[i].forward_ms for i in kinds)
            bwd = sum(kcs[i].backward_ms for i in kinds)
            if s == 0 and c == 0:
                fwd += kcs[0].embedding_forward_ms
                bwd += kcs[0].embedding_backward_ms
            if s == plan.pp - 1 and c == plan.virtual_stages - 1:
                fwd += kcs[0].output_forward_ms
                bwd += kcs[0].output_backward_ms
            assert st_.chunk_forward_ms[c] == pytest.approx(fwd, rel=1e-12)
            assert st_.chunk_backward_ms[c] == pytest.approx(bwd, rel=1e-12)
            for i in kinds:
                counts[i] += 1
        assert st_.memory_bytes == cm.stage_memory_bytes(
            layers=st_.layers, stage=s, num_stages=plan.pp, tp=st_.tp, dp=plan.dp,
            micro_batch_size=plan.micro_batch_size, num_microbatches=plan.num_microbatches,
            schedule=plan.schedule, virtual_stages=plan.virtual_stages, type_index=k,
            kind_counts=tuple(counts), ep=plan.ep)
    assert sorted(seen) == list(range(model.num_layers))
    # the layout puts the dense layers apart: a chunk after MoE layers holds one again
    assert any(chunks[s][1]["moe"] and not all(chunks[s][1]["moe"]) for s in range(plan.pp))


def test_an_interleaved_mixed_plan_is_kept_by_its_own_configuration():
    """A relaunch offered an interleaved mixed plan finds its configuration (the one of its
    chunk totals, not the first of its shape, where its layers cannot lie) and keeps it: the
    best plan itself, and the same plan with another split (4 + 4 layers: chunk totals 4, 4
    where the best plan's 5 + 3 have 5, 3)."""
    from dataclasses import replace as dc_replace

    types, pattern, dff, mff, gbs, scheds, tp_mode = ILV
    cluster, model = make_instance(types, pattern, dff, mff)
    first = _run(ILV, "safe")
    assert first.layers_per_stage == (5, 3)
    opts = dc_replace(_options(gbs, scheds, tp_mode, "safe"), keep_tolerance=0.2)
    again = search_plan(cluster, model, opts, previous=first)
    assert again.search["previous_plan"] == "kept"
    assert again.layers_per_stage == first.layers_per_stage
    other = dc_replace(first, stages=tuple(dc_replace(s, layers=4) for s in first.stages))
    again = search_plan(cluster, model, opts, previous=other)
    # found and timed (kept or, slower by more than the window, replaced), not unusable
    assert again.search["previous_plan"] in ("kept", "replaced"), again.search["previous_plan"]
    assert again.search["previous_ms"] > first.predicted_iteration_time_ms


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(2, 9), min_size=1, max_size=6), st.integers(2, 3), st.data())
def test_constructed_splits_match_their_configurations_chunk_totals(layers, v, data):
    """The construction's split of an interleaved mixed configuration has that
    configuration's chunk totals (or there is none) and the same layers; every vector
    ``chunk_total_vectors`` lists is the totals of some split (>= V layers per stage)."""
    from poseidon_plugin.search.configs import chunk_total_vectors, chunk_totals_of
    from poseidon_plugin.search.construct import _match_chunk_totals

    layers = [max(l, v) for l in layers]
    L, n = sum(layers), len(layers)
    vectors = chunk_total_vectors(L, n, v)
    assert chunk_totals_of(layers, v) in vectors
    reach = {chunk_totals_of(sp, v) for sp in layer_splits(L, n, v)} if L <= 24 else None
    if reach is not None:
        assert reach == set(vectors)
    loads = data.draw(st.lists(st.floats(0.5, 2.0), min_size=n, max_size=n))
    for totals in vectors:
        got = _match_chunk_totals(layers, loads, totals)
        if got is not None:
            assert chunk_totals_of(got, v) == totals and sum(got) == L and min(got) >= v
