"""Model spec: presets vs public figures, hand-computed counts, YAML and Megatron-args construction."""

from __future__ import annotations

import dataclasses
from argparse import Namespace
from pathlib import Path

import pytest
import yaml
from hypothesis import given, strategies as st

from poseidon_plugin.errors import SpecError
from poseidon_plugin.model import (
    PRESETS, ModelSpec, get_model, load_model, model_from_dict, model_from_megatron_args,
)

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "models"


# --------------------------------------------------------------------------- public figures

@pytest.mark.parametrize("name,billions", [
    ("llama3-8b", 8.03), ("llama2-13b", 13.0), ("llama3-70b", 70.6), ("mixtral-8x7b", 46.7),
    ("llama-30b", 32.5), ("llama3-405b", 405.9),
])
def test_presets_match_public_parameter_counts(name, billions):
    assert PRESETS[name].total_params() / 1e9 == pytest.approx(billions, rel=0.01)


def test_mixtral_active_params():
    assert PRESETS["mixtral-8x7b"].active_params() / 1e9 == pytest.approx(12.9, rel=0.01)
    assert PRESETS["llama3-8b"].active_params() == PRESETS["llama3-8b"].total_params()


def test_preset_names_and_registry():
    assert set(PRESETS) == {"llama3-8b", "llama2-13b", "llama-30b", "mixtral-8x7b", "llama3-70b",
                            "llama3-405b", "deepseek-v3", "qwen3-235b-a22b", "qwen3-30b-a3b"}
    for name, spec in PRESETS.items():
        assert spec.name == name
        assert get_model(name) is spec
    mix = PRESETS["mixtral-8x7b"]
    assert (mix.num_experts, mix.moe_top_k) == (8, 2)


# --------------------------------------------------------------------------- hand computed

def test_llama3_8b_hand_computed():
    m = PRESETS["llama3-8b"]
    h, f, a, g, V, L = 4096, 14336, 32, 8, 128256, 32
    d = h // a
    attention = h * a * d + 2 * h * g * d + a * d * h
    mlp = 3 * h * f
    norms = 2 * h
    assert m.layer_params() == attention + mlp + norms
    assert m.embedding_params() == h * V
    assert m.output_params() == h * V + h
    assert m.total_params() == L * (attention + mlp + norms) + 2 * h * V + h
    b, s = 2, 1024
    flops = (2 * b * s * h * (a * d + 2 * g * d) + 2 * b * s * a * d * h   # projections
             + 2 * b * s * s * a * d                                      # causal core
             + 2 * b * s * 3 * h * f)                                     # SwiGLU MLP
    assert m.layer_forward_flops(b, s) == pytest.approx(flops, rel=1e-12)
    assert m.output_forward_flops(b, s) == pytest.approx(2 * b * s * h * V)
    gbs = 8
    assert m.model_flops_per_iteration(gbs, s) == pytest.approx(
        3 * (L * m.layer_forward_flops(gbs, s) + 2 * gbs * s * h * V))


def test_mixtral_hand_computed():
    m = PRESETS["mixtral-8x7b"]
    h, f, a, g, E, k = 4096, 14336, 32, 8, 8, 2
    d = 128
    attention = 2 * h * a * d + 2 * h * g * d
    split = m.layer_param_split()
    assert split.tp_sharded == attention
    assert split.expert == E * 3 * h * f
    assert split.replicated == 2 * h + h * E
    b, s = 1, 4096
    mlp_flops = k * 2 * b * s * 3 * h * f + 2 * b * s * h * E
    assert m.mlp_forward_flops(b, s) == pytest.approx(mlp_flops)
    dense = dataclasses.replace(m, num_experts=0, moe_top_k=0)
    assert m.attention_forward_flops(b, s) == dense.attention_forward_flops(b, s)


def test_layernorm_bias_tied_learned_positions():
    m = ModelSpec(name="gpt", num_layers=2, hidden_size=64, ffn_hidden_size=256,
                  num_attention_heads=4, num_query_groups=4, vocab_size=100, seq_length=32,
                  swiglu=False, untie_embeddings=False, normalization="LayerNorm",
                  add_bias_linear=True, position_embedding_type="learned_absolute")
    h, f = 64, 256
    attention = 4 * h * h + 3 * h + h          # qkv + o weights, qkv bias, o bias
    mlp = 2 * h * f + f + h                    # fc1, fc2, biases
    norms = 2 * 2 * h
    assert m.layer_params() == attention + mlp + norms
    assert m.embedding_params() == h * 100 + 32 * h
    assert m.output_params() == 2 * h          # tied: final LayerNorm only
    split = m.layer_param_split()
    assert split.replicated == norms + h + h   # norms + row-parallel biases


