"""Local search on complete plans (search/polish.py) and its phase in the search driver."""

from __future__ import annotations

import os
import random

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from poseidon_plugin.cluster import load_cluster
from poseidon_plugin.costs import CostModel
from poseidon_plugin.model import get_model
from poseidon_plugin.search import SearchContext, SearchOptions, enumerate_configs, search_plan
from poseidon_plugin.errors import PoseidonError
from poseidon_plugin.search.instance import time_assignment
from poseidon_plugin.search.polish import polish

from test_search import _configs, _run, instance_st, make_instance

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _context(inst):
    types, layers, gbs, scheds, tp_mode = inst
    cluster, model = make_instance(types, layers, None)
    ctx = SearchContext(CostModel(cluster, model, None, seq_length=128))
    return ctx, _configs(ctx, gbs, tuple(scheds), tp_mode, max_virtual_stages=3), gbs


def _fits(ctx, cfg, opts, layers) -> bool:
    """The plan fits, checked through the Python cost path (every stage's memory and
    placement re-derived) and the layer rules."""
    if sum(layers) != ctx.cm.model.num_layers or min(layers) < cfg.virtual_stages:
        return False
    try:
        stages = time_assignment(ctx.cm, cfg, opts, layers)[0]
    except PoseidonError:        # the devices of some type do not hold the stages
        return False
    return all(s.memory_bytes <= s.memory_capacity_bytes for s in stages)


def _resizer(cfgs):
    by_shape = {c.key[:-1] + (c.num_stages,): c for c in cfgs}
    return lambda c, n: by_shape.get(c.key[:-1] + (n,))


def _one_layer_neighbours(cfg, opts, layers):
    n = cfg.num_stages
    for i in range(n):
        for j in range(n):
            if i != j:
                moved = list(layers)
                moved[i] -= 1
                moved[j] += 1
                yield list(opts), moved


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(instance_st, st.integers(0, 10_000))
def test_polished_plans_fit_never_slow_down_and_end_at_a_local_optimum(inst, seed):
    """From random feasible plans: the polished plan fits, its time is what the independent
    Python cost path gives it and never above the start, and no one-layer move from it is
    faster by that independent path (a local optimum)."""
    ctx, cfgs, _ = _context(inst)
    rng = random.Random(seed)
    for _ in range(4 if cfgs else 0):
        cfg = rng.choice(cfgs)
        a = ctx.random_assignment(cfg, rng)
        if a is None:
            continue
        opts, layers = a
        t0 = ctx.evaluate(cfg, opts, layers)
        got = polish(ctx, cfg, opts, layers, t0, resize=_resizer(cfgs) if seed % 2 else None)
        assert got.complete
        assert got.time_ms <= t0 * (1 + 1e-12)
        assert (got.steps == 0) == (got.time_ms == t0)
        if seed % 2 == 0:
            assert got.cfg is cfg
        c = got.cfg
        assert c in cfgs
        assert _fits(ctx, c, got.opts, got.layers)
        assert ctx.evaluate(c, got.opts, got.layers) == pytest.approx(got.time_ms, rel=1e-9)
        for o, l in _one_layer_neighbours(c, got.opts, got.layers):
            if _fits(ctx, c, o, l):
                assert ctx.evaluate(c, o, l) >= got.time_ms * (1 - 1e-9), (o, l, got)


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(instance_st, st.integers(0, 10_000))
def test_a_plan_one_move_from_a_configuration_optimum_is_polished_to_it(inst, seed):
    """Best improvement: from the exhaustive optimum of a configuration moved by one layer or
    one type swap, the polish returns a plan exactly as fast as that optimum."""
    ctx, cfgs, _ = _context(inst)
    rng = random.Random(seed)
    tried = 0
    for cfg in rng.sample(cfgs, min(4, len(cfgs))):
        res = ctx.run(cfg, pruning="none", blocks=False, threshold_ms=float("inf"))
        if res.best is None:
            continue
        t_opt, opts, layers = res.best
        n = cfg.num_stages
        near = [(o, l) for o, l in _one_layer_neighbours(cfg, opts, layers)]
        for i in range(n):
            for j in range(i + 1, n):
                if opts[i] != opts[j]:
                    o = list(opts)
                    o[i], o[j] = o[j], o[i]
                    near.append((o, list(layers)))
        near = [(o, l) for o, l in near if _fits(ctx, cfg, o, l)]
        if not near:
            continue
        o, l = rng.choice(near)
        t = ctx.evaluate(cfg, o, l)
        got = polish(ctx, cfg, o, l, t)
        assert got.time_ms == pytest.approx(t_opt, rel=1e-9), (cfg, opts, layers, o, l, got)
        tried += 1
    if cfgs and tried == 0:
        return   # (no configuration with two or more distinct neighbours that fit)


