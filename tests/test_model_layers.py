"""A model is a sequence of layer kinds (issue 29, item 1): layer patterns, per-kind parameter and
FLOP counts (hand computations, published totals, megatron-core's own modules), prefix sums per
kind, the planner's per-layer envelope, YAML and Megatron-args construction, refusals."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings, strategies as st

from poseidon_plugin.errors import PoseidonError, SpecError
from poseidon_plugin.layers import (
    LayerParams, PatternError, moe_layer_pattern, parse_layer_pattern, pattern_expression,
)
from poseidon_plugin.megatron.launch import argv as A
from poseidon_plugin.model import (
    PRESETS, ModelSpec, get_model, load_model, model_from_dict, model_from_megatron_args,
    model_to_dict,
)
from test_launch_e2e import free_port

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples" / "models"
UNIFORM_PRESETS = ("llama3-8b", "llama2-13b", "llama-30b", "mixtral-8x7b", "llama3-70b",
                   "llama3-405b")


# --------------------------------------------------------------------------- patterns

@pytest.mark.parametrize("text, expected", [
    ("[0]*3+[1]*58", (0,) * 3 + (1,) * 58),
    ("([0]+[1]*3)*2", (0, 1, 1, 1, 0, 1, 1, 1)),
    ("([1]*3+[0]*1)*3", (1, 1, 1, 0) * 3),     # Megatron's help text example
    ("[1,0,1]", (1, 0, 1)),
    ("2*[1]+[0]", (1, 1, 0)),
    (" [0] * 2 + [1] ", (0, 0, 1)),            # whitespace is ignored
    ("[0]*(1+1)", (0, 0)),
    ("[]+[1]", (1,)),
])
def test_pattern_expressions(text, expected):
    assert parse_layer_pattern(text) == expected


@pytest.mark.parametrize("text", [
    "[0]*3+1",                  # list + int
    "[[0]]",                    # nested list
    "__import__('os')",         # not an expression of the grammar: never evaluated
    "[0]*100000",               # longer than 4096 layers, refused before it is built
    "[0]*99999999999",          # a 10-digit integer
    "[0]*3)",                   # trailing text
    "(1,2)",                    # a tuple is not a list
    "3",                        # an integer is not a list expression
    "[0]*[1]",
    "[0",
    "",
    "(" * 40 + "[0]" + ")" * 40,  # nested deeper than 32
])
def test_pattern_errors(text):
    with pytest.raises(PatternError):
        parse_layer_pattern(text)


@st.composite
def list_expressions(draw, depth: int = 0) -> str:
    """Random expressions of Megatron's pattern grammar that evaluate to a list."""
    choice = draw(st.integers(0, 3 if depth < 3 else 0))
    if choice == 0:
        return "[" + ",".join(str(draw(st.integers(0, 1)))
                              for _ in range(draw(st.integers(1, 4)))) + "]"
    if choice == 1:
        return draw(list_expressions(depth + 1)) + "+" + draw(list_expressions(depth + 1))
    if choice == 2:
        n = draw(st.integers(0, 5))
        inner = draw(list_expressions(depth + 1))
        return f"({inner})*{n}" if draw(st.booleans()) else f"{n}*({inner})"
    return "(" + draw(list_expressions(depth + 1)) + ")"


@given(list_expressions())
def test_pattern_parser_agrees_with_python(text):
    """What Megatron's ``eval`` makes of an expression, the parser makes of it without eval."""
    assert parse_layer_pattern(text) == tuple(eval(text))  # noqa: S307 - test oracle


def test_pattern_rules():
    # Megatron: an int N makes layer i (0-based) MoE when i % N == 0
    assert moe_layer_pattern(5, 1) == (1, 1, 1, 1, 1)
    assert moe_layer_pattern(5, 2) == (1, 0, 1, 0, 1)
    assert moe_layer_pattern(7, 3) == (1, 0, 0, 1, 0, 0, 1)
    # MindSpeed-LLM: MoE when i >= first_k_dense_replace and i % freq == 0
    assert moe_layer_pattern(6, 1, 2) == (0, 0, 1, 1, 1, 1)
    assert moe_layer_pattern(6, 2, 3) == tuple(int(i >= 3 and i % 2 == 0) for i in range(6))
    assert moe_layer_pattern(4, (1, 0, 1, 1), 1) == (0, 0, 1, 1)
    assert pattern_expression((0, 0, 0) + (1,) * 58) == "[0]*3+[1]*58"
    assert pattern_expression((0, 1, 1, 0)) == "[0]+[1]*2+[0]"


@pytest.mark.integration
@pytest.mark.parametrize("text", ["[0]*3+[1]*58", "([0]+[1]*3)*2", "[1,0,1]", "4"])
def test_pattern_agrees_with_megatrons_parser(text):
    arguments = pytest.importorskip("megatron.training.arguments")
    theirs = arguments.moe_freq_type(text)
    ours = parse_layer_pattern(text) if "[" in text else int(text)
    assert (tuple(theirs) if isinstance(theirs, list) else theirs) == ours


