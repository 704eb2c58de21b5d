"""Expert parallelism as a searched dimension (issue 29, item 4): the formulas (all-to-all,
expert-DP sync, expert optimizer step, per-EP memory) against hand-computed values, the search
against brute force on MoE instances at EP 1, 2 and 4, and the plan / flags / CLI carrying EP."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from poseidon_plugin import cli
from poseidon_plugin.comm import (alltoall_ms, dp_sync_ms, expert_alltoall_bytes,
                                  expert_optimizer_ms, expert_sync_ms)
from poseidon_plugin.costs import CostModel
from poseidon_plugin.errors import InfeasibleError, PoseidonError
from poseidon_plugin.memory import stage_memory
from poseidon_plugin.model import get_model, model_from_dict
from poseidon_plugin.plan import Plan
from poseidon_plugin.profiles import (LayerProfile, ProfileDB, ProfileKey, profile_from_record,
                                      profile_to_record)
from poseidon_plugin.search import SearchContext, SearchOptions, enumerate_configs, search_plan
from poseidon_plugin.search.configs import ep_candidates
from poseidon_plugin.training import TrainingSetup
from test_search import layer_splits, make_cluster


# --------------------------------------------------------------------------- formulas

def test_alltoall_bytes_and_time_by_hand():
    # b 2, s 1024, h 4096, top-8, TP 2 (tokens / 2 under SP), EP 4: 3/4 of the copies leave
    nbytes = expert_alltoall_bytes(2, 1024, 4096, 8, 2, 4)
    assert nbytes == 2 * 1024 / 2 * 8 * 4096 * 2 * 3 / 4 == 50_331_648
    assert expert_alltoall_bytes(2, 1024, 4096, 8, 2, 1) == 0.0
    # 400 Gbit/s: 50,331,648 x 8 / 4e8 ms + one latency
    assert alltoall_ms(nbytes, 400.0, 0.01) == pytest.approx(1.00663296 + 0.01, rel=1e-12)
    assert alltoall_ms(0.0, 400.0, 0.01) == 0.0


def test_expert_sync_and_optimizer_by_hand():
    # 1e9 gradient bytes over expert-DP = 8 / 2 = 4 ranks at 100 Gbit/s: ring all-reduce
    # 2 x 3 x 0.01 + 2 x 3/4 x 1e9 x 8 / 1e8
    assert expert_sync_ms(1e9, 5e8, 8, 2, 100.0, 0.01, False) == pytest.approx(120.06)
    # distributed optimizer: reduce-scatter of the gradients + all-gather of the parameters
    assert expert_sync_ms(1e9, 5e8, 8, 2, 100.0, 0.01, True) == pytest.approx(
        0.03 + 0.75 * 80 + 0.03 + 0.75 * 40)
    assert expert_sync_ms(1e9, 5e8, 4, 4, 100.0, 0.01, False) == 0.0     # expert-DP of 1
    assert expert_sync_ms(1e9, 5e8, 8, 1, 100.0, 0.01, False) == dp_sync_ms(
        1e9, 5e8, 8, 100.0, 0.01, False)
    # the step: sharded over dp / ep ranks (x ep / dp), else the whole
    assert expert_optimizer_ms(1e6, 1e-6, 8, 2, True) == pytest.approx(0.25)
    assert expert_optimizer_ms(1e6, 1e-6, 8, 2, False) == pytest.approx(1.0)


MOE = {"name": "tiny-moe", "num_layers": 4, "hidden_size": 256, "ffn_hidden_size": 512,
       "num_attention_heads": 8, "vocab_size": 1024, "seq_length": 128, "num_experts": 4,
       "moe_top_k": 2, "moe_ffn_hidden_size": 512}


def test_ep_candidates_follow_megatrons_rules():
    moe = model_from_dict(MOE)
    assert ep_candidates(moe, 8) == (1, 2, 4)        # divides DP and the 4 experts
    assert ep_candidates(moe, 6) == (1, 2)
    assert ep_candidates(moe, 8, (4,)) == (4,)
    dense = get_model("llama3-8b")
    assert ep_candidates(dense, 8) == (1,)


def test_memory_divides_the_experts_by_ep_by_hand():
    """Weights / gradients of the routed experts / (TP x EP); with the distributed optimizer
    the experts' state over dp / ep, the rest over dp; other parts unchanged."""
    model = model_from_dict(MOE)
    split = model.layer_param_split()
    assert split.expert > 0
    kw = dict(layers=3, stage=1, num_stages=3, tp=2, dp=4, micro_batch_size=1,
              seq_length=128, num_microbatches=4)
    for dist in (False, True):
        setup = TrainingSetup(distributed_optimizer=dist)
        m1 = stage_memory(model, **kw, setup=setup)
        m2 = stage_memory(model, **kw, setup=setup, ep=2)
        expert_dev_1 = 3 * split.expert / 2          # 3 layers, TP 2, EP 1
        expert_dev_2 = expert_dev_1 / 2
        assert m1.weights_bytes - m2.weights_bytes == pytest.approx(
            2 * (expert_dev_1 - expert_dev_2), abs=2)
        assert m1.gradients_bytes - m2.gradients_bytes == pytest.approx(
            4 * (expert_dev_1 - expert_dev_2), abs=2)
        if dist:
            # expert state 12 bytes / (dp / ep): the same per device at EP 1 and 2
            assert m1.optimizer_bytes == pytest.approx(m2.optimizer_bytes, abs=2)
        else:
            assert m1.optimizer_bytes - m2.optimizer_bytes == pytest.approx(
                12 * (expert_dev_1 - expert_dev_2), abs=2)
        assert m1.activations_bytes == m2.activations_bytes
        parts = m2.parts()
        assert parts["moe_layers"] == 3 and parts["moe_layers_bytes"] > 0
    with pytest.raises(PoseidonError):
        stage_memory(model, **kw, ep=3)          # EP must divide DP


