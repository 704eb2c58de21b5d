"""Per-stage memory model: in-flight counts, components, properties, and agreement with megatron-core.

Agreement with megatron-core's ``theoretical_memory_usage`` (integration tests at the bottom):
for an EVEN split, stage 0's weights+optimizer and activations are compared with
``compute_weight_and_optimizer_memory`` and ``compute_activation_memory`` /
``compute_activation_memory_without_sp`` on a namespace built by megatron's own argument parser.
Tolerance: relative 1e-9 (float rounding), after removing three deliberate, exactly known
differences:
  * megatron spreads the final norm over the stages (final_norm/pp on stage 0); we put it on the
    last stage -> megatron's stage 0 has ``norm_params/pp * bytes_per_param`` more;
  * megatron's ``_without_sp`` multiplies activations by a 1.05 overhead; we do not (the planner
    keeps its own head-room) -> we compare against megatron / 1.05;
  * with one stage megatron keeps bf16 logits ``2*s*b*V/t`` (without SP) or counts ``4*s*b*h/t``
    for the output layer's input (with SP); we keep fp32 logits ``4*s*b*V/t`` (the vocab-parallel
    cross-entropy keeps them for backward) and ``2*s*b*h`` (/t with SP) for the input.
Megatron's activation formula ignores GQA and SwiGLU (``10 + 24/t`` per s*b*h); ours counts them, so
for LLaMA-style models the per-layer coefficients differ — asserted exactly below too.
"""

from __future__ import annotations

import dataclasses
import math
import sys

import pytest
from hypothesis import given, settings, strategies as st

from poseidon_plugin.errors import PoseidonError
from poseidon_plugin.memory import (
    SCHEDULES, StageMemory, layer_activation_bytes, microbatches_in_flight, stage_memory,
    stage_params,
)
from poseidon_plugin.model import PRESETS, ModelSpec

GPT = ModelSpec(name="gpt", num_layers=8, hidden_size=256, ffn_hidden_size=1024,
                num_attention_heads=8, num_query_groups=8, vocab_size=1024, seq_length=128,
                swiglu=False, normalization="LayerNorm", untie_embeddings=True)


# --------------------------------------------------------------------------- in flight

@pytest.mark.parametrize("schedule,stage,n,m,expected", [
    ("gpipe", 0, 4, 8, 8), ("gpipe", 3, 4, 8, 8),
    ("1f1b", 0, 4, 8, 4), ("1f1b", 3, 4, 8, 1), ("1f1b", 0, 4, 2, 2), ("1f1b", 1, 4, 8, 3),
    ("eager-1f1b", 0, 4, 16, 7), ("eager-1f1b", 3, 4, 16, 1), ("eager-1f1b", 1, 4, 16, 5),
    ("eager-1f1b", 0, 4, 3, 3),
    ("1f1b", 0, 1, 5, 1), ("eager-1f1b", 0, 1, 5, 1),
])
def test_in_flight(schedule, stage, n, m, expected):
    assert microbatches_in_flight(schedule, stage, n, m) == expected


def test_in_flight_interleaved():
    # megatron-core: warm-up = 2(N-1-s) + (V-1)*N chunks, +1 before the first backward, / V
    n, v, m = 4, 2, 8
    for s in range(n):
        w = 2 * (n - 1 - s) + (v - 1) * n
        assert microbatches_in_flight("interleaved-1f1b", s, n, m, v) == (w + 1) / v
    # stage 0 equals megatron's interleaving penalty (1 + (N-1)/(N V)) times N
    for n, v in [(2, 2), (4, 2), (4, 3), (8, 4)]:
        penalty = 1 + (n - 1) / (n * v)
        assert microbatches_in_flight("interleaved-1f1b", 0, n, 64, v) == pytest.approx(penalty * n)
    # all in warm-up: capped at M*V chunks = M stages' worth
    assert microbatches_in_flight("interleaved-1f1b", 0, 4, 2, 2) == 2
    assert microbatches_in_flight("interleaved-1f1b", 0, 1, 4, 2) == 1
    # V = 1 reduces to 1F1B
    for s in range(4):
        assert microbatches_in_flight("interleaved-1f1b", s, 4, 8, 1) == \
            microbatches_in_flight("1f1b", s, 4, 8)
    # explicit micro-batch group size
    assert microbatches_in_flight("interleaved-1f1b", 0, 4, 16, 2, microbatch_group_size=8) == \
        (2 * 3 + 8 + 1) / 2