# --------------------------------------------------------------------------- hand computed

def _small(**kw) -> ModelSpec:
    base = dict(name="small", num_layers=6, hidden_size=64, ffn_hidden_size=192,
                num_attention_heads=4, num_query_groups=4, vocab_size=100, seq_length=32,
                num_experts=8, moe_top_k=2, moe_ffn_hidden_size=32, first_k_dense_replace=2,
                moe_shared_expert_intermediate_size=48, moe_shared_expert_gate=True,
                multi_latent_attention=True, q_lora_rank=24, kv_lora_rank=16, qk_head_dim=8,
                qk_pos_emb_head_dim=4, v_head_dim=8, qk_layernorm=True, mtp_num_layers=1)
    base.update(kw)
    return ModelSpec(**base)


def test_small_mixed_mla_model_by_hand():
    m = _small()
    h, a, E, k, fe, fs, f, V = 64, 4, 8, 2, 32, 48, 192, 100
    ql, kvl, qk, r, v = 24, 16, 8, 4, 8
    assert m.layer_kind_of == (0, 0, 1, 1, 1, 1)
    assert [kind.name for kind in m.layer_kinds] == ["dense", "moe"]
    assert m.kind_counts == (2, 4)
    assert m.head_dim == qk + r and m.attention.kind == "mla"
    # MLA: Q down (replicated) and up, KV down (replicated) and up, output; two latent norms
    attn_sharded = ql * a * (qk + r) + kvl * a * (qk + v) + a * v * h
    attn_replicated = h * ql + h * (kvl + r) + ql + kvl
    norms = 2 * h
    dense, moe = (kind.param_split() for kind in m.layer_kinds)
    assert dense == LayerParams(tp_sharded=attn_sharded + 3 * h * f,
                                replicated=attn_replicated + norms, expert=0)
    assert moe == LayerParams(tp_sharded=attn_sharded + 3 * h * fs,
                              replicated=attn_replicated + norms + h * E + h,  # router, gate
                              expert=E * 3 * h * fe)
    active_moe = moe.tp_sharded + moe.replicated + k * 3 * h * fe
    assert m.layer_kinds[1].active_params() == active_moe
    mtp = moe.total + 2 * h * h + 3 * h
    assert m.mtp_params() == mtp and m.mtp_layer_kind == 1
    assert m.total_params() == 2 * dense.total + 4 * moe.total + 2 * h * V + h + mtp
    assert m.active_params() == 2 * dense.total + 4 * active_moe + 2 * h * V + h \
        + mtp - moe.total + active_moe
    # FLOPs, one micro-batch of b x s
    b, s = 2, 32
    t = b * s
    attn = 2 * t * (ql * (h + a * (qk + r)) + kvl * (h + a * (qk + v)) + h * r + a * v * h) \
        + b * s * s * a * (qk + r + v)
    assert m.layer_kinds[0].attention_forward_flops(b, s) == pytest.approx(attn, rel=1e-12)
    dense_mlp = 2 * t * 3 * h * f
    moe_mlp = k * 2 * t * 3 * h * fe + 2 * t * h * E + 2 * t * 3 * h * fs + 2 * t * h
    assert m.layer_kinds[0].mlp_forward_flops(b, s) == pytest.approx(dense_mlp)
    assert m.layer_kinds[1].mlp_forward_flops(b, s) == pytest.approx(moe_mlp)
    logits = 2 * t * h * V
    mtp_flops = attn + moe_mlp + 2 * t * 2 * h * h + logits
    assert m.model_flops_per_iteration(b, s) == pytest.approx(
        3 * (2 * (attn + dense_mlp) + 4 * (attn + moe_mlp) + logits + mtp_flops), rel=1e-12)


def test_gqa_qk_layernorm_and_full_rank_mla_by_hand():
    m = ModelSpec(name="g", num_layers=2, hidden_size=64, ffn_hidden_size=128,
                  num_attention_heads=8, num_query_groups=2, kv_channels=16, vocab_size=10,
                  seq_length=8, qk_layernorm=True, normalization="LayerNorm")
    h, a, g, d = 64, 8, 2, 16
    assert m.attention.kind == "gqa"
    assert m.layer_param_split() == LayerParams(
        tp_sharded=h * (a * d + 2 * g * d) + a * d * h + 3 * h * 128,
        replicated=2 * 2 * h + 2 * 2 * d, expert=0)        # LayerNorm: weight + bias
    full = ModelSpec(name="f", num_layers=1, hidden_size=64, ffn_hidden_size=128,
                     num_attention_heads=4, num_query_groups=4, vocab_size=10, seq_length=8,
                     multi_latent_attention=True, kv_lora_rank=16, qk_head_dim=8,
                     qk_pos_emb_head_dim=4, v_head_dim=8)       # no Q latent, no latent norms
    a = 4
    assert full.layer_param_split() == LayerParams(
        tp_sharded=h * a * 12 + 16 * a * 16 + a * 8 * h + 3 * h * 128,
        replicated=h * (16 + 4) + 2 * h, expert=0)