def test_mixed_stage_memory_counts_dense_and_moe_layers_separately():
    model = model_from_dict({**MOE, "num_layers": 6, "first_k_dense_replace": 2})
    kinds = [k.name for k in model.layer_kinds]
    assert kinds == ["dense", "moe"]
    m = stage_memory(model, layers=4, stage=0, num_stages=2, tp=1, dp=2, micro_batch_size=1,
                     seq_length=128, num_microbatches=2, kind_counts=(2, 2), ep=2)
    parts = m.parts()
    assert parts["dense_layers"] == 2 and parts["moe_layers"] == 2
    assert 0 < parts["dense_layers_bytes"] < parts["moe_layers_bytes"]
    # the layers' parts are within the stage's weights + grads + optimizer + activations
    assert parts["dense_layers_bytes"] + parts["moe_layers_bytes"] <= (
        m.weights_bytes + m.gradients_bytes + m.optimizer_bytes + m.activations_bytes)
    dense = stage_memory(get_model("llama3-8b"), layers=4, stage=0, num_stages=2, tp=1, dp=2,
                         micro_batch_size=1, seq_length=128, num_microbatches=2)
    assert "dense_layers" not in dense.parts()      # a dense model's plan is unchanged


def _cluster(dpn=4, count=2):
    return make_cluster([(100.0, dpn, count, 80.0), (150.0, dpn, 1, 80.0)])


def test_layer_costs_add_the_alltoalls_and_split_the_gradients():
    cluster = _cluster()
    model = model_from_dict(MOE)
    cm = CostModel(cluster, model, None, seq_length=128)
    one = cm.layer_costs(0, 1, 2, 1)
    two = cm.layer_costs(0, 1, 2, 2)
    a2a = cm.expert_alltoall_ms(0, 1, 2, 2)
    # 2 x 128 tokens x 2 copies x 256 x 2 bytes x 1/2 over the intra-node link (TP x EP = 2
    # divides the 4-device nodes): 400 Gbit/s, latency 0.01
    assert a2a == pytest.approx(2 * 128 * 2 * 256 * 2 * 0.5 * 8 / 400e6 + 0.01)
    assert two.forward_ms == pytest.approx(one.forward_ms + 2 * a2a)
    assert two.backward_ms == pytest.approx(one.backward_ms + 2 * a2a)
    split = model.layer_param_split()
    assert two.expert_grad_bytes == pytest.approx(split.expert / 2 * 4)
    assert two.grad_bytes + split.expert * 4 == pytest.approx(one.grad_bytes)
    assert one.expert_grad_bytes == 0.0 and one.alltoall_ms == 0.0
    # an EP group wider than a node: the inter-node link (100 Gbit/s)
    cm2 = CostModel(_cluster(dpn=2), model, None, seq_length=128)
    assert cm2.ep_link_gbps(0, 1, 4) == 100.0 and cm2.ep_link_gbps(0, 1, 2) == 400.0


