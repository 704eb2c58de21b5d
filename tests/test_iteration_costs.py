"""The whole iteration in the search's costs: the measured optimizer step per stage.

Rule (costs.py): O_s = the stage's gradient bytes x the type's measured optimizer ms per gradient
byte (decoder record ``optimizer_ms`` / its gradient bytes); the simulator's post-pipeline term
R_s = DP all-reduce A_s + O_s; iteration = max_s (last backward of s + R_s).
"""

from __future__ import annotations

import itertools
import math

import pytest

from poseidon_plugin.cluster import load_cluster
from poseidon_plugin.costs import CostModel, simulator_arrays
from poseidon_plugin.errors import PoseidonError
from poseidon_plugin.model import get_model
from poseidon_plugin.plan import Plan
from poseidon_plugin.profiles import LayerProfile, ProfileDB, ProfileKey, lookup_profile
from poseidon_plugin.search import SearchContext, SearchOptions, enumerate_configs, search_plan
from poseidon_plugin.simulator import iteration_time_ms
from poseidon_plugin.training import TrainingSetup
from test_search import layer_splits

SMALL = "examples/clusters/small-two-type.yaml"
TINY = "examples/models/tiny-gpt.yaml"
SEQ = 128
OPT_MS = {"fast": 0.5, "slow": 2.0}     # optimizer ms per decoder layer on one device (tp 1)


def measured_db(cluster, model, opt_ms=OPT_MS, tps=(1, 2, 4), mbs=(1, 2, 4, 8)) -> ProfileDB:
    """Measured decoder records = the estimator's times, plus an optimizer step per layer that
    shrinks with TP (a device holds 1/tp of the layer's parameters)."""
    db = ProfileDB(None)
    for name in cluster.type_names:
        for tp in tps:
            for b in mbs:
                key = ProfileKey(name, "decoder", tp, b, SEQ, model.signature())
                est = lookup_profile(None, cluster, model, key)
                db.put(LayerProfile(key, est.forward_ms, est.backward_ms, est.activation_bytes,
                                    est.param_bytes, "measured", optimizer_ms=opt_ms[name] / tp))
    return db


@pytest.fixture(scope="module")
def setup():
    cluster, model = load_cluster(SMALL), get_model(TINY)
    return cluster, model, measured_db(cluster, model)


def test_optimizer_scales_with_the_stages_gradient_bytes(setup):
    cluster, model, db = setup
    cm = CostModel(cluster, model, db, seq_length=SEQ)
    stages, _, _ = cm.stage_costs(stage_types=[0, 1], stage_tps=[1, 2], layers=[3, 5], dp=2,
                                  micro_batch_size=1, num_microbatches=4, schedule="1f1b",
                                  virtual_stages=1)
    fast = cm.layer_costs(0, 1, 1)
    slow = cm.layer_costs(1, 2, 1)
    per_byte_fast = OPT_MS["fast"] / fast.grad_bytes
    per_byte_slow = OPT_MS["slow"] / 2 / slow.grad_bytes
    assert stages[0].optimizer_ms == pytest.approx(
        (3 * fast.grad_bytes + fast.embedding_grad_bytes) * per_byte_fast, rel=1e-12)
    assert stages[1].optimizer_ms == pytest.approx(
        (5 * slow.grad_bytes + slow.output_grad_bytes) * per_byte_slow, rel=1e-12)
    # decoder layers alone: exactly the measured per-layer optimizer step
    assert 3 * fast.grad_bytes * per_byte_fast == pytest.approx(3 * OPT_MS["fast"])
    _, _, _, _, R = simulator_arrays(stages, 1)
    assert list(R) == [st.allreduce_ms + st.optimizer_ms for st in stages]


def test_no_measured_optimizer_adds_nothing():
    cluster, model = load_cluster(SMALL), get_model(TINY)
    cm = CostModel(cluster, model, None, seq_length=SEQ)
    stages, _, _ = cm.stage_costs(stage_types=[0, 1], stage_tps=[1, 1], layers=[4, 4], dp=2,
                                  micro_batch_size=1, num_microbatches=4, schedule="1f1b",
                                  virtual_stages=1)
    assert all(st.optimizer_ms == 0.0 for st in stages)