@pytest.mark.parametrize("args", [
    ("zigzag", 0, 4, 8), ("1f1b", 4, 4, 8), ("1f1b", -1, 4, 8), ("1f1b", 0, 0, 8),
    ("1f1b", 0, 4, 0),
])
def test_in_flight_errors(args):
    with pytest.raises(PoseidonError):
        microbatches_in_flight(*args)
    with pytest.raises(PoseidonError):
        microbatches_in_flight("interleaved-1f1b", 0, 4, 8, 0)


# --------------------------------------------------------------------------- formulas

def _small_terms(model, s, b, t, sp=False):
    """What the model keeps beyond Korthikanti's table (held to megatron-core's layers by
    fidelity/memory_check.py): the two norms' fp32 1/rms (8 bytes per token, /t with SP) and
    flash attention's fp32 log-sum-exp (4 bytes per head, sharded)."""
    return s * b * (8 / (t if sp else 1) + 4 * model.num_attention_heads / t)


def test_korthikanti_reduction_mha_gelu():
    s, b, h = 128, 2, 256
    for t in (1, 2, 4, 8):
        assert layer_activation_bytes(GPT, micro_batch_size=b, seq_length=s, tp=t) == \
            pytest.approx(s * b * h * (10 + 24 / t) + _small_terms(GPT, s, b, t))
        assert layer_activation_bytes(GPT, micro_batch_size=b, seq_length=s, tp=t,
                                      sequence_parallel=True) == \
            pytest.approx(s * b * h * 34 / t + _small_terms(GPT, s, b, t, sp=True))


def test_gqa_swiglu_moe_activation_terms():
    m = PRESETS["llama3-8b"]
    s, b, h, a, g, d, f = 4096, 1, 4096, 32, 8, 128, 14336
    assert layer_activation_bytes(m, micro_batch_size=b, seq_length=s, tp=2) == pytest.approx(
        s * b * (10 * h + (4 * a * d + 4 * g * d + 6 * f) / 2) + _small_terms(m, s, b, 2))
    mix = PRESETS["mixtral-8x7b"]
    k = 2   # the routed copies (2kh) and the router's indices / probabilities (12k): not /TP
    for t, sp in ((1, False), (2, True), (4, True)):
        assert layer_activation_bytes(mix, micro_batch_size=b, seq_length=s, tp=t,
                                      sequence_parallel=sp) == pytest.approx(
            s * b * ((10 * h + 4 * a * d + 4 * g * d + k * 6 * f) / t + k * (2 * h + 12))
            + _small_terms(mix, s, b, t, sp))


def kw(**over):
    base = dict(layers=2, stage=0, num_stages=4, tp=1, dp=1, micro_batch_size=1, seq_length=128,
                num_microbatches=8)
    base.update(over)
    return base


def test_components_and_bytes_per_param():
    mem = stage_memory(GPT, **kw(stage=1))
    params = 2 * GPT.layer_params()
    assert (mem.weights_bytes, mem.gradients_bytes, mem.optimizer_bytes) == \
        (2 * params, 4 * params, 12 * params)
    assert mem.total_bytes == mem.weights_bytes + mem.gradients_bytes + mem.optimizer_bytes \
        + mem.activations_bytes
    per_layer = layer_activation_bytes(GPT, micro_batch_size=1, seq_length=128, tp=1)
    assert mem.activations_bytes == math.ceil(2 * per_layer * 3)   # 1F1B: N - s = 3 in flight
    dist = stage_memory(GPT, **kw(stage=1, dp=4), distributed_optimizer=True)
    assert dist.optimizer_bytes == 3 * params                        # 12 / dp
    assert dist.weights_bytes + dist.gradients_bytes == 6 * params


def test_embedding_first_output_last():
    h, V, s = 256, 1024, 128
    first = stage_memory(GPT, **kw(stage=0))
    mid = stage_memory(GPT, **kw(stage=1))
    last = stage_memory(GPT, **kw(stage=3))
    # parameters: word embedding + learned positions? (rope: none) on stage 0; norm + output last
    assert first.weights_bytes - mid.weights_bytes == 2 * h * V
    assert last.weights_bytes - mid.weights_bytes == 2 * (h * V + 2 * h)
    per_layer = layer_activation_bytes(GPT, micro_batch_size=1, seq_length=s, tp=1)
    assert first.activations_bytes == math.ceil((2 * per_layer + 8 * s + s * h) * 4)
    assert last.activations_bytes == math.ceil(2 * per_layer + 2 * s * h + 4 * s * V)