def _ring(nbytes: float, ranks: int, gbps: float, latency: float = 0.01) -> float:
    """A ring all-reduce (all-gather + reduce-scatter) of ``nbytes``, by hand."""
    return 2 * (ranks - 1) * latency + 2 * (ranks - 1) / ranks * nbytes * 8 / (gbps * 1e6)


def test_the_allgather_dispatcher_exchanges_the_tokens_over_tp_x_ep():
    """megatron-core's ``allgather`` dispatcher gathers every token of the TP x EP group (its
    hidden state, and one way its E routing probabilities) and reduce-scatters the experts'
    outputs, where ``alltoall`` moves the k copies: at EP 1 the TP exchange is b*s*(h + E/2)
    values, not k*b*s*h; at EP > 1 the layer pays the TP x EP exchange of ep*b*s*(h + E/2) on
    the EP group's link in place of the record's TP one, and no all-to-all."""
    cluster = _cluster()
    a2a = model_from_dict(MOE)
    ag = dataclasses.replace(a2a, moe_token_dispatcher_type="allgather")
    b, s, h, e, k = 2, 128, 256, 4, 2
    cm_a2a = CostModel(cluster, a2a, None, seq_length=s)
    cm_ag = CostModel(cluster, ag, None, seq_length=s)
    # EP 1, TP 2: the same compute, the routed exchange b*s*(h+E/2) against k*b*s*h (2 bytes)
    x, y = cm_ag.layer_costs(0, 2, b, 1), cm_a2a.layer_costs(0, 2, b, 1)
    shift = _ring(2 * b * s * (h + e / 2), 2, 400) - _ring(2 * k * b * s * h, 2, 400)
    assert x.forward_ms - y.forward_ms == pytest.approx(shift, rel=1e-9)
    assert x.backward_ms - y.backward_ms == pytest.approx(shift, rel=1e-9)
    # EP 2, TP 1: the exchange of 2*b*s*(h+E/2) over the 2 EP ranks (TP x EP = 2 divides the
    # 4-device nodes: the intra-node link), nothing of the record's to take off
    one, two = cm_ag.layer_costs(0, 1, b, 1), cm_ag.layer_costs(0, 1, b, 2)
    group = _ring(2 * 2 * b * s * (h + e / 2), 2, 400)
    assert two.forward_ms == pytest.approx(one.forward_ms + group, rel=1e-9)
    assert two.backward_ms == pytest.approx(one.backward_ms + group, rel=1e-9)
    assert two.alltoall_ms == pytest.approx(group / 2, rel=1e-9)
    # EP 2, TP 2: the TP x EP = 4 exchange less the record's TP-2 one
    one, two = cm_ag.layer_costs(0, 2, b, 1), cm_ag.layer_costs(0, 2, b, 2)
    delta = _ring(2 * 2 * b * s * (h + e / 2), 4, 400) - _ring(2 * b * s * (h + e / 2), 2, 400)
    assert two.forward_ms == pytest.approx(one.forward_ms + delta, rel=1e-9)
    # wider than a node (2-device nodes): the group on the inter-node link (100 Gbit/s)
    cm_wide = CostModel(_cluster(dpn=2), ag, None, seq_length=s)
    one, two = cm_wide.layer_costs(0, 2, b, 1), cm_wide.layer_costs(0, 2, b, 2)
    delta = _ring(2 * 2 * b * s * (h + e / 2), 4, 100) - _ring(2 * b * s * (h + e / 2), 2, 400)
    assert two.forward_ms == pytest.approx(one.forward_ms + delta, rel=1e-9)
    # the alltoall dispatcher's figures are unchanged: its all-to-all, twice each way
    assert cm_a2a.layer_costs(0, 1, b, 2).forward_ms == pytest.approx(
        cm_a2a.layer_costs(0, 1, b, 1).forward_ms + 2 * cm_a2a.expert_alltoall_ms(0, 1, 2, b))