def test_single_stage_iteration_is_compute_then_allreduce_then_optimizer(setup):
    """Reference by hand: one stage, M micro-batches back to back, then A + O."""
    cluster, model, db = setup
    cm = CostModel(cluster, model, db, seq_length=SEQ)
    m = 4
    stages, _, _ = cm.stage_costs(stage_types=[0], stage_tps=[1], layers=[model.num_layers],
                                  dp=2, micro_batch_size=1, num_microbatches=m,
                                  schedule="1f1b", virtual_stages=1)
    st = stages[0]
    assert st.optimizer_ms > 0 and st.allreduce_ms > 0
    F, B, Pf, Pb, R = simulator_arrays(stages, 1)
    got = iteration_time_ms(F, B, Pf, Pb, R, m, "1f1b", 1, engine=True)
    assert got == pytest.approx(m * (st.forward_ms + st.backward_ms) + st.allreduce_ms
                                + st.optimizer_ms, rel=1e-12)


def test_two_stage_iteration_adds_each_stages_post_pipeline_work(setup):
    """1F1B, N=2, M=2 by hand (warm-up w = N-1-s): stage 0 runs F0 F1 B0 B1, stage 1 F0 B0 F1 B1
    (zero-time sends); iteration = max(end_0 + R_0, end_1 + R_1)."""
    f, b = (1.0, 2.0), (2.0, 4.0)
    r = (5.0, 0.5)
    # stage 0: F0 [0,1] F1 [1,2]; stage 1: F0 [1,3] B0 [3,7] F1 [7,9] B1 [9,13]
    # stage 0: B0 after stage 1's B0 (7) -> [7,9]; B1 after 13 -> [13,15]
    want = max(15.0 + r[0], 13.0 + r[1])
    assert iteration_time_ms(list(f), list(b), [0.0], [0.0], list(r), 2, "1f1b") == want
    # the optimizer moved into R changes the answer exactly by the rule
    r2 = (0.5, 5.0)
    assert iteration_time_ms(list(f), list(b), [0.0], [0.0], list(r2), 2, "1f1b") == \
        max(15.0 + r2[0], 13.0 + r2[1])


def _brute_force(cluster, model, db, gbs, training=None):
    cm = CostModel(cluster, model, db, seq_length=SEQ, training=training)
    ctx = SearchContext(cm)
    best = math.inf
    opts_ = SearchOptions(global_batch_size=gbs, seq_length=SEQ, schedules=("1f1b",),
                          micro_batch_sizes=(1, 2), max_virtual_stages=1, tp_degrees=(1, 2))
    for cfg in enumerate_configs(cm, opts_):
        n, L = cfg.num_stages, model.num_layers
        for opts in itertools.product(range(len(cfg.options)), repeat=n):
            for layers in layer_splits(L, n):
                try:
                    stages, _, _ = cm.stage_costs(
                        stage_types=[cfg.options[o][0] for o in opts],
                        stage_tps=[cfg.options[o][1] for o in opts], layers=layers, dp=cfg.dp,
                        micro_batch_size=cfg.micro_batch_size,
                        num_microbatches=cfg.num_microbatches, schedule=cfg.schedule,
                        virtual_stages=1)
                except PoseidonError:
                    continue
                if any(s.memory_bytes > s.memory_capacity_bytes for s in stages):
                    continue
                best = min(best, ctx.evaluate(cfg, list(opts), layers))
    return best


SETUPS = {"ddp": TrainingSetup(),
          "distributed-optimizer": TrainingSetup(distributed_optimizer=True),
          # tiny buckets, so the tiny model's stage 0 has several and the overlap shows
          "overlap": TrainingSetup(overlap_grad_reduce=True, ddp_bucket_size=50_000),
          "distributed-overlap": TrainingSetup(distributed_optimizer=True,
                                               overlap_grad_reduce=True,
                                               overlap_param_gather=True,
                                               ddp_bucket_size=50_000)}