def test_uniform_models_are_one_kind_and_keep_their_numbers():
    """Existing presets: one kind repeated; the per-layer figures are that kind's (the numbers
    the plans were made with; test_model.py holds them to hand computations)."""
    for name in UNIFORM_PRESETS:
        m = PRESETS[name]
        assert len(m.layer_kinds) == 1 and not m.is_mixed and m.planning_note() is None
        assert m.layer_kind_of == (0,) * m.num_layers
        kind = m.layer_kinds[0]
        assert kind.name == ("moe" if m.is_moe else "dense")
        assert m.layer_param_split() == kind.param_split()
        assert m.layer_forward_flops(2, 512) == kind.forward_flops(2, 512)
        assert m.total_params() == m.num_layers * m.layer_params() + m.embedding_params() \
            + m.output_params()
        assert m.kind_model(0) == m
    # Mixtral's MoE numbers at EP = 1 as before: 8 experts over TP, the router replicated
    mix = PRESETS["mixtral-8x7b"].layer_param_split()
    assert mix.expert == 8 * 3 * 4096 * 14336 and mix.replicated == 2 * 4096 + 4096 * 8


# --------------------------------------------------------------------------- published totals

@pytest.mark.parametrize("name, total_b, active_b", [
    ("deepseek-v3", 671, 37),          # main model (the MTP module is published apart)
    ("qwen3-235b-a22b", 235, 22),
    ("qwen3-30b-a3b", 30.5, 3.3),
])
def test_moe_presets_match_published_totals(name, total_b, active_b):
    m = PRESETS[name]
    mtp_active = m.mtp_params() - m.mtp_num_layers * (
        m.layer_kinds[m.mtp_layer_kind].params() - m.layer_kinds[m.mtp_layer_kind].active_params()
    ) if m.mtp_num_layers else 0
    assert (m.total_params() - m.mtp_params()) / 1e9 == pytest.approx(total_b, rel=0.03)
    assert (m.active_params() - mtp_active) / 1e9 == pytest.approx(active_b, rel=0.03)


def test_deepseek_v3_structure():
    m = PRESETS["deepseek-v3"]
    assert m.layer_kind_of == (0,) * 3 + (1,) * 58 and m.kind_counts == (3, 58)
    assert m.kind_counts_in(0, 4) == (3, 1) and m.kind_counts_in(3, 61) == (0, 58)
    assert m.mtp_params() / 1e9 == pytest.approx(11.5, rel=0.03)   # "11.5B unique parameters"
    dense, moe = m.layer_kinds
    assert (moe.mlp.num_experts, moe.mlp.top_k, moe.mlp.ffn_hidden_size,
            moe.mlp.shared_ffn_hidden_size) == (256, 8, 2048, 2048)
    assert dense.mlp.ffn_hidden_size == 18432 and not dense.is_moe
    assert dense.attention == moe.attention and moe.attention.kind == "mla"
    assert m.signature().endswith("-mla-q1536-kv512-qk128-r64-v128-qkln-"
                                  "moe-e256-k8-f2048-s2048-layers-d3m58")
    # the layer kinds are costed per stage, MTP in the last stage's time and memory
    assert m.planning_note() is None


@pytest.mark.integration
@pytest.mark.parametrize("flags, preset", [
    ("--num-layers 61 --hidden-size 7168 --ffn-hidden-size 18432 --num-attention-heads 128 "
     "--vocab-size 129280 --num-experts 256 --moe-router-topk 8 --moe-ffn-hidden-size 2048 "
     "--moe-layer-freq [0]*3+[1]*58 --moe-shared-expert-intermediate-size 2048 "
     "--multi-latent-attention --q-lora-rank 1536 --kv-lora-rank 512 --qk-head-dim 128 "
     "--qk-pos-emb-head-dim 64 --v-head-dim 128 --qk-layernorm --mtp-num-layers 1",
     "deepseek-v3"),
    ("--num-layers 94 --hidden-size 4096 --ffn-hidden-size 12288 --num-attention-heads 64 "
     "--group-query-attention --num-query-groups 4 --kv-channels 128 --vocab-size 151936 "
     "--num-experts 128 --moe-router-topk 8 --moe-ffn-hidden-size 1536 --qk-layernorm",
     "qwen3-235b-a22b"),
])
def test_megatron_parse_and_flops_agree_with_presets(flags, preset):
    """Megatron's own parser on the published flags gives the preset; megatron-core's
    ``num_floating_point_operations`` agrees with ours within 0.5 % (we also count the router
    GEMM and MTP's 2h -> h projection)."""
    pytest.importorskip("megatron.training.arguments")
    from megatron.training.training import num_floating_point_operations

    from poseidon_plugin.megatron.profile.profiler import parse_megatron_args

    common = ("--seq-length 4096 --max-position-embeddings 4096 --swiglu --normalization RMSNorm "
              "--position-embedding-type rope --disable-bias-linear "
              "--untie-embeddings-and-output-weights --micro-batch-size 1")
    args = parse_megatron_args("pretrain_gpt.py", (flags + " " + common).split())
    m = model_from_megatron_args(args, name=preset)
    p = PRESETS[preset]
    assert m.signature() == p.signature() and m.layer_kind_of == p.layer_kind_of
    assert m.total_params() == p.total_params() and m.active_params() == p.active_params()
    args.kv_channels = args.kv_channels or args.hidden_size // args.num_attention_heads
    args.padded_vocab_size = args.vocab_size
    theirs = num_floating_point_operations(args, 8)
    assert m.model_flops_per_iteration(8, 4096) == pytest.approx(theirs, rel=0.005)
    assert m.model_flops_per_iteration(8, 4096) >= theirs


