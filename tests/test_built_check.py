"""The layers the framework builds against the plan's model (issue 36 item 10): MindSpeed-LLM's
own rule for which layers are MoE (its ``pretrain_gpt.py`` and block build), the profiler's
spec of each kind built as MindSpeed-LLM builds it, and the check of the built decoder blocks
(poseidon_plugin/megatron/launch/built_check.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from poseidon_plugin.errors import PoseidonError
from poseidon_plugin.layers import moe_layer_pattern
from poseidon_plugin.megatron.launch import built_check
from poseidon_plugin.megatron.profile.profiler import mindspeed_llm_moe_pattern


def test_mindspeed_llm_builds_every_layer_moe_without_first_k_dense():
    # its pretrain_gpt.py: one MoE layer spec for every layer; --moe-layer-freq not read
    assert mindspeed_llm_moe_pattern(8, 4, None, [0, 0, 1, 1, 1, 1, 1, 1]) == (1,) * 8
    assert mindspeed_llm_moe_pattern(8, 4, None, 2) == (1,) * 8
    assert mindspeed_llm_moe_pattern(4, None, None, 1) == (0,) * 4
    # its block build with --first-k-dense-replace: i >= k and i % freq == 0
    assert mindspeed_llm_moe_pattern(6, 4, 1, 1) == (0, 1, 1, 1, 1, 1)
    assert mindspeed_llm_moe_pattern(6, 4, 1, 2) == (0, 0, 1, 0, 1, 0)
    assert mindspeed_llm_moe_pattern(6, 4, 2, [1] * 6) is None     # its % needs an int
    # where MindSpeed-LLM reads the flags, the planner reads them alike
    for k, freq in ((1, 1), (2, 1), (1, 2), (3, 3)):
        assert mindspeed_llm_moe_pattern(12, 8, k, freq) == moe_layer_pattern(12, freq, k)


def test_a_built_layer_of_another_kind_is_one_line():
    planned = (False, True, True, True)
    assert built_check.mismatch([(1, False), (2, True)], planned, "MindSpeed-LLM") is None
    line = built_check.mismatch([(1, True), (2, True)], planned, "MindSpeed-LLM")
    assert line.startswith("MindSpeed-LLM built layer 1 as a MoE layer; the plan's model has a "
                           "dense layer there") and "\n" not in line
    # --num-layer-list's numbering (stage 1 of 2,6 numbered 5..10 of 8)
    line = built_check.mismatch([(9, True)], (True,) * 8, "MindSpeed-LLM")
    assert "built decoder layer number 9, but the model has 8 layers" in line
    # a dense model: its layers are alike, whatever the framework numbers them (2.3.0)
    assert built_check.mismatch([(9, False), (10, False)], (False,) * 8, "MindSpeed-LLM") is None


class _Layer:
    def __init__(self, number, moe):
        self.layer_number = number
        self.mlp = type("MoELayer" if moe else "MLP", (), {})()


def test_built_kinds_reads_the_layers_and_their_mlp_class():
    block = SimpleNamespace(layers=[_Layer(3, False), _Layer(4, True), SimpleNamespace()])
    assert built_check.built_kinds(block) == [(3, False), (4, True)]


def test_the_check_runs_when_megatron_builds_a_block(monkeypatch):
    """Installed on megatron-core's TransformerBlock: a block whose layers differ from the plan
    ends the rank with the line (exit code of ``fail``); the undo puts the class back."""
    tb = pytest.importorskip("megatron.core.transformer.transformer_block")

    def fake_init(self, layers):
        self.layers = layers

    monkeypatch.setattr(tb.TransformerBlock, "__init__", fake_init)
    seen = []
    undo = built_check.install([False, True], "Megatron", lambda e: seen.append(str(e)) or 2)
    try:
        tb.TransformerBlock.__new__(tb.TransformerBlock).__init__([_Layer(1, False),
                                                                   _Layer(2, True)])
        with pytest.raises(SystemExit) as exit_:
            tb.TransformerBlock.__new__(tb.TransformerBlock).__init__([_Layer(1, True)])
        assert exit_.value.code == 2
        assert seen == ["Megatron built layer 1 as a MoE layer; the plan's model has a dense "
                        "layer there (its layers are costed as the planner read --num-experts / "
                        "--moe-layer-freq / --first-k-dense-replace): not launching a model other "
                        "than the one planned"]
    finally:
        undo()
    assert tb.TransformerBlock.__init__ is fake_init


def test_mindspeed_llm_flags_it_would_not_build_are_refused():
    from poseidon_plugin.megatron.launch.runner import _check_mindspeed_llm_layers
    from poseidon_plugin.model import model_from_megatron_args

    base = dict(num_layers=8, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                seq_length=64, max_position_embeddings=64, padded_vocab_size=256,
                vocab_size=256, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64)
    args = SimpleNamespace(**base, moe_layer_freq=[0] * 2 + [1] * 6, first_k_dense_replace=None)
    model = model_from_megatron_args(args)
    with pytest.raises(PoseidonError, match=r"MindSpeed-LLM builds the layers as \[1\]\*8 "
                       r"\(1: MoE\), not \[0\]\*2\+\[1\]\*6"):
        _check_mindspeed_llm_layers(args, model)
    args = SimpleNamespace(**base, moe_layer_freq=1, first_k_dense_replace=2)
    _check_mindspeed_llm_layers(args, model_from_megatron_args(args))    # as it builds them


@pytest.mark.parametrize("fmt,save,refused", [
    ("torch_dist", "ckpt", True), (None, "ckpt", True), ("torch", "ckpt", False),
    ("torch_dist", None, False)])
def test_a_mindspeed_llm_first_k_dense_save_it_cannot_write_is_refused(fmt, save, refused):
    """MindSpeed-LLM v26.1.0's torch_dist save of a --first-k-dense-replace model died on every
    rank (CheckpointingException, seen under the launch); refused in one line before anything
    runs, where it would save in that format. An all-MoE model saves (no refusal)."""
    from poseidon_plugin.megatron.launch.runner import _check_mindspeed_llm_layers
    from poseidon_plugin.model import model_from_megatron_args

    base = dict(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                seq_length=64, max_position_embeddings=64, padded_vocab_size=256,
                vocab_size=256, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64,
                moe_layer_freq=1, save=save, ckpt_format=fmt)
    args = SimpleNamespace(**base, first_k_dense_replace=1)
    model = model_from_megatron_args(args)
    if refused:
        with pytest.raises(PoseidonError, match=r"MindSpeed-LLM cannot save this model with "
                           r"--ckpt-format torch_dist: .*--ckpt-format torch"):
            _check_mindspeed_llm_layers(args, model)
    else:
        _check_mindspeed_llm_layers(args, model)
    all_moe = SimpleNamespace(**base, first_k_dense_replace=None)
    _check_mindspeed_llm_layers(all_moe, model_from_megatron_args(all_moe))


def test_attention_of_another_kind_is_one_line():
    """MindSpeed-LLM's pretrain_gpt.py builds plain self-attention for --multi-latent-attention
    without --spec: the plan priced MLA, so the launch stops, naming the spec its recipes use."""
    class SelfAttention:
        pass

    class MLASelfAttention:
        pass

    class CustomMLASelfAttention(MLASelfAttention):
        pass

    class IdentityOp:
        pass

    def block(*attentions):
        return SimpleNamespace(layers=[SimpleNamespace(layer_number=i + 1, self_attention=a())
                                       for i, a in enumerate(attentions)])

    assert built_check.attention_mismatch(block(CustomMLASelfAttention), True, "MindSpeed-LLM") \
        is None
    assert built_check.attention_mismatch(block(SelfAttention), False, "Megatron") is None
    assert built_check.attention_mismatch(block(IdentityOp, SelfAttention), False, "x") is None
    line = built_check.attention_mismatch(block(SelfAttention), True, "MindSpeed-LLM")
    assert line.startswith("MindSpeed-LLM built layer 1's attention as SelfAttention, but the "
                           "plan's model has multi-latent attention") and "\n" not in line
    assert "--spec mindspeed_llm.tasks.models.spec.deepseek_spec layer_spec" in line
    line = built_check.attention_mismatch(block(MLASelfAttention), False, "Megatron")
    assert "has no multi-latent attention" in line and "--spec" not in line