@pytest.mark.parametrize("setup_name", list(SETUPS))
@pytest.mark.parametrize("opt_ms", [{"fast": 0.5, "slow": 2.0}, {"fast": 40.0, "slow": 1.0}])
def test_search_with_optimizer_costs_is_exact(opt_ms, setup_name):
    """The Cython search adds the same term (build_plan checks it against the Python path) and
    still finds the brute-force optimum; a large optimizer step changes the plan's time."""
    cluster, model = load_cluster(SMALL), get_model(TINY)
    db = measured_db(cluster, model, opt_ms)
    setup = SETUPS[setup_name]
    opts = SearchOptions(global_batch_size=8, seq_length=SEQ, schedules=("1f1b",),
                         micro_batch_sizes=(1, 2), max_virtual_stages=1, tp_degrees=(1, 2),
                         workers=1, pruning="none", training=setup)
    plan = search_plan(cluster, model, opts, db)
    assert plan.predicted_iteration_time_ms == pytest.approx(
        _brute_force(cluster, model, db, 8, setup), rel=1e-9)
    assert all(st.optimizer_ms > 0 for st in plan.stages)
    without = search_plan(cluster, model, opts, measured_db(cluster, model,
                                                            {"fast": 0.0, "slow": 0.0}))
    assert plan.predicted_iteration_time_ms > without.predicted_iteration_time_ms


def test_distributed_optimizer_shards_the_step_and_splits_the_dp_sync(setup):
    """With --use-distributed-optimizer a DP rank reduce-scatters the gradients, updates its 1/d
    shard and all-gathers the parameters (bf16: half the fp32 gradients' bytes): by hand from the
    plain-DDP stage, for d = 1 (nothing changes), 2 and 4."""
    from poseidon_plugin.placement import ring_gbps

    cluster, model, db = setup
    plain = CostModel(cluster, model, db, seq_length=SEQ)
    sharded = CostModel(cluster, model, db, seq_length=SEQ,
                        training=TrainingSetup(distributed_optimizer=True))
    for dp in (1, 2, 4):
        kw = dict(stage_types=[0, 1], stage_tps=[1, 1], layers=[3, 5], dp=dp,
                  micro_batch_size=1, num_microbatches=4, schedule="1f1b", virtual_stages=1)
        a, places, _ = plain.stage_costs(**kw)
        b, _, _ = sharded.stage_costs(**kw)
        for s, (p, q) in enumerate(zip(a, b)):
            lc = plain.layer_costs(s, 1, 1)
            grad = [3, 5][s] * lc.grad_bytes + (lc.embedding_grad_bytes if s == 0
                                                else lc.output_grad_bytes)
            assert q.optimizer_ms == pytest.approx(p.optimizer_ms / dp, rel=1e-12)
            assert (q.forward_ms, q.backward_ms) == (p.forward_ms, p.backward_ms)
            if dp == 1:
                assert q.allreduce_ms == p.allreduce_ms == 0.0
                continue
            gbps, lat = ring_gbps(cluster, places[s]), cluster.links.latency_ms
            wire = (dp - 1) / dp * 8.0 / (gbps * 1e6)
            assert p.allreduce_ms == pytest.approx(2 * (dp - 1) * lat + 2 * wire * grad, rel=1e-12)
            # fp32 gradients reduce-scattered, bf16 parameters all-gathered
            assert q.allreduce_ms == pytest.approx(2 * (dp - 1) * lat + wire * grad * 1.5,
                                                   rel=1e-12)
            assert q.allreduce_ms < p.allreduce_ms
            assert q.memory_bytes < p.memory_bytes