def test_polish_keeps_to_the_allowed_space():
    """``allowed`` is honoured at every step: polished with a blocks-only predicate the plan
    stays in contiguous type blocks, and with "stage 0 keeps its option" (a predicate the free
    polish does break on this instance, so the check can fail) stage 0 keeps it."""
    cluster, model = make_instance([(150.0, 1, 2, 1.0), (50.0, 1, 2, 1.0), (80.0, 1, 2, 1.0)],
                                   8, None)
    ctx = SearchContext(CostModel(cluster, model, None, seq_length=128))
    cfg = next(c for c in enumerate_configs(ctx.cm, SearchOptions(
        global_batch_size=8, seq_length=128, schedules=("1f1b",), micro_batch_sizes=(1,)))
        if c.num_stages == 6)

    def blocks(opts):
        seq = [cfg.options[x][0] for x in opts]
        starts = [k for i, k in enumerate(seq) if i == 0 or k != seq[i - 1]]
        return len(starts) == len(set(starts))

    rng = random.Random(3)
    moved_first = kept = 0
    for _ in range(40):
        a = ctx.random_assignment(cfg, rng)
        if a is None:
            continue
        t = ctx.evaluate(cfg, *a)
        if blocks(a[0]):
            assert blocks(list(polish(ctx, cfg, *a, t, allowed=lambda c, o: blocks(o)).opts))
        first = a[0][0]
        got = polish(ctx, cfg, *a, t, allowed=lambda c, o: o[0] == first)
        assert got.opts[0] == first and got.time_ms <= t
        kept += 1
        moved_first += polish(ctx, cfg, *a, t).opts[0] != first
    assert kept and moved_first


def test_polish_stops_at_its_cap_with_the_best_plan_so_far():
    cluster, model = make_instance([(150.0, 1, 2, 1.0), (50.0, 1, 2, 1.0)], 8, None)
    ctx = SearchContext(CostModel(cluster, model, None, seq_length=128))
    cfg = next(c for c in enumerate_configs(ctx.cm, SearchOptions(
        global_batch_size=8, seq_length=128, schedules=("1f1b",), micro_batch_sizes=(1,)))
        if c.num_stages == 4)
    opts = [cfg.options.index((1, 1))] * 2 + [cfg.options.index((0, 1))] * 2
    layers = [5, 1, 1, 1]       # the slow type first with the most layers: far from good
    t = ctx.evaluate(cfg, opts, layers)
    capped = polish(ctx, cfg, opts, layers, t, max_evals=3)
    assert not capped.complete and capped.evals == 3 and capped.time_ms <= t
    full = polish(ctx, cfg, opts, layers, t)
    assert full.complete and full.time_ms < t and full.time_ms <= capped.time_ms


def test_grow_moves_add_a_stage_on_idle_devices_and_shrink_moves_remove_one():
    """Four devices of one type, 8 layers, 1F1B with 16 micro-batches: a two-stage plan
    leaves two devices idle; with ``resize`` the polish grows the pipeline (more stages, a
    faster plan in another configuration of the same schedule, micro-batch and DP). From a
    four-stage plan on an instance where the sends dominate, it shrinks."""
    cluster, model = make_instance([(100.0, 1, 4, 1.0)], 8, None)
    ctx = SearchContext(CostModel(cluster, model, None, seq_length=128))
    cfgs = [c for c in enumerate_configs(ctx.cm, SearchOptions(
        global_batch_size=16, seq_length=128, schedules=("1f1b",), micro_batch_sizes=(1,)))
        if c.dp == 1]
    two = next(c for c in cfgs if c.num_stages == 2)
    t = ctx.evaluate(two, [0, 0], [4, 4])
    fixed = polish(ctx, two, [0, 0], [4, 4], t)
    assert fixed.cfg is two and fixed.time_ms == t       # [4, 4] is the best 2-stage split
    grown = polish(ctx, two, [0, 0], [4, 4], t, resize=_resizer(cfgs))
    assert grown.cfg.num_stages > 2 and grown.time_ms < 0.9 * t, grown
    assert ctx.evaluate(grown.cfg, grown.opts, grown.layers) == pytest.approx(grown.time_ms)

    slow = make_instance([(100.0, 1, 4, 1.0)], 4, None)
    ctx = SearchContext(CostModel(slow[0], slow[1], None, seq_length=128))
    ctx.cm.latency_ms = 50.0        # every send costs more than the layers it spreads
    cfgs = [c for c in enumerate_configs(ctx.cm, SearchOptions(
        global_batch_size=16, seq_length=128, schedules=("1f1b",), micro_batch_sizes=(1,)))
        if c.dp == 1]
    four = next(c for c in cfgs if c.num_stages == 4)
    t = ctx.evaluate(four, [0] * 4, [1] * 4)
    shrunk = polish(ctx, four, [0] * 4, [1] * 4, t, resize=_resizer(cfgs))
    assert shrunk.cfg.num_stages < 4 and shrunk.time_ms < t, shrunk