def test_a_record_measured_at_the_plans_ep_wins():
    cluster = _cluster()
    model = model_from_dict(MOE)
    sig = model.signature()
    db = ProfileDB()
    for ep, fwd in ((1, 1.0), (2, 3.0)):
        db.put(LayerProfile(ProfileKey("T0", "decoder", 1, 1, 128, sig, ep=ep), fwd, 2 * fwd,
                            1000, 10_000, "measured"))
    cm = CostModel(cluster, model, db, seq_length=128)
    a2a = cm.expert_alltoall_ms(0, 1, 2, 1)
    assert cm.layer_costs(0, 1, 1, 2).forward_ms == pytest.approx(3.0 + 2 * a2a)
    assert cm.layer_costs(0, 1, 1, 4).forward_ms == pytest.approx(
        1.0 + 2 * cm.expert_alltoall_ms(0, 1, 4, 1))       # no EP-4 record: the EP-1 one
    assert cm.layer_costs(0, 1, 1, 1).forward_ms == 1.0
    # the record keeps its EP through JSON; an EP-1 record writes no "ep" (old DBs load)
    rec = profile_to_record(db.get(ProfileKey("T0", "decoder", 1, 1, 128, sig, ep=2)))
    assert rec["ep"] == 2 and profile_from_record(rec, "x").key.ep == 2
    rec1 = profile_to_record(db.get(ProfileKey("T0", "decoder", 1, 1, 128, sig)))
    assert "ep" not in rec1 and profile_from_record(rec1, "x").key.ep == 1


# --------------------------------------------------------------------------- search == brute force

def _moe_model(pattern, mff):
    data = {**MOE, "num_layers": len(pattern), "moe_ffn_hidden_size": mff}
    if 0 in pattern:
        data["moe_layer_freq"] = "[" + ",".join(str(v) for v in pattern) + "]"
    return model_from_dict(data)


def _options(gbs, scheds, pruning, eps=None, dist=False):
    return SearchOptions(global_batch_size=gbs, seq_length=128, schedules=tuple(scheds),
                         pruning=pruning, micro_batch_sizes=(1, 2), warmup_samples=20,
                         type_order="any", workers=1, expert_parallel=eps,
                         training=TrainingSetup(distributed_optimizer=dist))


def _brute_force(cluster, model, options):
    cm = CostModel(cluster, model, None, seq_length=128, training=options.training)
    ctx = SearchContext(cm)
    best = math.inf
    L = model.num_layers
    eps = set()
    for cfg in enumerate_configs(cm, options.replace(pruning="none")):
        n = cfg.num_stages
        v = cfg.virtual_stages
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
                    break
                if any(s.memory_bytes > s.memory_capacity_bytes for s in stages):
                    continue
                t = ctx.evaluate(cfg, list(opts), layers)
                if t < best:
                    best = t
                eps.add(cfg.ep)
    return best, eps


type_st = st.tuples(st.sampled_from([50.0, 100.0, 150.0]), st.sampled_from([2, 4]),
                    st.integers(1, 2), st.sampled_from([0.05, 0.3, 1.0]))
pattern_st = st.one_of(st.lists(st.just(1), min_size=2, max_size=4),
                       st.lists(st.sampled_from([0, 1]), min_size=2, max_size=5).filter(
                           lambda p: 0 in p and 1 in p))
ep_instance_st = st.tuples(st.lists(type_st, min_size=1, max_size=2), pattern_st,
                           st.sampled_from([256, 2048, 8192]), st.sampled_from([4, 8]),
                           st.lists(st.sampled_from(("1f1b", "eager-1f1b", "gpipe")),
                                    min_size=1, max_size=2, unique=True),
                           st.booleans())


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(ep_instance_st)
def test_ep_safe_exhaustive_and_brute_force_agree(inst):
    """MoE models (all MoE, or dense and MoE mixed) searched over EP 1, 2 and 4: the safe
    search, the exhaustive one and brute force through ``CostModel.stage_costs`` agree."""
    types, pattern, mff, gbs, scheds, dist = inst
    cluster, model = make_cluster(types), _moe_model(pattern, mff)
    expected, eps = _brute_force(cluster, model, _options(gbs, scheds, "none", dist=dist))
    got = {}
    for pruning in ("none", "safe"):
        try:
            got[pruning] = search_plan(cluster, model, _options(gbs, scheds, pruning,
                                                                dist=dist))
        except InfeasibleError:
            got[pruning] = None
    if math.isinf(expected):
        assert got["none"] is None and got["safe"] is None
        return
    for plan in got.values():
        assert plan is not None
        assert plan.predicted_iteration_time_ms == pytest.approx(expected, rel=1e-9)
        assert plan.ep in eps and plan.moe
        assert plan.rederived_iteration_time_ms() == pytest.approx(
            plan.predicted_iteration_time_ms, rel=1e-6)