@pytest.mark.parametrize("bucket", [20_000, 50_000, 120_000, 400_000])
@pytest.mark.parametrize("sharded", [False, True], ids=["ddp", "distributed-optimizer"])
def test_pruned_search_is_exact_under_the_dp_overlap(bucket, sharded):
    """Stage 0's exposed sync can shrink as its layers grow (more buckets, a longer backward
    to hide them): the bounds must not assume it grows. The pruned search (safe) finds the
    brute-force optimum for bucket sizes around a layer's parameters (tiny-gpt: ~0.4 M
    a layer)."""
    cluster, model = load_cluster(SMALL), get_model(TINY)
    db = measured_db(cluster, model, {"fast": 0.5, "slow": 2.0})
    setup = TrainingSetup(distributed_optimizer=sharded, overlap_grad_reduce=True,
                          overlap_param_gather=sharded, ddp_bucket_size=bucket)
    opts = SearchOptions(global_batch_size=8, seq_length=SEQ, schedules=("1f1b",),
                         micro_batch_sizes=(1, 2), max_virtual_stages=1, tp_degrees=(1, 2),
                         workers=1, pruning="safe", training=setup)
    plan = search_plan(cluster, model, opts, db)
    assert plan.predicted_iteration_time_ms == pytest.approx(
        _brute_force(cluster, model, db, 8, setup), rel=1e-9)


@pytest.mark.parametrize("setup_name", list(SETUPS))
def test_search_costs_equal_the_python_path_under_every_dp_setup(setup_name):
    """Random complete assignments with DP > 1 (1f1b and interleaved): the search's own cost
    code (replay) times each exactly as CostModel + the simulator do."""
    import random

    cluster, model = load_cluster(SMALL), get_model(TINY)
    cm = CostModel(cluster, model, measured_db(cluster, model), seq_length=SEQ,
                   training=SETUPS[setup_name])
    ctx = SearchContext(cm)
    opts_ = SearchOptions(global_batch_size=16, seq_length=SEQ,
                          schedules=("1f1b", "interleaved-1f1b"), micro_batch_sizes=(1, 2),
                          tp_degrees=(1, 2))
    rng = random.Random(7)
    checked = 0
    for cfg in enumerate_configs(cm, opts_):
        if cfg.dp < 2:
            continue
        for _ in range(3):
            a = ctx.random_assignment(cfg, rng)
            if a is None:
                continue
            stage_opts, layers = a
            _, t = ctx.replay(cfg, stage_opts, layers)
            assert t == pytest.approx(ctx.evaluate(cfg, stage_opts, layers), rel=1e-12)
            checked += 1
    assert checked > 20


def test_exposed_ms_by_hand():
    from poseidon_plugin.comm import ddp_buckets, exposed_ms
    assert exposed_ms(10.0, 100.0, 5) == 2.0          # compute-bound: the last bucket only
    assert exposed_ms(100.0, 40.0, 5) == 68.0         # comm-bound: all but 4/5 of the window
    assert exposed_ms(100.0, 40.0, 1) == 100.0        # one bucket: nothing overlaps
    assert exposed_ms(100.0, 0.0, 5) == 100.0         # no window
    assert ddp_buckets(2.07e9, 4) == 52               # max(4e7, 4e6) = 4e7 per bucket
    assert ddp_buckets(2.07e9, 64) == 33              # max(4e7, 6.4e7)
    assert ddp_buckets(2.07e9, 4, 1e9) == 3 and ddp_buckets(0, 4) == 1


def test_overlap_hides_only_stage_zeros_sync_in_a_non_interleaved_plan(setup):
    """megatron-core buckets only pipeline rank 0's first chunk: stage 0's sync (all-reduce,
    or reduce-scatter + all-gather) overlaps its last backward / first forward; stage 1 and
    every stage of an interleaved plan keep the full sync."""
    from poseidon_plugin.comm import ddp_buckets, exposed_ms

    cluster, model, db = setup
    for base, over in ((SETUPS["ddp"], SETUPS["overlap"]),
                       (SETUPS["distributed-optimizer"], SETUPS["distributed-overlap"])):
        plain = CostModel(cluster, model, db, seq_length=SEQ, training=base)
        olap = CostModel(cluster, model, db, seq_length=SEQ, training=over)
        for v, layers in ((1, [3, 5]), (2, [4, 4])):
            kw = dict(stage_types=[0, 1], stage_tps=[1, 1], layers=layers, dp=4,
                      micro_batch_size=1, num_microbatches=4,
                      schedule="1f1b" if v == 1 else "interleaved-1f1b", virtual_stages=v)
            a, _, _ = plain.stage_costs(**kw)
            b, _, _ = olap.stage_costs(**kw)
            assert b[1].allreduce_ms == a[1].allreduce_ms
            if v == 2:
                assert b[0].allreduce_ms == a[0].allreduce_ms
                continue
            lc = plain.layer_costs(0, 1, 1)
            params = (3 * lc.grad_bytes + lc.embedding_grad_bytes) / base.grad_bytes
            nb = ddp_buckets(params, 4, 50_000)
            assert nb > 1
            if not base.distributed_optimizer:
                assert b[0].allreduce_ms == exposed_ms(a[0].allreduce_ms, a[0].backward_ms, nb)
            else:   # split the plain figure back into its reduce-scatter and all-gather
                rs = a[0].allreduce_ms / 1.5            # fp32 gradients, bf16 parameters
                assert b[0].allreduce_ms == pytest.approx(
                    exposed_ms(rs, a[0].backward_ms, nb)
                    + exposed_ms(rs * 0.5, a[0].forward_ms, nb), rel=1e-9)
            assert b[0].allreduce_ms < a[0].allreduce_ms