def test_tied_embeddings_copy_on_last_stage_only_with_pipeline():
    tied = dataclasses.replace(GPT, untie_embeddings=False)
    layer = tied.layer_param_split().per_device(2)
    one = stage_params(tied, layers=8, stage=0, num_stages=1, tp=2)
    assert one == 8 * layer + 256 * 1024 / 2 + 2 * 256        # one copy of the table
    first = stage_params(tied, layers=4, stage=0, num_stages=2, tp=2)
    last = stage_params(tied, layers=4, stage=1, num_stages=2, tp=2)
    assert first == 4 * layer + 256 * 1024 / 2
    assert last == 4 * layer + 256 * 1024 / 2 + 2 * 256        # its own copy for the output


def test_recompute_keeps_layer_inputs():
    s, h = 128, 256
    full = stage_memory(GPT, **kw(stage=1, layers=4))
    rec = stage_memory(GPT, **kw(stage=1, layers=4), recompute=True)
    per_layer = layer_activation_bytes(GPT, micro_batch_size=1, seq_length=s, tp=1)
    assert rec.activations_bytes == math.ceil(4 * 2 * s * h * 3 + per_layer)
    assert rec.activations_bytes < full.activations_bytes
    assert rec.weights_bytes == full.weights_bytes


def test_activation_override():
    mem = stage_memory(GPT, **kw(stage=1), layer_activation_bytes_override=1000)
    assert mem.activations_bytes == 2 * 1000 * 3


def test_moe_weights_all_experts_sharded_by_tp():
    mix = PRESETS["mixtral-8x7b"]
    split = mix.layer_param_split()
    params = stage_params(mix, layers=1, stage=1, num_stages=3, tp=4)
    assert params == (split.tp_sharded + split.expert) / 4 + split.replicated


def test_stage_memory_errors():
    with pytest.raises(PoseidonError):
        stage_memory(GPT, **kw(layers=-1))
    with pytest.raises(PoseidonError):
        stage_memory(GPT, **kw(tp=0))
    with pytest.raises(PoseidonError):
        stage_memory(GPT, **kw(stage=4))
    with pytest.raises(PoseidonError):
        stage_memory(GPT, **kw(), schedule="nope")


# --------------------------------------------------------------------------- properties

common = dict(
    layers=st.integers(0, 16), stage=st.integers(0, 7), extra_stages=st.integers(0, 7),
    tp=st.sampled_from([1, 2, 4, 8]), dp=st.integers(1, 8), mbs=st.integers(1, 4),
    m=st.integers(1, 32), schedule=st.sampled_from(SCHEDULES), v=st.integers(1, 3),
    dist=st.booleans(), rec=st.booleans(), sp=st.booleans(),
)


@settings(max_examples=200, deadline=None)
@given(**common)
def test_memory_monotone_in_layers_and_microbatches(layers, stage, extra_stages, tp, dp, mbs, m,
                                                    schedule, v, dist, rec, sp):
    n = stage + 1 + extra_stages
    args = dict(stage=stage, num_stages=n, tp=tp, dp=dp, micro_batch_size=mbs, seq_length=64,
                schedule=schedule, virtual_stages=v, distributed_optimizer=dist, recompute=rec,
                sequence_parallel=sp)
    base = stage_memory(GPT, layers=layers, num_microbatches=m, **args)
    more_layers = stage_memory(GPT, layers=layers + 1, num_microbatches=m, **args)
    more_mb = stage_memory(GPT, layers=layers, num_microbatches=m + 1, **args)
    assert isinstance(base, StageMemory)
    assert more_layers.total_bytes > base.total_bytes
    assert more_layers.activations_bytes >= base.activations_bytes
    assert more_mb.total_bytes >= base.total_bytes      # in-flight count is monotone in M
    assert microbatches_in_flight(schedule, stage, n, m + 1, v) >= \
        microbatches_in_flight(schedule, stage, n, m, v)