# --------------------------------------------------------------------------- megatron-core

_CPU_FLAGS = ("--transformer-impl local --no-gradient-accumulation-fusion "
              "--no-masked-softmax-fusion --no-rope-fusion --no-persist-layer-norm "
              "--micro-batch-size 1 --seq-length 64 --max-position-embeddings 64")
PROBE_CASES = {
    "tiny-moe-yaml": "--num-layers 8 --hidden-size 256 --num-attention-heads 8 "
                     "--ffn-hidden-size 1024 --vocab-size 1024 --disable-bias-linear "
                     "--untie-embeddings-and-output-weights --num-experts 8 --moe-router-topk 2 "
                     "--moe-ffn-hidden-size 256 --moe-layer-freq [0]*2+[1]*6 "
                     "--moe-shared-expert-intermediate-size 256",
    "mla-shared-gate-mtp": "--num-layers 4 --hidden-size 128 --num-attention-heads 4 "
                           "--ffn-hidden-size 384 --vocab-size 512 --disable-bias-linear "
                           "--untie-embeddings-and-output-weights --swiglu --normalization RMSNorm "
                           "--position-embedding-type rope --num-experts 4 --moe-router-topk 2 "
                           "--moe-ffn-hidden-size 64 --moe-layer-freq [0]+[1]*3 "
                           "--moe-shared-expert-intermediate-size 64 --moe-shared-expert-gate "
                           "--multi-latent-attention --q-lora-rank 32 --kv-lora-rank 16 "
                           "--qk-head-dim 16 --qk-pos-emb-head-dim 8 --v-head-dim 16 "
                           "--qk-layernorm --mtp-num-layers 1",
    "gqa-bias-freq2": "--num-layers 5 --hidden-size 128 --num-attention-heads 8 "
                      "--group-query-attention --num-query-groups 2 --kv-channels 32 "
                      "--ffn-hidden-size 256 --vocab-size 512 --num-experts 4 --moe-router-topk 1 "
                      "--moe-router-pre-softmax --moe-ffn-hidden-size 96 --moe-layer-freq 2 "
                      "--qk-layernorm --position-embedding-type rope",
    "mla-full-q-mtp2": "--num-layers 3 --hidden-size 128 --num-attention-heads 4 "
                       "--ffn-hidden-size 256 --vocab-size 512 --disable-bias-linear --swiglu "
                       "--normalization RMSNorm --position-embedding-type rope "
                       "--multi-latent-attention --kv-lora-rank 16 --qk-head-dim 16 "
                       "--qk-pos-emb-head-dim 8 --v-head-dim 16 --mtp-num-layers 2",
}


@pytest.mark.integration
@pytest.mark.parametrize("case", sorted(PROBE_CASES))
def test_counts_match_the_model_megatron_core_builds(case):
    """The whole model built by megatron-core's own builder on CPU (tests/mcore_param_probe.py):
    each decoder layer, the MTP block, embedding, output and total, parameter for parameter."""
    pytest.importorskip("megatron.core")
    from poseidon_plugin.megatron.profile.profiler import parse_megatron_args

    argv = (PROBE_CASES[case] + " " + _CPU_FLAGS).split()
    env = dict(os.environ, PYTHONPATH=str(ROOT), PROBE_PORT=str(free_port()))
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "mcore_param_probe.py"), *argv],
                         capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("PROBE ")]
    assert lines, out.stdout[-2000:] + out.stderr[-4000:]
    built = json.loads(lines[-1][len("PROBE "):])
    from poseidon_plugin.megatron.launch.argv import pin_dispatcher

    # read as a launch reads it: a MoE command line choosing no dispatcher gets the priced one
    m = model_from_megatron_args(parse_megatron_args("pretrain_gpt.py", pin_dispatcher(argv)),
                                 name=case)
    assert built["layers"] == [m.layer_kinds[k].params() for k in m.layer_kind_of]
    assert [("MoELayer" in mods) for mods in built["layer_modules"]] == \
        [m.layer_kinds[k].is_moe for k in m.layer_kind_of]
    assert built["mtp"] == m.mtp_params()
    assert built["embedding"] == m.embedding_params()
    assert built["output"] + built["final_norm"] == m.output_params()
    assert built["total"] == m.total_params()
    if case == "tiny-moe-yaml":
        yaml_model = load_model(str(EXAMPLES / "tiny-moe.yaml"))
        assert dataclasses.replace(m, name="tiny-moe", seq_length=128) == yaml_model


