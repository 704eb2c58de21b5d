"""Prices that match what Megatron runs (issue 36 item 3, issue 38 item 15).

* a MoE layer's tensor-parallel traffic: the ``alltoall`` dispatcher's all-gather and
  reduce-scatter of the k x b x s token copies (``tp_traffic.py``; its volumes are checked
  against megatron-core's own ``MoELayer`` on gloo ranks in ``test_tp_traffic.py``);
* recompute: ``full`` re-runs the whole forward, its TP collectives (and the EP all-to-alls)
  included; ``selective`` re-runs megatron-core's default ``recompute_modules`` (core attention);
* MTP: its forward and backward on the last stage, its FLOPs those of the layers it runs;
* EP x CP: EP divides DP x CP (megatron-core's expert grid), never dropped under CP.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from poseidon_plugin import memory
from poseidon_plugin.cluster import load_cluster
from poseidon_plugin.comm import allreduce_ms, reduce_scatter_ms
from poseidon_plugin.costs import CostModel
from poseidon_plugin.model import get_model, model_from_dict, model_to_dict
from poseidon_plugin.profiles import ProfileKey, estimate_profile, tp_link_gbps
from poseidon_plugin.search import SearchOptions
from poseidon_plugin.search.configs import enumerate_configs, ep_candidates
from poseidon_plugin.tp_traffic import kind_tp_exchanges
from poseidon_plugin.training import TrainingSetup

ROOT = Path(__file__).resolve().parents[1]
SMALL = str(ROOT / "examples/clusters/small-two-type.yaml")
MOE3 = str(ROOT / "examples/clusters/moe-3type-512.yaml")
TINY_MOE = str(ROOT / "examples/models/tiny-moe.yaml")


def _key(model, device, tp, recompute="none", b=1, seq=None, kind="decoder"):
    setup = TrainingSetup(recompute=recompute)
    return ProfileKey(device, kind, tp, b, seq or model.seq_length, model.signature(),
                      **setup.profile_fields)


# --------------------------------------------------------------------------- MoE TP traffic

def test_a_moe_layer_pays_the_dispatchers_k_fold_exchange():
    """DeepSeek-V3 at TP 4 on an H200: the MoE kind's forward = compute + attention's and the
    shared experts' b*s*h exchanges + the dispatcher's k*b*s*h one (the dense kind's: two
    b*s*h); the estimate before this fix charged every layer two b*s*h exchanges (its forward
    was 1.60 ms, 50 %, short)."""
    c = load_cluster(MOE3)
    m = get_model("deepseek-v3")
    dense, moe = (m.kind_model(i) for i in range(2))
    assert not dense.is_moe and moe.is_moe
    b, s, t, h = 1, 4096, 4, m.hidden_size
    gbps, lat = tp_link_gbps(c, "H200-141", t), c.links.latency_ms
    one = allreduce_ms(2.0 * b * s * h, t, gbps, lat)
    k = m.moe_top_k
    for model, comm in ((dense, 2 * one), (moe, 2 * one + allreduce_ms(2.0 * k * b * s * h, t,
                                                                       gbps, lat))):
        none = estimate_profile(c, model, _key(model, "H200-141", t, seq=s))
        rate = c.device_types["H200-141"].effective_tflops * 1e9
        compute = model.layer_forward_flops(b, s) / t / rate
        assert none.forward_ms == pytest.approx(compute + comm, rel=1e-12)
        assert none.backward_ms == pytest.approx(2 * compute + comm, rel=1e-12)
    moe_f = estimate_profile(c, moe, _key(moe, "H200-141", t, seq=s)).forward_ms
    old = moe.layer_forward_flops(b, s) / t / rate + 2 * one
    assert moe_f - old == pytest.approx(1.60, abs=0.01)        # the figure


def test_exchanges_per_kind():
    m = get_model(TINY_MOE)
    dense, moe = m.layer_kinds
    v = 2.0 * 128 * m.hidden_size
    assert kind_tp_exchanges(dense, 2, 128) == (v, v)
    assert kind_tp_exchanges(moe, 2, 128) == (v, v, m.moe_top_k * v)        # shared expert
    no_shared = dataclasses.replace(moe, mlp=dataclasses.replace(moe.mlp,
                                                                 shared_ffn_hidden_size=0))
    assert kind_tp_exchanges(no_shared, 2, 128) == (v, m.moe_top_k * v)


def test_tp1_has_no_tp_traffic():
    c = load_cluster(SMALL)
    m = get_model(TINY_MOE).kind_model(1)
    p = estimate_profile(c, m, _key(m, "fast", 1))
    rate = c.device_types["fast"].effective_tflops * 1e9
    assert p.forward_ms == pytest.approx(m.layer_forward_flops(1, 128) / rate, rel=1e-12)


# --------------------------------------------------------------------------- recompute

@pytest.mark.parametrize("name", ["tiny-moe-dense", "tiny-moe-moe", "llama3-8b"])
def test_full_recompute_reruns_the_forward_with_its_tp_collectives(name):
    """megatron-core's full recompute (``tensor_parallel.checkpoint`` around each layer)
    re-runs the layer's forward in its backward, its TP all-gathers / reduce-scatters
    included: backward(full) - backward(none) = forward(none), collectives and all."""
    c = load_cluster(SMALL)
    m = (get_model(TINY_MOE).kind_model(0 if name.endswith("dense") else 1)
         if name.startswith("tiny") else get_model(name))
    for t in (2, 4):
        none = estimate_profile(c, m, _key(m, "fast", t))
        full = estimate_profile(c, m, _key(m, "fast", t, "full"))
        assert full.forward_ms == none.forward_ms
        assert full.backward_ms - none.backward_ms == pytest.approx(none.forward_ms, rel=1e-12)


@pytest.mark.integration   # torch / megatron-core
def test_selective_recompute_reruns_megatrons_default_modules_only():
    """megatron-core 0.19's selective recompute re-runs ``recompute_modules``, by default the
    core attention alone (no collective): the extra backward is the core attention's compute
    at the model's own attention (MLA: its qk + rope and v head dims)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4,
                               recompute_granularity="selective")
    assert config.recompute_modules == ["core_attn"]
    c = load_cluster(MOE3)
    m = get_model("deepseek-v3").kind_model(1)
    assert m.attention.multi_latent
    rate = c.device_types["H100-80"].effective_tflops * 1e9
    for t in (1, 4):
        none = estimate_profile(c, m, _key(m, "H100-80", t, seq=4096))
        sel = estimate_profile(c, m, _key(m, "H100-80", t, "selective", seq=4096))
        core = m.attention.core_forward_flops(1, 4096) / t / rate
        assert sel.forward_ms == none.forward_ms
        assert sel.backward_ms - none.backward_ms == pytest.approx(core, rel=1e-9)