@settings(max_examples=100, deadline=None)
@given(stage=st.integers(0, 7), extra=st.integers(1, 7), m=st.integers(1, 64))
def test_schedule_ordering(stage, extra, m):
    n = stage + 1 + extra
    one = microbatches_in_flight("1f1b", stage, n, m)
    eager = microbatches_in_flight("eager-1f1b", stage, n, m)
    gpipe = microbatches_in_flight("gpipe", stage, n, m)
    assert 1 <= one <= eager <= gpipe == m
    # earlier stages hold at least as much as later ones
    if stage + 1 < n:
        assert microbatches_in_flight("1f1b", stage + 1, n, m) <= one


@settings(max_examples=100, deadline=None)
@given(tp=st.sampled_from([1, 2, 4, 8]), mbs=st.integers(1, 4))
def test_tp_and_sp_shrink_activations(tp, mbs):
    a = layer_activation_bytes(GPT, micro_batch_size=mbs, seq_length=64, tp=tp)
    a2 = layer_activation_bytes(GPT, micro_batch_size=mbs, seq_length=64, tp=2 * tp)
    sp = layer_activation_bytes(GPT, micro_batch_size=mbs, seq_length=64, tp=tp,
                                sequence_parallel=True)
    assert a2 < a and sp <= a


# --------------------------------------------------------------------------- megatron-core

def _megatron_args(monkeypatch, model: ModelSpec, *, tp: int, pp: int, dp: int, mbs: int,
                   vpp: int | None = None, distributed_optimizer: bool = False,
                   sequence_parallel: bool = False):
    """A real namespace from megatron's parser, with the fields validate_args would derive."""
    arguments = pytest.importorskip("megatron.training.arguments")
    argv = ["pretrain_gpt.py", "--num-layers", str(model.num_layers),
            "--hidden-size", str(model.hidden_size),
            "--ffn-hidden-size", str(model.ffn_hidden_size),
            "--num-attention-heads", str(model.num_attention_heads),
            "--seq-length", str(model.seq_length), "--micro-batch-size", str(mbs),
            "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
            "--normalization", model.normalization, "--disable-bias-linear",
            "--position-embedding-type", "rope"]
    if model.num_query_groups != model.num_attention_heads:
        argv += ["--group-query-attention", "--num-query-groups", str(model.num_query_groups)]
    if model.swiglu:
        argv += ["--swiglu"]
    if model.untie_embeddings:
        argv += ["--untie-embeddings-and-output-weights"]
    if model.is_moe:
        argv += ["--num-experts", str(model.num_experts), "--moe-router-topk",
                 str(model.moe_top_k)]
    if distributed_optimizer:
        argv += ["--use-distributed-optimizer"]
    if sequence_parallel:
        argv += ["--sequence-parallel", "--recompute-granularity", "selective"]
    monkeypatch.setattr(sys, "argv", argv)
    args = arguments.parse_args(ignore_unknown_args=True)
    # what validate_args / the tokenizer would set
    args.kv_channels = model.hidden_size // model.num_attention_heads
    args.padded_vocab_size = model.vocab_size
    args.world_size = tp * pp * dp
    args.data_parallel_size = dp
    args.expert_tensor_parallel_size = tp
    args.virtual_pipeline_model_parallel_size = vpp
    if model.is_moe:
        args.moe_ffn_hidden_size = model.expert_ffn_hidden_size
    assert args.num_query_groups is None or args.group_query_attention \
        or args.num_query_groups == 1
    return args


CASES = [
    # (model, tp, pp, dp, mbs, M, vpp, distributed optimizer, sequence parallel)
    (GPT, 1, 2, 2, 1, 8, None, False, False),
    (GPT, 2, 4, 1, 2, 8, None, True, False),
    (GPT, 2, 4, 2, 1, 2, None, False, False),        # M < pp: fewer in flight
    (GPT, 4, 2, 2, 1, 8, None, False, True),
    (GPT, 2, 4, 1, 1, 16, 2, False, False),          # interleaved
    (GPT, 2, 1, 4, 1, 8, None, True, False),         # one stage: output on stage 0
    (GPT, 2, 1, 4, 1, 8, None, False, True),
    (dataclasses.replace(PRESETS["llama3-8b"], num_layers=8, seq_length=1024), 2, 2, 2, 1, 8,
     None, True, False),
    (dataclasses.replace(PRESETS["mixtral-8x7b"], num_layers=4, seq_length=512), 2, 2, 2, 1, 4,
     None, True, False),
]