# --------------------------------------------------------------------------- prefix sums

@st.composite
def layered_models(draw) -> ModelSpec:
    layers = draw(st.integers(1, 24))
    experts = draw(st.sampled_from([0, 4]))
    kw: dict = {}
    if experts:
        if draw(st.booleans()):
            kw["moe_layer_freq"] = draw(st.integers(1, 4))
        else:
            pattern = draw(st.lists(st.integers(0, 1), min_size=layers, max_size=layers))
            kw["moe_layer_freq"] = tuple(pattern[:-1]) + (1,)   # at least one MoE layer
        kw["first_k_dense_replace"] = draw(st.integers(0, layers - 1))
        if not any(moe_layer_pattern(layers, kw["moe_layer_freq"], kw["first_k_dense_replace"])):
            kw["first_k_dense_replace"] = 0
            kw["moe_layer_freq"] = 1
        kw.update(num_experts=experts, moe_top_k=2, moe_ffn_hidden_size=32,
                  moe_shared_expert_intermediate_size=draw(st.sampled_from([0, 16])))
    if draw(st.booleans()):
        kw.update(multi_latent_attention=True, kv_lora_rank=8, qk_head_dim=8,
                  qk_pos_emb_head_dim=4, v_head_dim=8,
                  q_lora_rank=draw(st.sampled_from([None, 12])))
    return ModelSpec(name="p", num_layers=layers, hidden_size=32, ffn_hidden_size=64,
                     num_attention_heads=4, num_query_groups=4, vocab_size=50, seq_length=16,
                     mtp_num_layers=draw(st.integers(0, 2)), **kw)


@settings(max_examples=150, deadline=None)
@given(layered_models(), st.data())
def test_prefix_sums_per_kind_equal_brute_force(m, data):
    start = data.draw(st.integers(0, m.num_layers))
    stop = data.draw(st.integers(start, m.num_layers))
    kinds = m.layer_kind_of[start:stop]
    assert m.kind_counts_in(start, stop) == tuple(kinds.count(k)
                                                  for k in range(len(m.layer_kinds)))
    brute = LayerParams(0, 0, 0)
    for k in kinds:
        brute = brute + m.layer_kinds[k].param_split()
    assert m.layers_param_split(start, stop) == brute
    assert m.layers_forward_flops(start, stop, 2, 16) == pytest.approx(
        sum(m.layer_kinds[k].forward_flops(2, 16) for k in kinds), rel=1e-12)
    # the pattern: Megatron's int/list rule, then the first k dense
    assert tuple(int(m.layer_kinds[k].is_moe) for k in m.layer_kind_of) == m.moe_pattern
    assert m.total_params() == m.layers_param_split(0, m.num_layers).total \
        + m.embedding_params() + m.output_params() + m.mtp_params()
    # the planner's per-layer figures bound every kind, part by part, and are exact if uniform
    envelope = m.layer_param_split()
    for kind in m.layer_kinds:
        split = kind.param_split()
        assert split.tp_sharded <= envelope.tp_sharded and split.expert <= envelope.expert
        assert split.replicated <= envelope.replicated
        for tp in (1, 2, 4):
            assert split.per_device(tp) <= envelope.per_device(tp)
        assert kind.forward_flops(2, 16) <= m.layer_forward_flops(2, 16)
    if not m.is_mixed:
        assert envelope == m.layer_kinds[0].param_split()
    assert m.num_layers * m.layer_params() >= m.layers_param_split(0, m.num_layers).total
    assert m.planning_note() is None


def test_kind_counts_in_refuses_a_bad_range():
    m = PRESETS["deepseek-v3"]
    for start, stop in ((-1, 3), (4, 3), (0, 62)):
        with pytest.raises(ValueError):
            m.kind_counts_in(start, stop)


def test_kind_model_is_one_kind_of_the_same_shape():
    m = PRESETS["deepseek-v3"]
    dense, moe = m.kind_model(0), m.kind_model(1)
    assert not dense.is_moe and dense.layer_kinds[0] == m.layer_kinds[0]
    assert moe.layer_kinds == (m.layer_kinds[1],) and moe.mtp_num_layers == 0
    assert dense.signature() != moe.signature() != m.signature()
    assert m.signature().startswith(dense.signature())


# --------------------------------------------------------------------------- YAML