def test_full_recompute_reruns_the_expert_alltoalls():
    """Under full recompute the EP dispatch and combine all-to-alls of the forward run again."""
    c = load_cluster(SMALL)
    m = get_model(TINY_MOE).kind_model(1)
    none = CostModel(c, m, None, seq_length=128).layer_costs(0, 1, 1, ep=2)
    full = CostModel(c, m, None, seq_length=128,
                     training=TrainingSetup(recompute="full")).layer_costs(0, 1, 1, ep=2)
    assert none.alltoall_ms > 0
    assert full.backward_ms - none.backward_ms == pytest.approx(
        none.forward_ms, rel=1e-12)


# --------------------------------------------------------------------------- MTP

def _with_mtp(model, layers=1):
    d = model_to_dict(model)
    d["mtp_num_layers"] = layers
    d["name"] = model.name + "-mtp"
    return model_from_dict(d)


@pytest.mark.parametrize("tp", [1, 2])
def test_mtp_runs_on_the_last_stage(tp):
    """The MTP layer's forward and backward are in the last stage's time (after the output
    layer), its parameters' gradients in its DP sync; the other stages are as without MTP."""
    c = load_cluster(SMALL)
    base = get_model(TINY_MOE)
    mtp = _with_mtp(base)
    kw = dict(stage_types=[0, 0], stage_tps=[tp, tp], layers=[4, 4], dp=2, micro_batch_size=1,
              num_microbatches=4, schedule="1f1b", virtual_stages=1)
    without, _, _ = CostModel(c, base, None, seq_length=128).stage_costs(**kw)
    cm = CostModel(c, mtp, None, seq_length=128)
    with_, _, _ = cm.stage_costs(**kw)
    assert with_[0].forward_ms == without[0].forward_ms
    assert with_[0].backward_ms == without[0].backward_ms
    moe = cm.kind_layer_costs(0, tp, 1)[1]                 # the MTP layer is the last's kind
    first = cm.kind_layer_costs(0, tp, 1)[0]
    rate = c.device_types["fast"].effective_tflops * 1e9
    h = mtp.hidden_size
    proj = 2.0 * 128 * 2 * h * h / tp / rate
    values = 2.0 * 128 * h
    gbps = tp_link_gbps(c, "fast", tp)
    comm = reduce_scatter_ms(2 * values, tp, gbps, 0.01) + reduce_scatter_ms(values, tp, gbps,
                                                                               0.01)
    emb_f, out_f = first.embedding_forward_ms, first.output_forward_ms - first.mtp_forward_ms
    want_f = emb_f + proj + comm + moe.forward_ms + out_f
    assert first.mtp_forward_ms == pytest.approx(want_f, rel=1e-12)
    assert with_[1].forward_ms - without[1].forward_ms == pytest.approx(want_f, rel=1e-9)
    assert with_[1].backward_ms - without[1].backward_ms == pytest.approx(
        first.mtp_backward_ms, rel=1e-9)
    assert first.mtp_backward_ms > moe.backward_ms + first.output_backward_ms \
        - first.mtp_backward_ms
    grad = mtp.mtp_param_split().per_device(tp) * 4                  # fp32 gradients
    assert first.mtp_grad_bytes == pytest.approx(grad)
    assert with_[1].allreduce_ms > without[1].allreduce_ms


