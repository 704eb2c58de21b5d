"""The training setup as an input (``training.TrainingSetup``): bytes per parameter, attention,
recompute, read from Megatron's arguments, and what it does to memory, time and the profile key.
Core tests: no torch (one test reads real Megatron arguments when megatron-core is installed)."""

from __future__ import annotations

import types

import pytest

from poseidon_plugin import memory
from poseidon_plugin.cluster import cluster_from_dict
from poseidon_plugin.errors import PoseidonError
from poseidon_plugin.model import model_from_dict
from poseidon_plugin.profiles import estimate_profile, profile_key
from poseidon_plugin.training import TrainingSetup, megatron_flags, setup_from_megatron_args

MiB = 2 ** 20
# OPT-350M's decoder shape (public config): h 1024, 16 heads, f 4096, GeLU, LayerNorm, biases
OPT_350M = model_from_dict(dict(name="opt-350m", num_layers=24, hidden_size=1024,
                                ffn_hidden_size=4096, num_attention_heads=16, vocab_size=50272,
                                seq_length=2048, swiglu=False, normalization="LayerNorm",
                                add_bias_linear=True, position_embedding_type="learned_absolute"))
CLUSTER = cluster_from_dict({
    "device_types": {"A100": {"memory_gib": 40, "peak_tflops": 312, "intra_node_gbps": 2400}},
    "nodes": [{"device_type": "A100", "devices_per_node": 8}],
    "links": {"inter_node_gbps": 100, "cross_type_gbps": 100}})


def test_bytes_per_parameter():
    assert memory.bytes_per_param(4, False, TrainingSetup()) == (2, 4, 12)          # 18
    assert memory.bytes_per_param(4, False, TrainingSetup(distributed_optimizer=True)) \
        == (2, 4, 3)                                                                  # 6 + 12/dp
    assert memory.bytes_per_param(1, False, TrainingSetup(grad_dtype="bf16")) == (2, 2, 12)
    assert memory.bytes_per_param(1, False, TrainingSetup(params_dtype="fp32")) == (4, 4, 8)


def test_bad_setup_values_are_one_line_errors():
    with pytest.raises(PoseidonError, match="recompute: expected one of none, selective, full"):
        TrainingSetup(recompute="some")
    with pytest.raises(PoseidonError, match="attention"):
        TrainingSetup(attention="sdpa")


def test_unfused_attention_keeps_the_scores():
    """Measured on A100 (OPT-350M, seq 2048, unfused): 344 MiB per layer and sample, 5x the
    flash estimate (68 MiB). The setup's estimate is within 15 % of that measurement."""
    shape = dict(micro_batch_size=1, seq_length=2048, tp=1)
    flash = memory.layer_activation_bytes(OPT_350M, **shape)
    unfused = memory.layer_activation_bytes(OPT_350M, **shape,
                                            setup=TrainingSetup(attention="unfused"))
    assert flash / MiB == pytest.approx(68, abs=1)
    assert unfused - flash == 5 * 16 * 2048 * 2048
    assert unfused / MiB == pytest.approx(344, rel=0.15)
    # selective recompute re-computes the core attention: no s x s term
    sel = memory.layer_activation_bytes(
        OPT_350M, **shape, setup=TrainingSetup(attention="unfused", recompute="selective"))
    assert sel == flash


def test_full_recompute_keeps_the_layer_input_and_costs_a_forward():
    kw = dict(layers=6, stage=1, num_stages=4, tp=1, dp=1, micro_batch_size=1, seq_length=2048,
              num_microbatches=8)
    none = memory.stage_memory(OPT_350M, **kw, setup=TrainingSetup())
    full = memory.stage_memory(OPT_350M, **kw, setup=TrainingSetup(recompute="full"))
    assert full.activations_bytes < none.activations_bytes / 5
    key = dict(device_type="A100", layer_kind="decoder", tp=1, micro_batch_size=1)
    plain = estimate_profile(CLUSTER, OPT_350M, profile_key(OPT_350M, **key))
    rec = estimate_profile(CLUSTER, OPT_350M, profile_key(OPT_350M, **key,
                                                          setup=TrainingSetup(recompute="full")))
    sel = estimate_profile(CLUSTER, OPT_350M, profile_key(
        OPT_350M, **key, setup=TrainingSetup(recompute="selective")))
    assert rec.forward_ms == plain.forward_ms
    assert rec.backward_ms > plain.backward_ms + 0.9 * plain.forward_ms
    assert plain.backward_ms < sel.backward_ms < rec.backward_ms
    assert rec.activation_bytes == 2 * 2048 * 1024   # the bf16 layer input