def test_search_reports_the_polish_and_never_returns_worse_than_it():
    for inst in [([(100.0, 2, 2, 1.0), (50.0, 2, 2, 1.0)], 6, 8, ["interleaved-1f1b"], "uniform"),
                 ([(150.0, 1, 2, 1.0), (80.0, 2, 1, 1.0), (50.0, 1, 2, 0.1)], 6, 4,
                  ["1f1b", "eager-1f1b"], "per-stage")]:
        exact = _run(inst, "none")
        got = _run(inst, "safe")
        s = got.search
        assert s["polished_plans"] >= 1 and s["polish_evals"] >= 1
        assert got.predicted_iteration_time_ms <= s["polished_best_ms"] <= s["constructed_best_ms"]
        assert got.predicted_iteration_time_ms == pytest.approx(exact.predicted_iteration_time_ms)
        assert exact.search["polished_plans"] == 0    # the exhaustive search does not polish


def test_polish_evens_out_the_interleaved_split_of_the_70b_frontier_construction():
    """LLaMA-3 70B on examples/clusters/scale-10240.yaml, the configuration the frontier
    benchmark's plan comes from (interleaved, V = 2, dp 64, tp 8, 16 stages): its constructed
    plan gives most slow stages 3 layers (chunks of 2 and 1); the polish reaches a plan more
    than 5 % faster (measured 1,851.5 -> 1,733.3 ms)."""
    from poseidon_plugin.search.construct import construct_plan
    cluster = load_cluster(os.path.join(ROOT, "examples", "clusters", "scale-10240.yaml"))
    cm = CostModel(cluster, get_model("llama3-70b"), None, seq_length=4096)
    ctx = SearchContext(cm)
    cfg = next(c for c in enumerate_configs(cm, SearchOptions(
        global_batch_size=1024, seq_length=4096, schedules=("interleaved-1f1b",),
        micro_batch_sizes=(1,), tp_degrees=(8,)))
        if c.virtual_stages == 2 and c.dp == 64 and c.num_stages == 16)
    t, opts, layers = construct_plan(ctx, cfg)
    got = polish(ctx, cfg, opts, layers, t)
    assert got.cfg is cfg and got.time_ms < 0.95 * t, (t, got)
    assert ctx.evaluate(cfg, got.opts, got.layers) == pytest.approx(got.time_ms, rel=1e-9)
    slow = [l for o, l in zip(got.opts, got.layers) if cfg.options[o][0] != 0]
    assert sum(l % 2 for l in slow) < sum(l % 2 for o, l in zip(opts, layers)
                                          if cfg.options[o][0] != 0)


def test_the_rest_of_construction_and_polish_waits_for_a_large_tree(monkeypatch):
    """Before the tree the search constructs at most CONSTRUCT_PLANS plans; the rest of the
    construction and the polish run only once the tree has searched DEFER_NODES nodes (a
    count, so a small search's statistics stay reproducible). The plan is the same either
    way, and the exhaustive search's."""
    import poseidon_plugin.search.driver as drv
    inst = ([(150.0, 1, 4, 1.0), (80.0, 1, 4, 1.0), (50.0, 1, 4, 0.5)], 10, 8,
            ["1f1b", "eager-1f1b"], "uniform")
    quick = _run(inst, "safe")
    again = _run(inst, "safe")
    monkeypatch.setattr(drv, "DEFER_NODES", 0)
    full = _run(inst, "safe")
    exact = _run(inst, "none")
    q, f = quick.search, full.search
    assert q["constructed_plans"] <= drv.CONSTRUCT_PLANS < f["constructed_plans"]
    assert not q["statistics_depend_on_timing"] and f["statistics_depend_on_timing"]
    drop = ("seconds", "first_plan_s", "runner_up_s")
    assert ({k: v for k, v in q.items() if k not in drop}
            == {k: v for k, v in again.search.items() if k not in drop})
    strip = lambda p: {k: v for k, v in p.to_dict().items() if k != "search"}
    assert strip(quick) == strip(full) == strip(exact)