def test_mtp_flops_are_what_the_last_stage_runs():
    """The iteration's FLOPs (TFLOP/s, MFU) count MTP as the layers it runs: a decoder layer of
    the last kind, the 2h -> h projection and a logits GEMM (3x forward), so with MTP in the
    last stage's time they are the FLOPs the stages run."""
    m = _with_mtp(get_model(TINY_MOE))
    b, s, h = 4, 128, m.hidden_size
    kinds = m.layer_kinds
    layers = sum(kinds[k].forward_flops(b, s) for k in m.layer_kind_of)
    mtp_layer = kinds[m.layer_kind_of[-1]].forward_flops(b, s) + 2.0 * b * s * 2 * h * h \
        + 2.0 * b * s * h * m.vocab_size
    want = 3 * (layers + 2.0 * b * s * h * m.vocab_size + mtp_layer)
    assert m.model_flops_per_iteration(b, s) == pytest.approx(want, rel=1e-12)


def test_deepseek_v3_last_stage_takes_its_mtp():
    """DeepSeek-V3 at TP 8 on an H100: one MTP layer adds its forward + backward per
    micro-batch to the last stage (a MoE layer, the projection, a second logits and loss)."""
    c = load_cluster(MOE3)
    m = get_model("deepseek-v3")
    cm = CostModel(c, m, None, seq_length=4096)
    k = c.type_names.index("H100-80")
    lc = cm.kind_layer_costs(k, 8, 1)[0]
    moe = cm.kind_layer_costs(k, 8, 1)[1]
    assert lc.mtp_forward_ms > moe.forward_ms
    assert lc.mtp_forward_ms + lc.mtp_backward_ms > 15.0      # ms per micro-batch
    assert "stage's time" not in (m.planning_note() or "")