def test_kv_channels_override():
    m = ModelSpec(name="x", num_layers=1, hidden_size=64, ffn_hidden_size=128,
                  num_attention_heads=4, num_query_groups=2, vocab_size=10, seq_length=8,
                  kv_channels=32)
    assert m.head_dim == 32
    assert m.layer_param_split().tp_sharded == 64 * (4 * 32 + 2 * 2 * 32) + 4 * 32 * 64 + 3 * 64 * 128


def test_signature_is_stable_and_shape_only():
    m = PRESETS["llama3-8b"]
    assert m.signature() == "h4096-f14336-a32-g8-d128-v128256-swiglu-rmsnorm-nobias-untied-pos-rope"
    renamed = dataclasses.replace(m, name="other", num_layers=3, seq_length=128)
    assert renamed.signature() == m.signature()
    assert dataclasses.replace(m, num_query_groups=4).signature() != m.signature()
    assert PRESETS["mixtral-8x7b"].signature().endswith("moe-e8-k2-f14336")


# --------------------------------------------------------------------------- YAML

def test_tiny_gpt_example():
    m = get_model(str(EXAMPLES / "tiny-gpt.yaml"))
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.ffn_hidden_size,
            m.vocab_size, m.seq_length) == (8, 256, 8, 1024, 1024, 128)
    assert m.name == "tiny-gpt"