def test_examples_load():
    tiny = get_model(str(EXAMPLES / "tiny-moe.yaml"))
    assert tiny.kind_counts == (2, 6) and tiny.layer_kind_of == (0, 0) + (1,) * 6
    assert tiny.moe_layer_freq == (0, 0) + (1,) * 6
    ds = get_model(str(EXAMPLES / "deepseek-v3.yaml"))
    assert ds == PRESETS["deepseek-v3"]


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_yaml_round_trip_presets(tmp_path, name):
    m = PRESETS[name]
    assert model_from_dict(model_to_dict(m)) == m
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(model_to_dict(m), sort_keys=False))
    assert load_model(str(path)) == m


@settings(max_examples=60, deadline=None)
@given(layered_models())
def test_yaml_round_trip_any_model(m):
    text = yaml.safe_dump(model_to_dict(m), sort_keys=False)
    back = model_from_dict(yaml.safe_load(text))
    assert back == m and back.layer_kind_of == m.layer_kind_of


def test_pattern_forms_in_yaml_say_the_same(tmp_path):
    base = dict(num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                vocab_size=64, seq_length=16, num_experts=4, moe_top_k=1)
    forms = [{"moe_layer_freq": "[0]+[1]*3"}, {"moe_layer_freq": [0, 1, 1, 1]},
             {"first_k_dense_replace": 1}, {"first_k_dense_replace": 1, "moe_layer_freq": "1"}]
    models = [model_from_dict({**base, **form}) for form in forms]
    assert {m.layer_kind_of for m in models} == {(0, 1, 1, 1)}
    assert len({m.signature() for m in models}) == 1
    assert model_from_dict({**base, "moe_layer_freq": 2}).layer_kind_of == (0, 1, 0, 1)


BASE = {"num_layers": 4, "hidden_size": 64, "ffn_hidden_size": 128, "num_attention_heads": 4,
        "vocab_size": 64, "seq_length": 16}
MOE = {"num_experts": 4, "moe_top_k": 2}
MLA = {"multi_latent_attention": True, "kv_lora_rank": 8, "qk_head_dim": 8,
       "qk_pos_emb_head_dim": 4, "v_head_dim": 8}


@pytest.mark.parametrize("patch, field", [
    ({**MOE, "moe_layer_freq": "[0]*3+[1]*2"}, "moe_layer_freq"),     # 5 entries for 4 layers
    ({**MOE, "moe_layer_freq": "[0]*2+[2]*2"}, "moe_layer_freq"),     # not 0/1
    ({**MOE, "moe_layer_freq": "__import__('os').system('x')"}, "moe_layer_freq"),
    ({**MOE, "moe_layer_freq": "[0]*4"}, "moe_layer_freq"),           # no MoE layer
    ({**MOE, "moe_layer_freq": 0}, "moe_layer_freq"),
    ({**MOE, "moe_layer_freq": True}, "moe_layer_freq"),
    ({**MOE, "moe_layer_freq": [0, 1, 1, True]}, "moe_layer_freq"),
    ({**MOE, "moe_layer_freq": "every other"}, "moe_layer_freq"),
    ({"moe_layer_freq": 2}, "moe_layer_freq"),                        # dense model
    ({**MOE, "first_k_dense_replace": 4}, "first_k_dense_replace"),
    ({**MOE, "first_k_dense_replace": -1}, "first_k_dense_replace"),
    ({"first_k_dense_replace": 1}, "first_k_dense_replace"),
    ({**MOE, "moe_layer_freq": 2, "first_k_dense_replace": 3}, "moe_layer_freq"),  # none left
    ({"moe_shared_expert_intermediate_size": 32}, "moe_shared_expert_intermediate_size"),
    ({**MOE, "moe_shared_expert_gate": True}, "moe_shared_expert_gate"),
    ({**MOE, "moe_shared_expert_intermediate_size": 32, "add_bias_linear": True},
     "moe_shared_expert_intermediate_size"),
    ({"multi_latent_attention": True}, "kv_lora_rank"),
    ({**MLA, "v_head_dim": 0}, "v_head_dim"),
    ({**MLA, "q_lora_rank": -3}, "q_lora_rank"),
    ({"q_lora_rank": 16}, "q_lora_rank"),                             # without MLA
    ({**MLA, "kv_channels": 16}, "kv_channels"),
    ({**MLA, "num_query_groups": 2}, "num_query_groups"),
    ({"multi_latent_attention": "yes"}, "multi_latent_attention"),
    ({"qk_layernorm": 1}, "qk_layernorm"),
    ({"mtp_num_layers": -1}, "mtp_num_layers"),
    ({"mtp_num_layers": 65}, "mtp_num_layers"),
])
def test_yaml_errors_name_the_field(tmp_path, patch, field):
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump({**BASE, **patch}))
    with pytest.raises(SpecError) as info:
        load_model(str(path))
    message = str(info.value)
    assert info.value.field == field and info.value.source == str(path)
    assert message.startswith(f"{path}: {field}: expected") and "\n" not in message