mixed_ep_st = st.tuples(st.lists(type_st, min_size=1, max_size=2),
                        st.lists(st.sampled_from([0, 1]), min_size=2, max_size=5).filter(
                            lambda p: 0 in p and 1 in p),
                        st.sampled_from([256, 2048, 8192]), st.sampled_from([4, 8]),
                        st.lists(st.sampled_from(("1f1b", "eager-1f1b", "gpipe")),
                                 min_size=1, max_size=2, unique=True))


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(mixed_ep_st)
def test_per_kind_root_bound_below_each_configurations_optimum(inst):
    """Dense + MoE layers at EP 1, 2 and 4: the root bound, whose work bound sums each
    option's cheapest layers by the kinds' counts (a MoE layer's all-to-alls included), is at
    most every configuration's exhaustive optimum, and at least the bound that prices every
    layer at its cheapest kind."""
    from poseidon_plugin.search.configs import _work_base, root_bound
    types, pattern, mff, gbs, scheds = inst
    cluster, model = make_cluster(types), _moe_model(pattern, mff)
    cm = CostModel(cluster, model, None, seq_length=128)
    assert cm.per_kind
    ctx = SearchContext(cm)
    L = model.num_layers
    for cfg in enumerate_configs(cm, _options(gbs, scheds, "none")):
        costs = ctx.option_costs(cfg)
        j, minfb = math.ceil(L / cfg.num_stages), costs.min_layer_fb
        assert _work_base(cm, cfg, costs) >= max(
            cfg.num_microbatches * j * minfb, L * minfb) * (1 - 1e-12)
        exact = ctx.run(cfg, pruning="none", blocks=False, threshold_ms=math.inf).best
        if exact is not None:
            assert root_bound(cm, cfg) <= exact[0] * (1 + 1e-9), cfg


def test_per_kind_work_bound_prices_the_moe_layers():
    """A stage holding more layers than there are dense ones holds a MoE layer: its all-to-alls
    (EP 4 over a slow link) enter the work bound, which the cheapest-kind price missed."""
    from poseidon_plugin.search.configs import _work_base
    cluster, model = make_cluster([(100.0, 4, 2, 0.05)]), _moe_model([0, 1, 1, 1], 8192)
    cm = CostModel(cluster, model, None, seq_length=128)
    ctx = SearchContext(cm)
    cfgs = [c for c in enumerate_configs(cm, _options(8, ("gpipe",), "none"))
            if c.num_stages == 1 and c.ep == 4]
    assert cfgs
    for cfg in cfgs:
        costs = ctx.option_costs(cfg)
        fb = [[x[0] + x[1] for x in kk] for kk in costs.kinds]
        m = cfg.num_microbatches
        want = min(m * (k[0] + 3 * k[1]) for k in fb)     # 1 dense + 3 MoE layers, one stage
        assert all(k[1] > k[0] for k in fb)                 # MoE dearer than dense here
        assert _work_base(cm, cfg, costs) == pytest.approx(want, rel=1e-12)
        assert _work_base(cm, cfg, costs) > m * 4 * costs.min_layer_fb


@pytest.mark.parametrize("types,pattern", [
    ([(100.0, 4, 2, 0.3)], [1, 1, 1, 1]),
    ([(100.0, 4, 2, 0.3), (150.0, 2, 1, 1.0)], [0, 1, 1, 1])])
def test_large_experts_choose_ep_4(types, pattern):
    """Experts that fit only when spread (8192-wide, 0.3 GiB devices): the search picks EP 4,
    the brute-force optimum, and its stages hold a quarter of the experts."""
    cluster, model = make_cluster(types), _moe_model(pattern, 8192)
    expected, eps = _brute_force(cluster, model, _options(8, ("1f1b",), "none"))
    plan = search_plan(cluster, model, _options(8, ("1f1b",), "safe"))
    assert eps == {1, 2, 4}
    assert plan.ep == 4 and plan.predicted_iteration_time_ms == pytest.approx(expected,
                                                                               rel=1e-9)
    fixed = search_plan(cluster, model, _options(8, ("1f1b",), "safe", eps=(1, 2)))
    assert fixed.ep in (1, 2) and fixed.predicted_iteration_time_ms > expected


