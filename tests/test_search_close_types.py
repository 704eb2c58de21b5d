"""The bounds on close-matched device types (issue 30): the 1F1B window loops
(``_bounds._loop_windows``) and the later stages' type slots (``_bounds.later_excess``).

Close speeds are where a wrong bound shows least in the plan and most in the proof, so every
check here is against an independent reference: the exhaustive search (no bounds), a walk of
the schedule's op orders, or the simulated time of a random plan."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from poseidon_plugin.costs import CostModel, simulator_arrays
from poseidon_plugin.errors import InfeasibleError
from poseidon_plugin.search import SearchContext, SearchOptions, search_plan
from poseidon_plugin.search.instance import time_assignment
from poseidon_plugin.simulator.schedules import op_orders

from test_search import _configs, make_instance

# four types of close speed (within 10 %), small nodes so that N d t often uses every device
close_type_st = st.tuples(st.sampled_from([95.0, 100.0, 105.0]), st.sampled_from([1, 2]),
                          st.integers(1, 2), st.sampled_from([0.05, 0.1, 1.0]))
close_instance_st = st.tuples(st.lists(close_type_st, min_size=2, max_size=4),
                              st.integers(3, 8), st.sampled_from([4, 8, 16]),
                              st.sampled_from([("1f1b",), ("eager-1f1b",), ("1f1b", "gpipe")]),
                              st.sampled_from(["uniform", "per-stage"]))


def _cm(inst):
    types, layers, *_ = inst
    cluster, model = make_instance(types, layers, None)
    return CostModel(cluster, model, None, seq_length=128)


def _plans(inst, seed, tries=6):
    import random
    _, _, gbs, scheds, tp_mode = inst
    cm = _cm(inst)
    ctx = SearchContext(cm)
    cfgs = [c for c in _configs(ctx, gbs, tuple(scheds), tp_mode, max_virtual_stages=1)
            if c.virtual_stages == 1]
    rng = random.Random(seed)
    for _ in range(tries if cfgs else 0):
        cfg = rng.choice(cfgs)
        a = ctx.random_assignment(cfg, rng)
        if a is not None:
            yield cm, ctx, cfg, a


def _search(inst, pruning):
    types, layers, gbs, scheds, tp_mode = inst
    cluster, model = make_instance(types, layers, None)
    try:
        return search_plan(cluster, model, SearchOptions(
            global_batch_size=gbs, seq_length=128, schedules=tuple(scheds), pruning=pruning,
            tp_mode=tp_mode, micro_batch_sizes=(1, 2), warmup_samples=10, type_order="any",
            workers=1, runner_up=False))
    except InfeasibleError:
        return None


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(close_instance_st)
def test_close_types_bounded_search_matches_exhaustive(inst):
    """The bounded search returns the exhaustive search's optimum on close-speed types, and its
    proven lower bound never exceeds that optimum."""
    exact = _search(inst, "none")
    safe = _search(inst, "safe")
    if exact is None:
        assert safe is None
        return
    assert safe is not None
    assert safe.predicted_iteration_time_ms == pytest.approx(
        exact.predicted_iteration_time_ms, rel=1e-9)
    assert safe.lower_bound_ms <= exact.predicted_iteration_time_ms * (1 + 1e-9)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(close_instance_st)
def test_each_configuration_keeps_its_optimum_at_its_own_threshold(inst):
    """Per configuration: the bounded search with threshold = the configuration's exhaustive
    optimum finds a plan that fast (no bound, cut or memo record removed it), and with the
    threshold 0.1 % below it finds none."""
    _, _, gbs, scheds, tp_mode = inst
    ctx = SearchContext(_cm(inst))
    for cfg in _configs(ctx, gbs, tuple(scheds), tp_mode, max_virtual_stages=1):
        if cfg.num_stages > 6:
            continue
        exact = ctx.run(cfg, pruning="none", blocks=False, threshold_ms=math.inf)
        if exact.best is None:
            continue
        opt = exact.best[0]
        at = ctx.run(cfg, pruning="safe", blocks=False, threshold_ms=opt * (1 + 1e-9))
        assert at.best is not None and at.best[0] == pytest.approx(opt, rel=1e-9), cfg
        below = ctx.run(cfg, pruning="safe", blocks=False, threshold_ms=opt * (1 - 1e-3))
        assert below.best is None, cfg


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(close_instance_st, st.integers(0, 10_000))
def test_bound_under_the_plans_own_threshold_stays_below_its_time(inst, seed):
    """A random complete plan replayed with the search's threshold at its own simulated time
    T (the type-slot knapsack reads the threshold): every prefix bound is <= T."""
    for _, ctx, cfg, a in _plans(inst, seed):
        _, t = ctx.replay(cfg, *a)
        trace, t2 = ctx.replay(cfg, *a, threshold_ms=t)
        assert t2 == pytest.approx(t, rel=1e-12)
        assert max(trace) <= t * (1 + 1e-9), (cfg, a, trace, t)


def _window_paths_ms(F, B, Pf, Pb, R, orders):
    """Reference for ``_loop_windows``, walked op by op from the schedule's op orders: for
    every window of k = 2..8 adjacent stages j..x whose stage x starts its loop after
    micro-batch 0's round trip, n turns of B(x, m) -> ... -> B(j, m) -> F(j, m + a_j) -> ...
    -> F(x, m + a_j) -> (x's next op) while F(j, m + a_j) exists, each turn checked against
    the orders (the op after F(x, m + a_j) on stage x must be B(x, m + k)); then the exits
    the leaf bound holds (all three for a window ending at the last stage, the one through
    micro-batch q's round trip otherwise). Returns the longest such path (0 where no window
    qualifies)."""
    n = len(orders)
    m = len(orders[0]) // 2
    F, B = np.ravel(F), np.ravel(B)

    def idx(s, bwd, mb):
        return next(i for i, op in enumerate(orders[s])
                    if op.is_backward == bwd and op.microbatch == mb)

    def ops_from(s, i):
        return sum(B[s] if op.is_backward else F[s] for op in orders[s][i:])

    def tail(s):
        return max(sum(Pb[q] + B[q] for q in range(k, s)) + R[k] for k in range(s + 1))

    def rt(s):     # micro-batch round trip from stage s through the later stages
        return sum(F[q] + B[q] for q in range(s + 1, n)) + sum(
            Pf[q] + Pb[q] for q in range(s, n - 1))

    best = 0.0
    for x in range(1, n):
        a = [idx(s, True, 0) for s in range(n)]      # forwards before the first backward
        for k in range(2, 9):
            j = x - k + 1
            if j < 0 or any(a[i] != a[i + 1] + 1 for i in range(j, x)) or a[j] > m - 1:
                break
            head = sum(F[q] + Pf[q] for q in range(x))
            t = head + F[x] + rt(x)                   # at B(x, 0)
            mb, turns, ok = 0, 0, True
            while mb + a[j] <= m - 1:
                nxt = orders[x][idx(x, False, mb + a[j]) + 1]
                if not (nxt.is_backward and nxt.microbatch == mb + k):
                    ok = False                        # not the steady order: no such path
                    break
                t += sum(B[i] + F[i] for i in range(j, x + 1)) + sum(
                    Pf[i] + Pb[i] for i in range(j, x))
                mb += k
                turns += 1
            if not ok or turns == 0:
                continue
            q = mb - k + a[j]                         # the last turn ended with F(x, q)
            ea = ops_from(x, idx(x, True, mb)) + tail(x)
            eb = (B[x] + sum(B[i] for i in range(j + 1, x)) + sum(Pb[i] for i in range(j, x))
                  + ops_from(j, idx(j, True, mb)) + tail(j))
            ec = rt(x) + ops_from(x, idx(x, True, q)) + tail(x)
            # (a) and (b) enter the bound at node x only, where the later stages' round trip
            # is a lower bound; at the leaf they count for the windows that end at the last
            # stage, (c) for every window (carried with the exact round trips)
            best = max(best, t + (max(ea, eb, ec) if x == n - 1 else ec))
    return best


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(close_instance_st, st.integers(0, 10_000))
def test_leaf_bound_holds_every_window_loop(inst, seed):
    """At a complete 1F1B plan the search's bound is at least every window loop path (walked
    op by op above), and every such path is at most the simulated time."""
    for cm, ctx, cfg, a in _plans(inst, seed):
        if cfg.schedule not in ("1f1b", "eager-1f1b"):
            continue
        stages, _, _, T = time_assignment(cm, cfg, *a)
        F, B, Pf, Pb, R = simulator_arrays(stages, 1, 0.0)
        ref = _window_paths_ms(F, B, Pf, Pb, R, op_orders(
            cfg.schedule, cfg.num_stages, cfg.num_microbatches, 1))
        trace, t = ctx.replay(cfg, *a)
        assert t == pytest.approx(T, rel=1e-9)
        assert ref <= T * (1 + 1e-9), (cfg, a, ref, T)
        assert trace[-1] >= ref * (1 - 1e-9), (cfg, a, trace[-1], ref)


def test_close_4096_plan_leaf_bound_holds_its_three_stage_loop():
    """LLaMA-3 405B on ``close-4096.yaml``, the 32-stage plan of 10,713.8 ms: its critical path
    runs a loop over the adjacent 5-layer H200 stages 6-8 between two round trips; the leaf
    bound reaches 10,691 ms (10,629 ms with pairs only) and stays below the time."""
    from pathlib import Path

    from poseidon_plugin.cluster import load_cluster
    from poseidon_plugin.model import get_model
    from poseidon_plugin.search.driver import SearchDriver
    root = Path(__file__).resolve().parents[1]
    d = SearchDriver(load_cluster(root / "examples/clusters/close-4096.yaml"),
                     get_model("llama3-405b"),
                     SearchOptions(global_batch_size=1024, seq_length=4096, progress=False))
    cfg = next(c for c in d.configs if c.key == (0, 1, 1, 16, 8, 32))
    plan = ("3:1 3:2 2:3 2:3 2:3 2:3 0:5 0:5 0:5 0:4 0:5 0:5 2:4 2:4 0:5 0:5 1:4 1:4 2:4 2:4"
            + " 3:4" * 6 + " 1:4" * 6).split()
    opts = [int(p.split(":")[0]) for p in plan]
    layers = [int(p.split(":")[1]) for p in plan]
    trace, t = d.ctx.replay(cfg, opts, layers)
    assert t == pytest.approx(10_713.85, abs=0.01)
    assert 10_680 <= trace[-1] <= t * (1 + 1e-9)
    trace, _ = d.ctx.replay(cfg, opts, layers, threshold_ms=t)
    assert max(trace) <= t * (1 + 1e-9)
