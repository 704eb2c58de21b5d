"""A pipeline stage that holds no MoE layer hangs megatron-core 0.12.1 (MindSpeed-LLM's base) at
the first optimizer step: the experts' optimizer exists only on ranks with expert parameters,
and its gradient-norm all-reduce spans every stage (seen: MindSpeed-LLM v26.1.0, layout
``Et|t*3mL``, all four ranks waiting in ``optimizer.step`` / ``logical_and_across_model_parallel_
group``; megatron-core 0.19.2 trained the same layout). The launch refuses such a plan before
training on a megatron-core before 0.19 and searches again (``search/rules.py``)."""

from __future__ import annotations

import dataclasses
import os

import pytest

from poseidon_plugin import cli
from poseidon_plugin.model import load_model
from poseidon_plugin.plan import Plan
from poseidon_plugin.search import rules

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(ROOT, "examples", "models", "tiny-moe.yaml")      # 2 dense, then 6 MoE
CLUSTER = os.path.join(ROOT, "examples", "clusters", "small-two-type.yaml")


@pytest.fixture(scope="module")
def plan(tmp_path_factory) -> Plan:
    out = tmp_path_factory.mktemp("moe-free") / "plan.json"
    assert cli.main(["plan", "--cluster", CLUSTER, "--model", MODEL, "--global-batch-size", "64",
                     "--seq-length", "128", "--no-baselines", "--no-runner-up", "--json",
                     "--out", str(out)]) == 0
    p = Plan.from_json(out.read_text())
    assert p.pp >= 2, "the search's plan for this case has one stage: pick another case"
    return p


def _with_layers(plan: Plan, layers: list[int]) -> Plan:
    assert len(layers) == plan.pp and sum(layers) == sum(s.layers for s in plan.stages)
    return dataclasses.replace(plan, stages=[dataclasses.replace(s, layers=n)
                                             for s, n in zip(plan.stages, layers)])


def test_a_stage_of_dense_layers_only_is_found(plan):
    model = load_model(MODEL)
    pp = plan.pp
    dense_first = _with_layers(plan, [2] + [1] * (pp - 2) + [8 - 2 - (pp - 2)])
    assert rules.stages_without_moe_layers(dense_first, model) == [(0, [1, 2])]
    one_moe_each = _with_layers(plan, [3] + [1] * (pp - 2) + [8 - 3 - (pp - 2)])
    assert rules.stages_without_moe_layers(one_moe_each, model) == []
    if pp >= 3:   # a later stage of the dense layer alone: layers 1 | 2 | ...
        second = _with_layers(plan, [1, 1] + [1] * (pp - 3) + [8 - 2 - (pp - 3)])
        assert [s for s, _ in rules.stages_without_moe_layers(second, model)] == [0, 1]
    dense = load_model(os.path.join(ROOT, "examples", "models", "tiny-gpt.yaml"))
    assert rules.stages_without_moe_layers(dataclasses.replace(plan, stages=plan.stages),
                                           dense) == []   # no MoE layer anywhere


def test_the_refusal_names_the_stage_and_the_framework_and_spares_megatron_core_0_19(plan):
    model = load_model(MODEL)
    bad = _with_layers(plan, [2] + [1] * (plan.pp - 2) + [8 - 2 - (plan.pp - 2)])
    why = rules.moe_free_stage_refusal(bad, model, "MindSpeed-LLM on megatron-core 0.12.1",
                                       rules.version_tuple("0.12.1"))
    assert why == ("stage 0 holds no MoE layer (layers 1-2: dense); MindSpeed-LLM on "
                   "megatron-core 0.12.1 hangs at the first optimizer step when a pipeline "
                   "stage has no expert parameters (its experts' optimizer reduces the "
                   "gradient norm over every stage)")
    assert rules.moe_free_stage_refusal(bad, model, "x", None) is not None   # unknown: old
    assert rules.moe_free_stage_refusal(bad, model, "x", rules.version_tuple("0.19.2rc0")) \
        is None
    assert rules.version_tuple("0.15.3") == (0, 15, 3) and rules.version_tuple("?") is None


def test_the_search_without_moe_free_stages_gives_the_first_stage_a_moe_layer():
    """SearchOptions(moe_free_stages=False), as a launch on megatron-core 0.12.1 searches: no
    plan's first stage holds only the leading dense layers, exhaustive and pruned alike, and
    the plan is no faster than the unconstrained one."""
    from poseidon_plugin.cluster import load_cluster
    from poseidon_plugin.search import SearchOptions, search_plan

    model = load_model(MODEL)
    cluster = load_cluster(CLUSTER)
    free = search_plan(cluster, model, SearchOptions(global_batch_size=64, seq_length=128))
    assert rules.stages_without_moe_layers(free, model)   # the case needs one to matter
    plans = [search_plan(cluster, model, SearchOptions(global_batch_size=64, seq_length=128,
                                                       moe_free_stages=False, pruning=p))
             for p in ("safe", "none")]
    for p in plans:
        assert rules.stages_without_moe_layers(p, model) == [], p.stages
        assert p.predicted_iteration_time_ms >= free.predicted_iteration_time_ms * (1 - 1e-9)
    assert abs(plans[0].predicted_iteration_time_ms - plans[1].predicted_iteration_time_ms) \
        <= 1e-6 * plans[1].predicted_iteration_time_ms


def test_a_kept_plan_with_a_dense_only_first_stage_is_replanned_saying_why(plan):
    """The previous launch's plan (``previous=``) whose stage 0 holds only the dense layers is
    unusable under moe_free_stages=False, for that reason, not memory."""
    from poseidon_plugin.cluster import load_cluster
    from poseidon_plugin.search import SearchOptions, search_plan

    model = load_model(MODEL)
    cluster = load_cluster(CLUSTER)
    free = search_plan(cluster, model, SearchOptions(global_batch_size=64, seq_length=128))
    assert free.stages[0].layers <= 2
    kept = search_plan(cluster, model, SearchOptions(global_batch_size=64, seq_length=128,
                                                     moe_free_stages=False,
                                                     keep_tolerance=0.2), previous=free)
    assert kept.search["previous_plan"].startswith("unusable: its stage 0 holds dense layers "
                                                   "only (1-"), kept.search["previous_plan"]
    assert rules.stages_without_moe_layers(kept, model) == []