def test_pattern_too_long_is_refused_before_it_is_built():
    with pytest.raises(SpecError, match="moe_layer_freq.*at most 4096") as info:
        model_from_dict({**BASE, **MOE, "moe_layer_freq": "[1]*" + "9" * 9}, source="m.yaml")
    assert "\n" not in str(info.value)


# --------------------------------------------------------------------------- Megatron args

def _namespace(**kw) -> Namespace:
    args = dict(num_layers=8, hidden_size=256, ffn_hidden_size=1024, num_attention_heads=8,
                group_query_attention=False, num_query_groups=1, padded_vocab_size=1024,
                seq_length=128, swiglu=False, untie_embeddings_and_output_weights=True,
                normalization="LayerNorm", kv_channels=None, add_bias_linear=False,
                position_embedding_type="learned_absolute", num_experts=8, moe_router_topk=2,
                moe_ffn_hidden_size=256, moe_layer_freq=[0, 0] + [1] * 6,
                moe_shared_expert_intermediate_size=256, moe_shared_expert_gate=False,
                multi_latent_attention=False, q_lora_rank=None, kv_lora_rank=32, qk_head_dim=128,
                qk_pos_emb_head_dim=64, v_head_dim=128, qk_layernorm=False, mtp_num_layers=None)
    args.update(kw)
    return Namespace(**args)


def test_megatron_args_give_the_yaml_model():
    yaml_model = load_model(str(EXAMPLES / "tiny-moe.yaml"))
    assert model_from_megatron_args(_namespace(), name="tiny-moe") == yaml_model
    # MindSpeed-LLM's spelling: --first-k-dense-replace 2, an int --moe-layer-freq, and
    # --n-shared-experts 1 (shared width = n x the routed experts')
    ms = model_from_megatron_args(_namespace(moe_layer_freq=1, first_k_dense_replace=2,
                                             moe_shared_expert_intermediate_size=None,
                                             n_shared_experts=1), name="tiny-moe")
    assert ms.layer_kind_of == yaml_model.layer_kind_of
    assert ms.signature() == yaml_model.signature()
    assert ms.total_params() == yaml_model.total_params()
    # MindSpeed-LLM v2.3.0 registers --moe-layer-freq with default None: every layer
    assert model_from_megatron_args(_namespace(moe_layer_freq=None)).kind_counts == (8,)


def test_megatron_args_mla_and_mindspeed_deprecated_names():
    kw = dict(num_experts=None, moe_layer_freq=1, moe_shared_expert_intermediate_size=None,
              hidden_size=128, num_attention_heads=4, kv_channels=64)
    m = model_from_megatron_args(_namespace(**kw, multi_latent_attention=True, q_lora_rank=24,
                                            kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4,
                                            v_head_dim=8, qk_layernorm=True, mtp_num_layers=1))
    assert m.attention.kind == "mla" and m.kv_channels is None and m.head_dim == 12
    assert (m.q_lora_rank, m.kv_lora_rank, m.v_head_dim, m.mtp_num_layers) == (24, 16, 8, 1)
    old = model_from_megatron_args(_namespace(
        **kw, deprecated_multi_head_latent_attention=True, q_lora_rank=24, kv_lora_rank=16,
        deprecated_qk_nope_head_dim=8, deprecated_qk_rope_head_dim=4, v_head_dim=8,
        qk_layernorm=True, mtp_num_layers=1))
    assert old == m
    moe = model_from_megatron_args(_namespace(moe_ffn_hidden_size=None,
                                              deprecated_moe_intermediate_size=64,
                                              moe_shared_expert_gate=True))
    assert moe.expert_ffn_hidden_size == 64 and moe.moe_shared_expert_gate


@pytest.mark.parametrize("kw, flag", [
    ({"experimental_attention_variant": "gated_delta_net"}, "--experimental-attention-variant"),
    ({"linear_attention_freq": 4}, "--linear-attention-freq"),
    ({"heterogeneous_layers_config_path": "h.json"}, "--heterogeneous-layers-config-path"),
    ({"hybrid_override_pattern": "M*M*"}, "--hybrid-override-pattern"),
    ({"moe_latent_size": 64}, "--moe-latent-size"),
    ({"attention_output_gate": True}, "--attention-output-gate"),
    ({"mtp_num_layers": 2, "mtp_use_repeated_layer": True}, "--mtp-use-repeated-layer"),
    ({"full_attention_interval": 4}, "--full-attention-interval"),
    ({"shared_expert_gate": True, "shared_expert_gate_output_dimension": 256},
     "--shared-expert-gate-output-dimension"),
    ({"num_experts": None, "first_k_dense_replace": 2}, "--first-k-dense-replace"),
    ({"num_experts": None, "n_shared_experts": 1, "moe_shared_expert_intermediate_size": None},
     "--n-shared-experts"),
])
def test_unmodelled_megatron_args_are_one_error_naming_the_flag(kw, flag):
    with pytest.raises(SpecError) as info:
        model_from_megatron_args(_namespace(**kw))
    assert info.value.field == flag and "\n" not in str(info.value)
    assert str(info.value).startswith(f"<megatron args>: {flag}: expected")