def test_plan_json_carries_the_optimizer_step(setup):
    cluster, model, db = setup
    plan = search_plan(cluster, model, SearchOptions(global_batch_size=8, seq_length=SEQ,
                                                     workers=1), db)
    again = Plan.from_json(plan.to_json())
    assert [s.optimizer_ms for s in again.stages] == pytest.approx(
        [s.optimizer_ms for s in plan.stages], abs=1e-6)
    assert "optim ms" in plan.table()


def test_mfu_and_tflops_are_consistent(setup):
    """MFU = model TFLOP/s per device / the used devices' mean peak (<= 1 when the peak is the
    rate the layer reaches, as calibrate() sets it for emulated types)."""
    cluster, model, db = setup
    plan = search_plan(cluster, model, SearchOptions(global_batch_size=8, seq_length=SEQ,
                                                     workers=1), db)
    peaks = [cluster.device_types[s.device_type].peak_tflops for s in plan.stages
             for _ in range(s.tp * s.dp)]
    assert plan.mfu == pytest.approx(plan.model_tflops_per_device / (sum(peaks) / len(peaks)),
                                     rel=1e-9)


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved-1f1b"])
def test_plan_json_rederives_its_time_with_optimizer_costs(setup, schedule):
    """The plan JSON alone (per-chunk times, links, all-reduce + optimizer per stage) gives the
    predicted time back, with measured optimizer steps in the post-pipeline term."""
    cluster, model, db = setup
    plan = search_plan(cluster, model, SearchOptions(
        global_batch_size=16, seq_length=SEQ, workers=1, schedules=(schedule,)), db)
    again = Plan.from_json(plan.to_json())
    assert any(s.optimizer_ms > 0 for s in again.stages)
    assert again.rederived_iteration_time_ms() == pytest.approx(
        plan.predicted_iteration_time_ms, rel=1e-6, abs=1e-4)


def test_an_unprofiled_tp_degree_pays_the_measured_step_per_gradient_byte():
    """Only TP 1 measured: TP 2 (a device holds half the layer's parameters) is charged the TP-1
    record's optimizer time per gradient byte, not nothing; its provenance says so."""
    cluster, model = load_cluster(SMALL), get_model(TINY)
    db = measured_db(cluster, model, tps=(1,), mbs=(1,))
    cm = CostModel(cluster, model, db, seq_length=SEQ)
    tp1, tp2 = cm.layer_costs(0, 1, 1), cm.layer_costs(0, 2, 1)
    assert tp1.optimizer_source[0] == "measured"
    assert tp2.optimizer_source[0] == "calibrated"
    assert "fast decoder tp1 mbs1" in tp2.optimizer_source[1]
    assert tp2.optimizer_ms_per_grad_byte == pytest.approx(tp1.optimizer_ms_per_grad_byte)
    assert tp2.grad_bytes * tp2.optimizer_ms_per_grad_byte == pytest.approx(OPT_MS["fast"] / 2,
                                                                         rel=0.01)
    empty = CostModel(cluster, model, ProfileDB(None), seq_length=SEQ)
    assert empty.layer_costs(0, 2, 1).optimizer_source[0] == "none"