def _write(tmp_path, data, name="m.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return str(path)


BASE = {"num_layers": 4, "hidden_size": 64, "ffn_hidden_size": 256, "num_attention_heads": 4,
        "vocab_size": 128, "seq_length": 32}


def test_yaml_defaults(tmp_path):
    m = load_model(_write(tmp_path, BASE, "mini.yaml"))
    assert m.name == "mini" and m.num_query_groups == 4 and m.num_experts == 0


@pytest.mark.parametrize("patch,field", [
    ({"num_layers": 0}, "num_layers"),
    ({"num_layers": "4"}, "num_layers"),
    ({"hidden_size": -1}, "hidden_size"),
    ({"hidden_size": 66}, "hidden_size"),              # not divisible by heads
    ({"num_query_groups": 3}, "num_query_groups"),
    ({"num_experts": -1}, "num_experts"),
    ({"num_experts": 4, "moe_top_k": 5}, "moe_top_k"),
    ({"num_experts": 4}, "moe_top_k"),                 # top-k 0 with experts
    ({"moe_top_k": 2}, "moe_top_k"),                   # top-k without experts
    ({"swiglu": "yes"}, "swiglu"),
    ({"normalization": "BatchNorm"}, "normalization"),
    ({"position_embedding_type": "alibi"}, "position_embedding_type"),
    ({"kv_channels": 0}, "kv_channels"),
    ({"num_layer": 4}, "num_layer"),                   # typo
    ({"vocab_size": None}, "vocab_size"),
])
def test_yaml_errors(tmp_path, patch, field):
    data = {**BASE, **patch}
    path = _write(tmp_path, data)
    with pytest.raises(SpecError) as info:
        load_model(path)
    assert info.value.source == path
    assert info.value.field == field
    assert str(info.value).startswith(f"{path}: {field}: expected")


def test_yaml_missing_field(tmp_path):
    data = dict(BASE)
    del data["seq_length"]
    path = _write(tmp_path, data)
    with pytest.raises(SpecError, match="seq_length: expected a value, got 'missing'"):
        load_model(path)


def test_yaml_file_errors(tmp_path):
    with pytest.raises(SpecError, match="readable"):
        load_model(str(tmp_path / "nope.yaml"))
    with pytest.raises(SpecError, match="valid YAML"):
        load_model(_write(tmp_path, "a: [1"))
    with pytest.raises(SpecError, match="empty file"):
        load_model(_write(tmp_path, ""))
    with pytest.raises(SpecError, match="mapping"):
        load_model(_write(tmp_path, "[1, 2]"))
    with pytest.raises(SpecError, match="preset") as info:
        get_model("llama-7")
    assert info.value.field == "model"


def test_direct_construction_validates():
    with pytest.raises(SpecError, match="<ModelSpec>: num_layers"):
        ModelSpec(name="x", num_layers=0, hidden_size=64, ffn_hidden_size=1,
                  num_attention_heads=4, num_query_groups=4, vocab_size=1, seq_length=1)


# --------------------------------------------------------------------------- Megatron args

def megatron_namespace(**kw) -> Namespace:
    args = dict(num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
                group_query_attention=True, num_query_groups=8, padded_vocab_size=128256,
                vocab_size=None, seq_length=8192, num_experts=None, moe_router_topk=2,
                swiglu=True, untie_embeddings_and_output_weights=True, normalization="RMSNorm",
                kv_channels=None, add_bias_linear=False, position_embedding_type="rope",
                moe_ffn_hidden_size=None, make_vocab_size_divisible_by=128)
    args.update(kw)
    return Namespace(**args)


def test_from_megatron_args_llama3():
    m = model_from_megatron_args(megatron_namespace())
    assert m.total_params() == PRESETS["llama3-8b"].total_params()
    assert m.signature() == PRESETS["llama3-8b"].signature()


def test_from_megatron_args_defaults_and_moe():
    m = model_from_megatron_args(megatron_namespace(
        group_query_attention=False, ffn_hidden_size=None, padded_vocab_size=None,
        vocab_size=1000, num_experts=8, swiglu=False))
    assert m.num_query_groups == 32
    assert m.ffn_hidden_size == 4 * 4096
    assert m.vocab_size == 1024                     # padded to a multiple of 128
    assert (m.num_experts, m.moe_top_k) == (8, 2)
    sw = model_from_megatron_args(megatron_namespace(ffn_hidden_size=None))
    assert sw.ffn_hidden_size == int(4 * 4096 * 2 / 3 / 64) * 64


def test_from_megatron_args_minimal_namespace():
    # the fields a plain (unvalidated) parse might leave out fall back to Megatron's defaults
    m = model_from_megatron_args(Namespace(num_layers=2, hidden_size=64, num_attention_heads=4,
                                           seq_length=16, vocab_size=100))
    assert m.normalization == "LayerNorm" and not m.swiglu and not m.untie_embeddings
    assert m.position_embedding_type == "learned_absolute"


def test_from_megatron_args_errors():
    with pytest.raises(SpecError, match="<megatron args>: padded_vocab_size"):
        model_from_megatron_args(megatron_namespace(padded_vocab_size=None, vocab_size=None))
    with pytest.raises(SpecError, match="<megatron args>: num_layers"):
        model_from_megatron_args(megatron_namespace(num_layers=None))
    with pytest.raises(SpecError, match="<megatron args>: num_query_groups"):
        model_from_megatron_args(megatron_namespace(num_query_groups=5))


# --------------------------------------------------------------------------- properties

@st.composite
def dense_models(draw) -> ModelSpec:
    heads = draw(st.sampled_from([1, 2, 4, 8]))
    groups = draw(st.sampled_from([g for g in (1, 2, 4, 8) if heads % g == 0]))
    return ModelSpec(name="p", num_layers=draw(st.integers(1, 8)),
                     hidden_size=heads * draw(st.integers(1, 32)),
                     ffn_hidden_size=draw(st.integers(1, 512)), num_attention_heads=heads,
                     num_query_groups=groups, vocab_size=draw(st.integers(1, 1000)),
                     seq_length=draw(st.integers(1, 512)), swiglu=draw(st.booleans()),
                     untie_embeddings=draw(st.booleans()))


@given(dense_models(), st.integers(1, 4), st.integers(1, 256))
def test_flops_properties(m, b, s):
    # linear in the micro-batch; super-linear (attention) but at most quadratic in the sequence
    assert m.layer_forward_flops(2 * b, s) == pytest.approx(2 * m.layer_forward_flops(b, s))
    assert 2 * m.layer_forward_flops(b, s) <= m.layer_forward_flops(b, 2 * s) \
        <= 4 * m.layer_forward_flops(b, s) + 1e-6
    # at least 2 FLOPs per matrix parameter per token
    assert m.layer_forward_flops(b, s) >= 2 * b * s * (m.layer_params() - 2 * m.norm_params)
    assert m.total_params() == m.num_layers * m.layer_params() + m.embedding_params() \
        + m.output_params()


@pytest.mark.integration
def test_from_real_megatron_parse_args(monkeypatch):
    """The tiny-gpt YAML's Megatron flags, parsed by megatron's own (unvalidated) parser."""
    import sys
    arguments = pytest.importorskip("megatron.training.arguments")
    monkeypatch.setattr(sys, "argv", [
        "pretrain_gpt.py", "--num-layers", "8", "--hidden-size", "256", "--num-attention-heads", "8",
        "--ffn-hidden-size", "1024", "--vocab-size", "1024", "--seq-length", "128",
        "--max-position-embeddings", "128", "--untie-embeddings-and-output-weights",
        "--disable-bias-linear", "--micro-batch-size", "1"])
    args = arguments.parse_args(ignore_unknown_args=True)
    m = model_from_megatron_args(args, name="tiny-gpt")
    assert m == get_model(str(EXAMPLES / "tiny-gpt.yaml"))