def test_models_doc_states_the_presets_sizes():
    """docs/models.md's preset sizes are what the model computes (total, MTP, active)."""
    text = (ROOT / "docs/models.md").read_text()
    m = get_model("deepseek-v3")
    got = re.search(r"`deepseek-v3` \(([\d.]+) B \+ ([\d.]+) B MTP, ([\d.]+) B active"
                    r"(?: \+ ([\d.]+) B in MTP)?", text)
    assert got, "docs/models.md: the deepseek-v3 preset line"
    total, mtp, active, mtp_active = got.groups()
    kind = m.layer_kinds[m.mtp_layer_kind]
    mtp_act = m.mtp_params() - m.mtp_num_layers * (kind.params() - kind.active_params())
    assert float(total) == round((m.total_params() - m.mtp_params()) / 1e9)
    assert float(mtp) == round(m.mtp_params() / 1e9, 1)
    assert float(active) == round((m.active_params() - mtp_act) / 1e9, 2)
    assert mtp_active is not None and float(mtp_active) == round(mtp_act / 1e9, 2)
    for name in ("qwen3-235b-a22b", "qwen3-30b-a3b"):
        got = re.search(rf"`{name}` \(([\d.]+) B, ([\d.]+) B active\)", text)
        assert got, name
        q = get_model(name)
        assert float(got.group(1)) == round(q.total_params() / 1e9, 1)
        digits = len(got.group(2).partition(".")[2])
        assert float(got.group(2)) == round(q.active_params() / 1e9, digits)


# --------------------------------------------------------------------------- EP x CP

@pytest.mark.integration   # torch / megatron-core
def test_ep_divides_dp_times_cp_as_megatrons_expert_grid():
    """megatron-core 0.19 builds the expert grid ETP x EP x expert-DP over the TP x CP x DP
    devices (expert-DP = world / (ETP x EP x PP)): at DP 1, CP 2 an EP of 2 is a valid grid
    (its rank generator builds EP groups over the CP ranks), so the search offers it."""
    from megatron.core.parallel_state import RankGenerator

    m = get_model(TINY_MOE)
    for dp, cp, tp in ((1, 2, 1), (1, 4, 2), (2, 2, 1), (3, 2, 1)):
        world = tp * cp * dp
        for ep in (1, 2, 4, 8):
            ok = (dp * cp) % ep == 0
            if ok:
                gen = RankGenerator(tp=tp, ep=ep, dp=dp * cp // ep, pp=1, cp=1,
                                    order="tp-cp-ep-dp-pp")
                groups = gen.get_ranks("ep")
                assert sorted(r for g in groups for r in g) == list(range(world))
            assert (ep in ep_candidates(m, dp * cp)) == (ok and 8 % ep == 0)


def test_cp_configurations_keep_the_requested_ep():
    """``--cp 2 --ep 2`` at DP 1: every CP configuration carries EP 2 (it was EP 1)."""
    c = load_cluster(SMALL)
    m = get_model(TINY_MOE)
    cm = CostModel(c, m, None, seq_length=128)
    opts = SearchOptions(global_batch_size=2, seq_length=128, micro_batch_sizes=(1,),
                         context_parallel=(2,), expert_parallel=(2,))
    cfgs = enumerate_configs(cm, opts)
    assert cfgs and all(cfg.ep == 2 and cfg.cp == 2 for cfg in cfgs)
    assert any(cfg.dp == 1 for cfg in cfgs)            # EP 2 over the CP ranks alone


def test_cp_ep_plan_keeps_ep_or_refuses(capsys):
    """The CLI: ``--cp 2 --ep 2`` plans EP 2; an EP no DP x CP admits is one error line."""
    from poseidon_plugin.cli import main

    import json

    base = ["plan", "--cluster", SMALL, "--model", TINY_MOE, "--global-batch-size", "2",
            "--seq-length", "128", "--time-budget", "5", "--no-baselines", "--json"]
    assert main(base + ["--cp", "2", "--ep", "2"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["ep"] == 2 and plan["cp"] == 2
    assert main(base + ["--cp", "2", "--ep", "8", "--micro-batch-sizes", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "DP x CP" in err[0], err