def test_a_fixed_ep_is_kept_and_an_impossible_one_refused():
    cluster = _cluster()
    model = _moe_model([0, 1, 1, 1], 2048)
    plan = search_plan(cluster, model, _options(8, ("1f1b",), "safe", eps=(4,)))
    assert plan.ep == 4 and plan.dp % 4 == 0
    for args in (plan.megatron_args(), plan.mindspeed_llm_args()):
        assert args[args.index("--expert-model-parallel-size") + 1] == "4"
        assert ("--sequence-parallel" in args) == (plan.tp > 1)
    # EP 4 needs DP >= 4: a global batch of 2 has none
    with pytest.raises(PoseidonError, match="expert parallelism .* 4: no configuration"):
        search_plan(cluster, model, _options(2, ("1f1b",), "safe", eps=(4,)))
    with pytest.raises(PoseidonError, match="none of \\[3\\] divides the 4 experts"):
        search_plan(cluster, model, _options(8, ("1f1b",), "safe", eps=(3,)))
    with pytest.raises(PoseidonError, match="has no experts"):
        search_plan(cluster, get_model("llama3-8b"), _options(8, ("1f1b",), "safe", eps=(2,)))


def test_plan_json_carries_ep_and_old_json_loads_with_ep_1():
    cluster = _cluster()
    model = _moe_model([0, 1, 1, 1], 2048)
    plan = search_plan(cluster, model, _options(8, ("1f1b",), "safe", eps=(2,)))
    d = json.loads(plan.to_json())
    assert d["ep"] == 2 and d["moe"] is True
    assert all("moe_layers_bytes" in s["memory"] for s in d["stages"])
    assert plan.dp // plan.ep == 1 or any(s.expert_allreduce_ms > 0 for s in plan.stages)
    for st_, s in zip(plan.stages, d["stages"]):
        assert 0.0 <= s["expert_allreduce_ms"] <= s["allreduce_ms"]
        if st_.expert_allreduce_ms > 0:
            assert plan.dp // plan.ep > 1
    back = Plan.from_json(plan.to_json())
    assert back.ep == 2 and back.to_json() == plan.to_json()
    # the JSON's 6-decimal figures re-derive the iteration
    assert back.rederived_iteration_time_ms() == pytest.approx(
        plan.predicted_iteration_time_ms, abs=1e-5)
    table = plan.table()
    assert "ep=2" in table and "memory by layer kind" in table
    assert f"stage 0: dense 1 layers" in table or plan.stages[0].layers == 0
    del d["ep"], d["moe"]
    old = Plan.from_json(json.dumps(d))
    assert old.ep == 1 and "--expert-model-parallel-size" not in old.megatron_args()
    dense = dataclasses.replace(old, moe=False)
    assert "--expert-model-parallel-size" not in dense.mindspeed_llm_args()


def test_cli_ep_flag(capsys, tmp_path):
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    small = os.path.join(root, "examples/clusters/small-two-type.yaml")
    tiny = os.path.join(root, "examples/models/tiny-gpt.yaml")
    rc = cli.main(["plan", "--cluster", small, "--model", tiny, "--global-batch-size", "16",
                   "--seq-length", "128", "--workers", "1", "--ep", "2", "--no-baselines"])
    out, err = capsys.readouterr()
    assert rc != 0 and out == "" and len(err.strip().splitlines()) == 1
    assert "has no experts" in err



def test_moe_plan_flags_carry_sequence_parallel_at_tp_above_1():
    """megatron-core refuses MoE at TP > 1 without --sequence-parallel: a MoE plan's flags carry
    it there (and not at TP 1, nor for a dense model)."""
    plan = search_plan(_cluster(), _moe_model([0, 1, 1, 1], 2048),
                       _options(8, ("1f1b",), "safe", eps=(2,)))
    at = {tp: dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, tp=tp)
                                                     for s in plan.stages)) for tp in (1, 2)}
    for tp, p in at.items():
        for args in (p.megatron_args(), p.mindspeed_llm_args()):
            assert args[args.index("--tensor-model-parallel-size") + 1] == str(tp)
            assert args[args.index("--expert-model-parallel-size") + 1] == "2"
            assert ("--sequence-parallel" in args) == (tp > 1)
    dense = dataclasses.replace(at[2], moe=False, ep=1)
    assert "--sequence-parallel" not in dense.megatron_args()