def test_bad_pattern_from_megatron_args_names_the_field():
    with pytest.raises(SpecError, match="<megatron args>: moe_layer_freq: expected one 0/1 entry"):
        model_from_megatron_args(_namespace(moe_layer_freq=[1] * 5))


# --------------------------------------------------------------------------- launch refusals

@pytest.mark.parametrize("argv, what, assumed", [
    (["--expert-tensor-parallel-size", "1"], "expert tensor parallelism", "expert TP = TP"),
])
def test_unplanned_parallelism_is_refused_precisely(argv, what, assumed):
    with pytest.raises(PoseidonError) as info:
        A.check_refused(["--num-layers", "61", *argv])
    message = str(info.value)
    flag = argv[0].split("=")[0]
    value = argv[-1].split("=")[-1]
    assert f"does not plan {what} yet ({flag} {value})" in message
    assert assumed in message and f"remove {flag}" in message and "\n" not in message


def test_size_one_parallelism_is_accepted():
    A.check_refused(["--expert-model-parallel-size", "1", "--context-parallel-size", "1"])


def test_context_parallelism_is_planned_but_not_other_cp_algorithms():
    A.check_refused(["--context-parallel-size=4", "--cp-comm-type", "p2p"])
    for argv, flag in ((["--context-parallel-size", "2", "--cp-comm-type", "a2a"],
                        "--cp-comm-type a2a"),
                       (["--hierarchical-context-parallel-sizes", "2", "2"],
                        "--hierarchical-context-parallel-sizes")):
        with pytest.raises(PoseidonError) as info:
            A.check_refused(argv)
        assert flag in str(info.value) and "\n" not in str(info.value)


# --------------------------------------------------------------------------- offline profile flags

@pytest.mark.integration
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_offline_profile_flags_build_the_models_layer(name):
    """``poseidon profile`` builds one layer from ``offline.model_flags``: read back through
    Megatron's parser it is the model's (heaviest, MoE) kind, MLA and shared experts included."""
    pytest.importorskip("megatron.training.arguments")
    from poseidon_plugin.megatron.profile.offline import model_flags
    from poseidon_plugin.megatron.profile.profiler import parse_megatron_args

    m = PRESETS[name]
    layer = model_from_megatron_args(parse_megatron_args("pretrain_gpt.py",
                                                         model_flags(m, 1024, 1)))
    kind = next(k for k in m.layer_kinds if k.is_moe) if m.is_moe else m.layer_kinds[0]
    assert layer.num_layers == 1 and layer.layer_kinds == (kind,)
    assert layer.signature() == m.kind_model(m.layer_kinds.index(kind)).signature()


# --------------------------------------------------------------------------- activations

@pytest.mark.parametrize("name", ["deepseek-v3", "tiny-moe", "qwen3-30b-a3b", "llama3-8b"])
def test_activation_estimate_bounds_every_kind(name):
    """The per-layer activation bytes the planner uses are the largest kind's (even where the
    dense layers keep more than the MoE layers), and a uniform model's own."""
    from poseidon_plugin.memory import layer_activation_bytes

    m = PRESETS.get(name) or get_model(str(EXAMPLES / f"{name}.yaml"))
    shape = dict(micro_batch_size=2, seq_length=128, tp=2)
    per_kind = [layer_activation_bytes(m.kind_model(i), **shape)
                for i in range(len(m.layer_kinds))]
    assert layer_activation_bytes(m, **shape) == max(per_kind)
    if name == "tiny-moe":   # without its shared expert, a MoE layer keeps less than a dense one
        lean = dataclasses.replace(m, moe_shared_expert_intermediate_size=0)
        one = dict(shape, tp=1)   # (at TP > 1 the routed copies, kept whole, tip it)
        dense, moe = (layer_activation_bytes(lean.kind_model(i), **one) for i in (0, 1))
        assert dense > moe and layer_activation_bytes(lean, **one) == dense


# --------------------------------------------------------------------------- the warning line

def test_plan_of_a_mixed_model_is_costed_per_stage(capsys):
    """No warning for a model of several layer kinds (each stage costs the layers it
    holds)."""
    import json

    from poseidon_plugin.cli import main

    def plan(model: str):
        rc = main(["plan", "--cluster", str(ROOT / "examples" / "clusters" / "small-two-type.yaml"),
                   "--model", model, "--global-batch-size", "16", "--seq-length", "128",
                   "--no-baselines", "--json"])
        assert rc == 0
        out = capsys.readouterr()
        return [ln for ln in out.err.splitlines() if "warning" in ln], out.out

    lines, out = plan(str(EXAMPLES / "tiny-moe.yaml"))
    assert lines == []
    assert plan(str(EXAMPLES / "tiny-gpt.yaml"))[0] == []