def test_setup_is_part_of_the_profile_key():
    a = profile_key(OPT_350M, "A100", "decoder", 1, 1)
    b = profile_key(OPT_350M, "A100", "decoder", 1, 1, setup=TrainingSetup(attention="unfused"))
    assert a != b and (a.attention, b.attention) == ("flash", "unfused")
    # the optimizer and the gradient dtype do not change one layer's profile
    c = profile_key(OPT_350M, "A100", "decoder", 1, 1,
                    setup=TrainingSetup(distributed_optimizer=True, grad_dtype="bf16"))
    assert a == c


def _ns(**kw):
    base = dict(recompute_granularity=None, use_distributed_optimizer=False, bf16=True,
                fp16=False, grad_reduce_in_bf16=False, main_grads_dtype="fp32",
                attention_backend="AttnBackend.auto", transformer_impl="transformer_engine",
                use_flash_attn=False)
    base.update(kw)
    return types.SimpleNamespace(**base)


@pytest.mark.parametrize("kw, want", [
    ({}, TrainingSetup()),
    ({"transformer_impl": "local"}, TrainingSetup(attention="unfused")),
    ({"attention_backend": "AttnBackend.unfused"}, TrainingSetup(attention="unfused")),
    ({"recompute_granularity": "selective"}, TrainingSetup(recompute="selective")),
    ({"recompute_granularity": "full", "use_distributed_optimizer": True},
     TrainingSetup(recompute="full", distributed_optimizer=True)),
    ({"grad_reduce_in_bf16": True}, TrainingSetup(grad_dtype="bf16")),
    ({"bf16": False}, TrainingSetup(params_dtype="fp32")),
    ({"bf16": False, "fp16": True}, TrainingSetup(params_dtype="fp16")),
    ({"overlap_grad_reduce": True, "ddp_bucket_size": 1000},
     TrainingSetup(overlap_grad_reduce=True, ddp_bucket_size=1000)),
    ({"use_distributed_optimizer": True, "overlap_param_gather": True},
     TrainingSetup(distributed_optimizer=True, overlap_param_gather=True)),
])
def test_setup_from_megatron_args(kw, want):
    assert setup_from_megatron_args(_ns(**kw)) == want


def test_setup_from_real_megatron_arguments():
    pytest.importorskip("megatron.training.arguments")
    from poseidon_plugin.megatron.profile.profiler import parse_megatron_args

    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1"]
    flags = megatron_flags(TrainingSetup(recompute="full", distributed_optimizer=True))
    args = parse_megatron_args("pretrain_gpt.py", base + flags + ["--transformer-impl", "local"])
    assert setup_from_megatron_args(args) == TrainingSetup(
        recompute="full", distributed_optimizer=True, attention="unfused")
    args = parse_megatron_args("pretrain_gpt.py", base + ["--bf16"])
    assert setup_from_megatron_args(args) == TrainingSetup()
    args = parse_megatron_args("pretrain_gpt.py", base + [
        "--bf16", "--use-distributed-optimizer", "--overlap-grad-reduce",
        "--overlap-param-gather", "--ddp-bucket-size", "12345"])
    assert setup_from_megatron_args(args) == TrainingSetup(
        distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True,
        ddp_bucket_size=12345)


@pytest.mark.parametrize("kw, match", [
    ({"overlap_param_gather": True}, "needs the distributed optimizer"),
    ({"overlap_grad_reduce": 1}, "overlap_grad_reduce: expected true or false"),
    ({"ddp_bucket_size": -1}, "ddp_bucket_size: expected an integer >= 0"),
    ({"ddp_bucket_size": 2.5}, "ddp_bucket_size: expected an integer >= 0"),
])
def test_bad_overlap_setup_is_a_one_line_error(kw, match):
    from poseidon_plugin.errors import PoseidonError
    with pytest.raises(PoseidonError, match=match):
        TrainingSetup(**kw)