@pytest.mark.integration
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0].name}-tp{c[1]}pp{c[2]}dp{c[3]}"
                         f"-mbs{c[4]}-M{c[5]}-v{c[6]}-do{int(c[7])}-sp{int(c[8])}")
def test_stage0_agrees_with_megatron(monkeypatch, case):
    model, tp, pp, dp, mbs, m, vpp, dist, sp = case
    tmu = pytest.importorskip("megatron.training.theoretical_memory_usage")
    args = _megatron_args(monkeypatch, model, tp=tp, pp=pp, dp=dp, mbs=mbs, vpp=vpp,
                          distributed_optimizer=dist, sequence_parallel=sp)
    ours = stage_memory(model, layers=model.num_layers // pp, stage=0, num_stages=pp, tp=tp,
                        dp=dp, micro_batch_size=mbs, seq_length=model.seq_length,
                        num_microbatches=m,
                        schedule="interleaved-1f1b" if vpp else "1f1b",
                        virtual_stages=vpp or 1, distributed_optimizer=dist,
                        sequence_parallel=sp)

    # weights + gradients + optimizer
    theirs_weights = tmu.compute_weight_and_optimizer_memory(args)
    per_param = 6 + 12 / dp if dist else 18
    final_norm_share = model.norm_params / pp if pp > 1 else 0
    ours_weights = ours.weights_bytes + ours.gradients_bytes + ours.optimizer_bytes
    assert ours_weights == pytest.approx(theirs_weights - final_norm_share * per_param, rel=1e-9)

    # activations
    s, b, h, V = model.seq_length, mbs, model.hidden_size, model.vocab_size
    if sp:
        theirs = tmu.compute_activation_memory(args, num_microbatches=m)
        output_difference = (2 * s * b * h / tp + 4 * s * b * V / tp) - 4 * s * b * h * (1 + V / h) / tp
    else:
        theirs = tmu.compute_activation_memory_without_sp(args, num_microbatches=m) / 1.05
        output_difference = (2 * s * b * h + 4 * s * b * V / tp) - (s * b * V / tp + s * b * h) * 2
    if pp > 1:
        output_difference = 0.0
    # megatron's per-layer coefficient vs ours (equal for MHA + GeLU + f = 4h)
    if sp:
        megatron_layer = s * b * h * (18 + 4 * model.ffn_hidden_size / h) / tp
    else:
        megatron_layer = s * b * h * (10 + 24 / tp)
    our_layer = layer_activation_bytes(model, micro_batch_size=b, seq_length=s, tp=tp,
                                       sequence_parallel=sp)
    if model is GPT:
        assert our_layer == pytest.approx(megatron_layer + _small_terms(model, s, b, tp, sp),
                                          rel=1e-12)
    in_flight = microbatches_in_flight("interleaved-1f1b" if vpp else "1f1b", 0, pp, m, vpp or 1)
    layer_difference = (our_layer - megatron_layer) * (model.num_layers // pp) * in_flight
    # the embedding's token ids: megatron's formula shards them over TP with SP and has no
    # 1-byte out-of-range mask; megatron-core keeps both whole (the memory harness's MTP cell)
    ids_difference = (8 * s * b * (1 - 1 / tp) if sp else 0) + (s * b if tp > 1 else 0)
    expected = theirs + output_difference + layer_difference + ids_difference * in_flight
    assert ours.activations_bytes == pytest.approx(expected, rel=1e-9, abs=1)


# --------------------------------------------------------------------------- issue 36 fixes

def _megatron_peak(chunks, n, stage, m, group):
    """Peak layer-micro-batches from megatron-core's own schedule table (forward k runs
    ``table[k]``'s chunk, backward k its mirror) and its warm-up count."""
    schedules = pytest.importorskip("megatron.core.pipeline_parallel.schedules")
    v = len(chunks)
    table = schedules.get_schedule_table(m, v, group)
    total = m * v
    warmup = min((n - stage - 1) * 2 + (v - 1) * group, total)
    held = peak = sum(chunks[table[k][1]] for k in range(warmup))
    for j in range(total - warmup):
        held += chunks[table[warmup + j][1]]
        peak = max(peak, held)
        held -= chunks[v - 1 - table[j][1]]
    return peak


@pytest.mark.parametrize("layers,n,v,m,group", [
    (15, 4, 2, 16, None), (15, 4, 2, 8, None), (7, 4, 3, 12, None), (31, 8, 4, 32, None),
    (15, 4, 2, 10, 3), (61, 8, 4, 64, None), (16, 4, 2, 16, None)])
def test_interleaved_layers_in_flight_follow_megatrons_schedule(layers, n, v, m, group):
    from poseidon_plugin.memory import decoder_layers_in_flight

    chunks = [layers // v + (1 if c < layers % v else 0) for c in range(v)]
    for stage in range(n):
        got = decoder_layers_in_flight("interleaved-1f1b", stage, n, m, v, layers, group)
        assert got == _megatron_peak(chunks, n, stage, m, group or n)
        uniform = layers * microbatches_in_flight("interleaved-1f1b", stage, n, m, v, group)
        assert got >= uniform - 1e-9     # unequal chunks: the larger runs first, held longest


def test_interleaved_stage_memory_counts_the_larger_chunk_longer():
    common = dict(stage=0, num_stages=4, tp=1, dp=1, micro_batch_size=1, seq_length=128,
                  num_microbatches=16, schedule="interleaved-1f1b", virtual_stages=2)
    one = layer_activation_bytes(GPT, micro_batch_size=1, seq_length=128, tp=1)
    mem = stage_memory(GPT, layers=7, **common)
    base = stage_memory(GPT, layers=0, **common)
    # chunks 4 + 3, G = N = 4: the warm-up's 10 forwards hold 4x4 + 4x3 + 2x4 = 36 layers;
    # each step runs a chunk-0 forward (+4) before a chunk-1 backward (-3): 40, 41 (the uniform
    # count, 7 x 11 / 2 = 38.5, is short)
    assert mem.activations_bytes - base.activations_bytes == pytest.approx(41 * one, abs=2)


def test_moe_plans_priced_with_sequence_parallelism():
    """A MoE plan at TP > 1 carries --sequence-parallel (``Plan._expert_args``); the cost
    model's memory is then the sequence-parallel one (a dense plan has no SP flag)."""
    from poseidon_plugin.cluster import load_cluster
    from poseidon_plugin.costs import CostModel

    cluster = load_cluster("examples/clusters/moe-3type-512.yaml")
    for name, sp_at_tp2 in (("qwen3-30b-a3b", True), ("llama3-8b", False)):
        model = PRESETS[name]
        cm = CostModel(cluster, model, seq_length=4096)
        kw = dict(layers=4, stage=1, num_stages=4, tp=2, dp=4, micro_batch_size=1,
                  num_microbatches=8, schedule="1f1b", virtual_stages=1)
        want = stage_memory(model, **{k: v for k, v in kw.items() if k != "virtual_stages"},
                            seq_length=4096, setup=cm.training, sequence_parallel=sp_at_tp2)
        assert cm.stage_memory(**kw).activations_bytes == want.activations_bytes
        assert cm.sequence_parallel(1) is False


def test_mtp_layers_on_the_last_stage():
    from poseidon_plugin.memory import mtp_activation_bytes

    m = PRESETS["deepseek-v3"]
    plain = dataclasses.replace(m, mtp_num_layers=0)
    kw = dict(layers=7, num_stages=8, tp=2, dp=32, micro_batch_size=1, seq_length=4096,
              num_microbatches=64, distributed_optimizer=True, sequence_parallel=True, ep=8)
    for stage in range(7):                      # only the last stage holds the MTP layers
        assert stage_memory(m, stage=stage, **kw) == stage_memory(plain, stage=stage, **kw)
    last, without = stage_memory(m, stage=7, **kw), stage_memory(plain, stage=7, **kw)
    mtp = m.mtp_param_split()
    assert last.weights_bytes - without.weights_bytes == pytest.approx(
        2 * mtp.per_device(2, 8), abs=1)
    act = mtp_activation_bytes(m, micro_batch_size=1, seq_length=4096, tp=2,
                               sequence_parallel=True)
    assert last.activations_bytes - without.activations_bytes == pytest.approx(act, abs=1)
    # about one MoE layer's activations plus its fp32 logits (4 s V / t)
    moe = layer_activation_bytes(m.kind_model(m.mtp_layer_kind), micro_batch_size=1,
                                 seq_length=4096, tp=2, sequence_parallel=True)
    assert moe + 4 * 4096 * m.vocab_size / 2 < act < 1.2 * (moe + 4 * 4096 * m.vocab_size / 2)
