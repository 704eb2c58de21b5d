"""Per-pipeline-stage memory model (weights, gradients, optimizer state, activations).

Megatron-core's ``theoretical_memory_usage`` (see notes §6) generalised to uneven, heterogeneous
stages. All figures are bytes on ONE device of the stage.

Weights, gradients, optimizer (mixed-precision Adam, as megatron-core assumes)
    18 bytes/parameter without the distributed optimizer:
        weights 2 (bf16) | gradients 4 (fp32 main grads) | optimizer 12 (fp32 master 4 + Adam 8);
    6 + 12/dp with it: weights 2 | gradients 4 | optimizer 12/dp (master + Adam sharded over DP).
    Parameters per device: decoder layers' TP-sharded and expert weights / tp, norms + router
    replicated (experts: expert-TP = tp, expert-parallel 1, so expert-DP = dp); word (+ position)
    embedding on stage 0; final norm + output layer on the last stage. With tied embeddings and
    more than one stage the last stage holds its own copy of the embedding for the output layer
    (as Megatron does); with one stage it is held once.

Activations kept for backward, per layer and micro-batch (Korthikanti et al. 2022, Table 2,
generalised to GQA, SwiGLU and MoE), with b = micro-batch, s = sequence, t = TP:
    replicated part (divided by t only with sequence parallelism): ``s*b*10h`` — norm inputs 2x2h,
        attention and MLP inputs 2x2h, two dropout masks 2x1h;
    TP-sharded part, divided by t: ``s*b*(4*a*d + 4*g*d + 2*f*(3 if SwiGLU else 2))`` — Q, K, V and
        the output-projection input in bf16, and the MLP's fc1 output(s) and fc2 input;
        MoE: the MLP term x top-k plus the k dispatched copies of the input (2*k*h), plus the
        shared experts' MLP term; a model of dense and MoE layers: with ``kind_counts`` (the
        layers of each kind the stage holds) each kind's own, else the larger kind's for every
        layer (an upper bound);
    attention scores: NOT counted. We assume flash attention / selective recompute of the core
        attention, which is what megatron-core's own estimate assumes (its ``_without_sp`` formula
        ``s*b*h*(10 + 24/t)`` is exactly ours for MHA, GeLU, f = 4h; with SP its ``s*b*h*(18+4f/h)/t``
        is ours for MHA, GeLU). The 5*a*s^2*b/t bytes of non-flash attention are left out.
    Full recompute (``recompute=True``): per layer only its input, ``2*s*b*h`` (/t with SP), is
        kept per in-flight micro-batch, plus ONE layer's full activations for the recomputation.
    Stage 0 adds the embedding terms per in-flight micro-batch: token ids 8*s*b and the embedding
        dropout mask s*b*h (both /t with SP, as megatron-core does).
    The last stage adds per in-flight micro-batch the output layer's input 2*s*b*h (/t with SP) and
        the fp32 logits kept for the loss, 4*s*b*V/t.
    Total activations = per-micro-batch stage activations x ``microbatches_in_flight``. (With
    interleaving the embedding / logits terms are multiplied by the whole device's in-flight count,
    as megatron-core does for the embedding; only chunk 0 / chunk V-1 hold them, so this errs high.)

Training setup (``training.TrainingSetup``; see that module): bytes per parameter follow its
    dtypes (18 = 2 | 4 | 12 for bf16 with fp32 gradients, the default); an unfused attention with
    no recompute adds the ``5*a*s^2*b/t`` bytes of the scores, softmax output and dropout mask
    (selective recompute re-computes them); ``full`` recompute is as above; fp32 activations are
    counted as twice the 16-bit ones (approximate: the 1-byte dropout masks do not double).
Measured layers: ``layer_activation_bytes_override`` / ``layer_param_bytes_override`` (a measured
    profile record's ``activation_bytes`` / ``param_bytes``, per device, in the record's setup)
    replace the analytic per-layer figures; the embedding and output terms stay analytic.
Runtime reserve: ``reserve_bytes`` (the device type's ``reserve_gib``: CUDA/CANN context,
    communicator buffers, allocator fragmentation) is added to the total.

Deliberate differences from megatron-core (both shown in ``tests/test_memory.py``): no 5% overhead
factor on activations (the planner applies its own head-room), fp32 logits (4 bytes, not 2) on the
last stage, the final norm counted on the last stage (megatron spreads it as final_norm/pp).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from .errors import PoseidonError
from .simulator.schedules import SCHEDULES
from .training import TrainingSetup

BYTES_BF16 = 2
BYTES_FP32 = 4


@dataclass(frozen=True)
class StageMemory:
    weights_bytes: int
    gradients_bytes: int
    optimizer_bytes: int
    activations_bytes: int
    total_bytes: int             # the four parts + the reserve: the predicted peak
    reserve_bytes: int = 0
    activations_measured: bool = False
    params_measured: bool = False
    # a model with experts: per layer kind the stage holds (kind name, layers, bytes of those
    # layers: weights + gradients + optimizer state + activations kept in flight); () otherwise
    layer_parts: tuple[tuple[str, int, int], ...] = ()

    def parts(self) -> dict[str, int]:
        """The predicted peak and its parts (the plan JSON's per-stage ``memory``); a model
        with experts adds per layer kind ``<kind>_layers`` and ``<kind>_layers_bytes``."""
        out = {"params_bytes": self.weights_bytes, "grads_bytes": self.gradients_bytes,
               "optimizer_bytes": self.optimizer_bytes,
               "activations_bytes": self.activations_bytes, "reserve_bytes": self.reserve_bytes,
               "total_bytes": self.total_bytes}
        for name, count, nbytes in self.layer_parts:
            out[f"{name}_layers"] = count
            out[f"{name}_layers_bytes"] = nbytes
        return out


# --------------------------------------------------------------------------- in-flight count

def microbatches_in_flight(schedule: str, stage: int, num_stages: int, num_microbatches: int,
                           virtual_stages: int = 1, microbatch_group_size: int | None = None
                           ) -> float:
    """Peak number of micro-batches (in units of a whole stage's activations) held by `stage`.

    0-based ``stage`` of ``num_stages`` (N), ``num_microbatches`` (M):

    * ``gpipe``: M (all forwards before any backward);
    * ``1f1b``: min(N - s, M) (N-1-s warm-up forwards, then one more forward before the first
      backward);
    * ``eager-1f1b``: min(2(N - s) - 1, M) (2(N-1-s)+1 warm-up forwards, then backward first);
    * ``interleaved-1f1b`` with V = ``virtual_stages`` chunks per device: megatron-core 0.19's
      warm-up count in model chunks, w = 2(N-1-s) + (V-1)G with G = ``microbatch_group_size``
      (megatron's ``microbatch_group_size_per_vp_stage``, default N), capped at M*V; the steady state
      adds one more chunk forward before the first backward, so the peak is min(w + 1, M*V) chunks,
      each holding 1/V of the stage's layers: returned as min(w + 1, M*V) / V. For stage 0 with
      G = N this is N(1 + (N-1)/(N V)), megatron's interleaving memory penalty times N.
      With N = 1 or V = 1 megatron does not interleave: as ``1f1b``.
    """
    if schedule not in SCHEDULES:
        raise PoseidonError(f"unknown schedule {schedule!r}; expected one of {', '.join(SCHEDULES)}")
    if num_stages < 1 or not 0 <= stage < num_stages:
        raise PoseidonError(f"stage {stage} is not in 0..{num_stages - 1}")
    if num_microbatches < 1:
        raise PoseidonError(f"num_microbatches must be >= 1, got {num_microbatches}")
    n, m, s = num_stages, num_microbatches, stage
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b":
        return float(min(n - s, m))
    if schedule == "eager-1f1b":
        return float(min(2 * (n - s) - 1, m))
    v = virtual_stages
    if v < 1:
        raise PoseidonError(f"virtual_stages must be >= 1, got {v}")
    if n == 1 or v == 1:  # megatron runs the non-interleaved schedule then
        return float(min(n - s, m))
    group = n if microbatch_group_size is None else microbatch_group_size
    warmup = 2 * (n - 1 - s) + (v - 1) * group
    return min(warmup + 1, m * v) / v


# --------------------------------------------------------------------------- activations

def attention_scores_bytes(model, *, micro_batch_size: int, seq_length: int, tp: int) -> float:
    """An unfused attention's s x s scores (2), softmax output (2) and dropout mask (1): 5*a*s^2*b/t."""
    return 5.0 * model.num_attention_heads * seq_length * seq_length * micro_batch_size / tp


def layer_activation_bytes(model, *, micro_batch_size: int, seq_length: int, tp: int,
                           sequence_parallel: bool = False,
                           setup: TrainingSetup | None = None) -> float:
    """Bytes one decoder layer keeps for backward for one micro-batch on one TP rank, without
    full recompute (flash attention unless ``setup`` says unfused; see the module docstring)."""
    setup = setup or TrainingSetup()
    scale = setup.weight_bytes / BYTES_BF16
    value = scale * _flash_layer_bytes(model, micro_batch_size=micro_batch_size,
                                       seq_length=seq_length, tp=tp,
                                       sequence_parallel=sequence_parallel)
    if setup.keeps_attention_scores:
        value += scale * attention_scores_bytes(model, micro_batch_size=micro_batch_size,
                                                seq_length=seq_length, tp=tp)
    return value


def _flash_layer_bytes(model, *, micro_batch_size: int, seq_length: int, tp: int,
                       sequence_parallel: bool = False) -> float:
    sb = float(seq_length * micro_batch_size)
    h, a, g, d = model.hidden_size, model.num_attention_heads, model.num_query_groups, model.head_dim
    # norm inputs 2x2h, QKV / MLP inputs 2x2h, two 1-byte dropout masks; two fp32 1/rms
    replicated = 10.0 * h + 2 * BYTES_FP32
    attention, latents = _attention_units(model.attention, a, g, d)
    replicated += latents
    kinds = getattr(model, "layer_kinds", None)
    if kinds:   # per layer kind; a mixed model (dense and MoE): the largest, an upper bound
        units = [_mlp_units(kind.mlp, h) for kind in kinds]
    else:
        gemms = 3 if model.swiglu else 2
        if model.is_moe:
            k = model.moe_top_k
            units = [(k * 2.0 * model.expert_ffn_hidden_size * gemms, _routed_units(k, h))]
        else:
            units = [(2.0 * model.ffn_hidden_size * gemms, 0.0)]
    # a MoE layer's routed copies (``routed``): gathered over TP, kept whole on every TP rank
    split = tp if sequence_parallel else 1
    return max(sb * ((replicated / split) + (attention + mlp) / tp + routed)
               for mlp, routed in units)


def _attention_units(attention, a: int, g: int, d: int) -> tuple[float, float]:
    """Per token, the bytes one layer's attention keeps besides its input norm, as (TP-sharded,
    replicated). MHA / GQA: Q, K, V (as flash attention takes them), the core's output (= the
    output projection's input) and the fp32 log-sum-exp, all sharded. MLA: Q and K of
    ``qk_head_dim + qk_pos_emb_head_dim`` and V and the output of ``v_head_dim`` per head and the
    log-sum-exp, sharded; the down projections' outputs, replicated on every TP rank: the Q
    latent (``q_lora_rank``), the K/V latent with the shared RoPE key, and with
    ``qk_layernorm`` the two latents' normed copies and their fp32 1/rms."""
    if not getattr(attention, "multi_latent", False):
        return 4.0 * a * d + 4.0 * g * d + BYTES_FP32 * a, 0.0
    qk = attention.qk_head_dim + attention.qk_pos_emb_head_dim
    sharded = 2.0 * a * (2 * qk + 2 * attention.v_head_dim) + BYTES_FP32 * a
    q_rank = attention.q_lora_rank or 0
    latents = 2.0 * (q_rank + attention.kv_lora_rank + attention.qk_pos_emb_head_dim)
    if attention.qk_layernorm:
        latents += 2.0 * attention.kv_lora_rank + BYTES_FP32
        if q_rank:
            latents += 2.0 * q_rank + BYTES_FP32
    return sharded, latents


def _routed_units(k: int, h: int) -> float:
    """Per token of the layer's input, the bytes a MoE layer keeps outside its experts' GEMMs:
    the k dispatched bf16 copies of the token (2*k*h: megatron-core's dispatcher gathers them
    over the TP group, so a TP rank keeps its experts' copies of all the group's tokens: not
    divided by TP) and the router's top-k indices (int64) and probabilities (fp32) of them."""
    return 2.0 * k * h + (8.0 + BYTES_FP32) * k


def _mlp_units(mlp, h: int) -> tuple[float, float]:
    """Per token, the bytes one layer's MLP keeps (``layers.MLPSpec``) as (TP-sharded,
    not TP-sharded): fc1 output(s) and fc2 input, sharded; MoE: x top-k (and the shared
    experts'), plus the routed copies (``_routed_units``), not sharded by TP."""
    gemms = 3 if mlp.swiglu else 2
    if not mlp.is_moe:
        return 2.0 * mlp.ffn_hidden_size * gemms, 0.0
    k = mlp.top_k
    units = k * 2.0 * mlp.ffn_hidden_size * gemms
    if mlp.shared_ffn_hidden_size:
        units += 2.0 * mlp.shared_ffn_hidden_size * gemms
    return units, _routed_units(k, h)


def layer_input_bytes(model, *, micro_batch_size: int, seq_length: int, tp: int,
                      sequence_parallel: bool = False) -> float:
    """The bf16 layer input full recomputation keeps (2*s*b*h; /t with SP)."""
    value = float(BYTES_BF16 * seq_length * micro_batch_size * model.hidden_size)
    return value / tp if sequence_parallel else value


def embedding_activation_bytes(model, *, micro_batch_size: int, seq_length: int, tp: int,
                               sequence_parallel: bool = False) -> float:
    """The token ids (int64, 8*s*b, whole on every rank: the vocabulary-parallel embedding keeps
    its shifted copy for backward, and at TP > 1 its 1-byte out-of-range mask) and the
    embedding's dropout mask (s*b*h; /t with SP, where the dropout runs on the sequence shard),
    as the memory harness counts them for the MTP layer's own embedding."""
    sb = float(seq_length * micro_batch_size)
    ids = sb * (8.0 + (1.0 if tp > 1 else 0.0))
    mask = sb * model.hidden_size
    return ids + (mask / tp if sequence_parallel else mask)


def output_activation_bytes(model, *, micro_batch_size: int, seq_length: int, tp: int,
                            sequence_parallel: bool = False) -> float:
    """Output-layer input (2*s*b*h, /t with SP) and the fp32 logits for the loss (4*s*b*V/t)."""
    sb = float(seq_length * micro_batch_size)
    layer_input = BYTES_BF16 * sb * model.hidden_size
    if sequence_parallel:
        layer_input /= tp
    return layer_input + BYTES_FP32 * sb * model.vocab_size / tp


def mtp_layer_activation_bytes(model, *, micro_batch_size: int, seq_length: int, tp: int,
                               sequence_parallel: bool = False,
                               setup: TrainingSetup | None = None) -> float:
    """What one of megatron-core's ``MultiTokenPredictionLayer`` keeps per micro-batch (the
    memory harness builds and counts it: ``fidelity.memory_check``, kind ``mtp``): its decoder
    layer's (of ``mtp_layer_kind``); the shifted tokens' ids (int64, 8 per token on every rank,
    and at TP > 1 the vocabulary-parallel embedding's 1-byte out-of-range mask); the embedding's
    dropout mask (h), the inputs of the two norms before the projection (2 x 2h) and of its
    final norm (2h), their three fp32 1/rms, the 2h -> h projection ``eh_proj``'s input (4h),
    all /t with SP; and with SP the decoder layer's input, a slice of the gathered projection
    output that keeps its whole [s, b, h] storage: 2h (1 - 1/t) more. 0 without MTP layers."""
    if not getattr(model, "mtp_num_layers", 0):
        return 0.0
    sb = float(seq_length * micro_batch_size)
    h = model.hidden_size
    around = sb * (11.0 * h + 3 * BYTES_FP32)
    if sequence_parallel and tp > 1:
        around = around / tp + sb * BYTES_BF16 * h * (1.0 - 1.0 / tp)
    ids = sb * (8.0 + (1.0 if tp > 1 else 0.0))
    kind = model.kind_model(model.mtp_layer_kind)
    layer = layer_activation_bytes(kind, micro_batch_size=micro_batch_size,
                                   seq_length=seq_length, tp=tp,
                                   sequence_parallel=sequence_parallel, setup=setup)
    return layer + around + ids


def mtp_activation_bytes(model, *, micro_batch_size: int, seq_length: int, tp: int,
                         sequence_parallel: bool = False,
                         setup: TrainingSetup | None = None) -> float:
    """The MTP layers' activations per micro-batch on the last stage (megatron-core's
    ``MultiTokenPredictionBlock``, DeepSeek-V3's MTP): per layer ``mtp_layer_activation_bytes``
    and what the model's shared output layer keeps for it after the layer (``GPTModel``): its
    input (2h, /t with SP) and its fp32 logits for the loss (4 V / t). 0 without MTP layers."""
    layers = getattr(model, "mtp_num_layers", 0)
    if not layers:
        return 0.0
    shape = dict(micro_batch_size=micro_batch_size, seq_length=seq_length, tp=tp,
                 sequence_parallel=sequence_parallel)
    return layers * (mtp_layer_activation_bytes(model, **shape, setup=setup)
                     + output_activation_bytes(model, **shape))


# --------------------------------------------------------------------------- parameters

def stage_params(model, *, layers: int, stage: int, num_stages: int, tp: int,
                 ep: int = 1) -> float:
    """Parameters held by one device of ``stage`` (embedding on stage 0, output on the last;
    routed experts / EP)."""
    # (a stage priced by its layers' kinds asks with layers = 0: skip the per-layer envelope)
    params = layers * model.layer_param_split().per_device(tp, ep) if layers else 0.0
    word_embedding = model.hidden_size * model.vocab_size
    if stage == 0:
        params += word_embedding / tp + (model.embedding_params() - word_embedding)
    if stage == num_stages - 1:
        params += model.norm_params
        if model.untie_embeddings or num_stages > 1:
            params += word_embedding / tp
    return params


def bytes_per_param(dp: int, distributed_optimizer: bool,
                    setup: TrainingSetup | None = None) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes per parameter: (2, 4, 12) or (2, 4, 12/dp) for the
    default setup; ``setup``'s dtypes otherwise (its ``distributed_optimizer`` wins when given)."""
    if setup is None:
        setup = TrainingSetup(distributed_optimizer=distributed_optimizer)
    return float(setup.weight_bytes), float(setup.grad_bytes), setup.optimizer_bytes(dp)


# --------------------------------------------------------------------------- stage

def stage_memory(model, *, layers: int, stage: int, num_stages: int, tp: int, dp: int,
                 micro_batch_size: int, seq_length: int, num_microbatches: int,
                 schedule: str = "1f1b", virtual_stages: int = 1,
                 distributed_optimizer: bool = False, recompute: bool = False,
                 sequence_parallel: bool = False,
                 layer_activation_bytes_override: int | None = None,
                 layer_param_bytes_override: int | None = None,
                 setup: TrainingSetup | None = None, reserve_bytes: int = 0,
                 kind_counts: tuple[int, ...] | None = None,
                 kind_overrides: tuple[tuple[int | None, int | None], ...] | None = None,
                 ep: int = 1) -> StageMemory:
    """Memory of one device of `stage` (embedding on stage 0, output layer + logits and the MTP
    layers on the last).

    ``layers`` is the number of decoder layers the device holds (all its chunks for interleaving:
    split as ``chunk_layers``, the decoder layers in flight counted chunk by chunk,
    ``decoder_layers_in_flight``).
    ``setup`` (a ``TrainingSetup``) gives the recompute, optimizer and dtypes; without it the
    legacy ``distributed_optimizer`` / ``recompute`` (True = full) flags describe a bf16 setup.
    ``layer_activation_bytes_override`` / ``layer_param_bytes_override``: a measured record's
    per-layer, per-micro-batch activation bytes (kept for backward under ``setup``'s recompute)
    and parameter bytes, used instead of the analytic ones. ``reserve_bytes`` is added.

    ``kind_counts`` (a model of several layer kinds): the layers of each kind the device holds
    (``model.kind_counts_in`` of its layer ranges; they sum to ``layers``): parameters and kept
    activations are then the sum over the kinds it holds, each kind at its own figures
    (``kind_overrides``: per kind a measured record's (activation bytes, parameter bytes) or
    None), the full-recompute buffer the largest held kind's layer. Without ``kind_counts``, or
    for a uniform model, every layer is at the model's per-layer figures (a mixed model: each
    part's maximum over the kinds, an upper bound).

    ``ep`` (expert parallelism, a model with experts): a MoE layer's routed experts are
    / (TP x EP) on a device (``LayerParams.per_device``; a measured parameter override is taken
    as already at this EP), and with the distributed optimizer their state is sharded over the
    expert-DP group (dp / ep ranks), the rest over DP. A model with experts reports per kind
    its layers' bytes (``StageMemory.layer_parts``).
    """
    setup = _checked_setup(model, layers=layers, tp=tp, dp=dp, ep=ep,
                           micro_batch_size=micro_batch_size, seq_length=seq_length,
                           setup=setup, recompute=recompute,
                           distributed_optimizer=distributed_optimizer)
    in_flight = microbatches_in_flight(schedule, stage, num_stages, num_microbatches,
                                       virtual_stages)
    layer_in_flight = decoder_layers_in_flight(schedule, stage, num_stages, num_microbatches,
                                               virtual_stages, layers)
    w_b, g_b, o_b = bytes_per_param(dp, setup.distributed_optimizer, setup)
    experts = bool(getattr(model, "num_experts", 0))
    o_be = setup.optimizer_bytes(dp // ep) if experts else o_b
    shape = dict(micro_batch_size=micro_batch_size, seq_length=seq_length, tp=tp,
                 sequence_parallel=sequence_parallel)
    position = dict(stage=stage, num_stages=num_stages, in_flight=in_flight,
                    layer_in_flight=layer_in_flight, per_param=(w_b, g_b, o_b), o_be=o_be,
                    reserve_bytes=reserve_bytes, ep=ep)
    if kind_counts is not None and len(getattr(model, "layer_kinds", ())) > 1:
        if sum(kind_counts) != layers:
            raise PoseidonError(f"kind_counts {kind_counts} do not sum to layers = {layers}")
        return _stage_memory_by_kind(model, kind_counts, kind_overrides, shape=shape,
                                     setup=setup, **position)
    return _stage_memory_uniform(model, layers, shape=shape, setup=setup,
                                 act_override=layer_activation_bytes_override,
                                 param_override=layer_param_bytes_override, **position)


def _checked_setup(model, *, layers: int, tp: int, dp: int, ep: int, micro_batch_size: int,
                   seq_length: int, setup: TrainingSetup | None, recompute: bool,
                   distributed_optimizer: bool) -> TrainingSetup:
    """``stage_memory``'s arguments checked (one line each); the training setup it prices."""
    if layers < 0:
        raise PoseidonError(f"layers must be >= 0, got {layers}")
    if tp < 1 or dp < 1 or micro_batch_size < 1 or seq_length < 1:
        raise PoseidonError("tp, dp, micro_batch_size and seq_length must be >= 1")
    if ep > 1 and (not getattr(model, "num_experts", 0) or dp % ep):
        raise PoseidonError(f"expert parallelism {ep}: needs a model with experts and an EP "
                            f"dividing DP = {dp}")
    if setup is None:
        setup = TrainingSetup(recompute="full" if recompute else "none",
                              distributed_optimizer=distributed_optimizer)
    return setup


def _stage_memory_uniform(model, layers: int, *, shape: dict, setup: TrainingSetup,
                          act_override: int | None, param_override: int | None, stage: int,
                          num_stages: int, in_flight: float, layer_in_flight: float,
                          per_param, o_be: float, reserve_bytes: int,
                          ep: int) -> StageMemory:
    """``stage_memory`` with every decoder layer at the model's per-layer figures."""
    w_b, g_b, o_b = per_param
    tp = shape["tp"]
    experts = bool(getattr(model, "num_experts", 0))
    split = model.layer_param_split()
    params = stage_params(model, layers=layers, stage=stage, num_stages=num_stages, tp=tp, ep=ep)
    if param_override is not None:
        params += layers * (param_override / w_b - split.per_device(tp, ep))
    expert_params = layers * split.expert_per_device(tp, ep) if experts else 0.0
    measured = act_override is not None
    if setup.recompute == "full":
        kept = float(act_override) if measured else layer_input_bytes(model, **shape)
        buffer = TrainingSetup(attention=setup.attention, params_dtype=setup.params_dtype)
        recompute_buffer = layer_activation_bytes(model, **shape, setup=buffer) \
            if layers > 0 else 0.0
    else:
        kept = float(act_override) if measured else layer_activation_bytes(model, **shape,
                                                                           setup=setup)
        recompute_buffer = 0.0
    parts = ()
    if experts and layers:
        one = (float(param_override) / w_b if param_override is not None
               else split.per_device(tp, ep))
        parts = ((_kind_name(model), layers,
                  _layers_bytes(layers, one, split.expert_per_device(tp, ep), kept,
                                layer_in_flight / layers, per_param, o_be)),)
    return _assembled(model, shape, stage=stage, num_stages=num_stages,
                      per_microbatch=layers * kept, in_flight=in_flight,
                      layer_in_flight=layer_in_flight, layers=layers,
                      recompute_buffer=recompute_buffer, params=params, per_param=per_param,
                      reserve_bytes=reserve_bytes, activations_measured=measured,
                      params_measured=param_override is not None,
                      expert_params=expert_params, o_be=o_be, layer_parts=parts, ep=ep,
                      setup=setup)


def decoder_layers_in_flight(schedule: str, stage: int, num_stages: int,
                             num_microbatches: int, virtual_stages: int, layers: int,
                             microbatch_group_size: int | None = None) -> float:
    """Peak layer-micro-batches of decoder activations held by ``stage``'s ``layers`` layers.

    Without interleaving ``layers x microbatches_in_flight``. Interleaved (V chunks split as
    ``chunk_layers``: the larger first), megatron-core's order of chunk forwards and backwards
    (groups of G micro-batches, G default N, the last group the rest; each group runs chunk 0 to
    V - 1 forward, the k-th backward the chunk V - 1 - that of the k-th forward): the warm-up's
    w forwards, then one forward and one backward
    per step; the peak is the largest sum of the in-flight chunks' layers. With equal chunks
    this is ``layers x microbatches_in_flight``; with unequal ones more (chunk 0, the larger,
    runs first and is the last to run backward).
    """
    in_flight = microbatches_in_flight(schedule, stage, num_stages, num_microbatches,
                                       virtual_stages, microbatch_group_size)
    v, n, m = virtual_stages, num_stages, num_microbatches
    if schedule != "interleaved-1f1b" or v <= 1 or n <= 1 or layers % v == 0:
        return layers * in_flight
    chunks = [layers // v + (1 if c < layers % v else 0) for c in range(v)]
    group = n if microbatch_group_size is None else microbatch_group_size
    order = []          # the chunk of each forward: groups of G micro-batches, chunk by chunk
    for first in range(0, m, group):
        order += [c for c in range(v) for _ in range(min(group, m - first))]
    total = m * v
    warmup = min(2 * (n - 1 - stage) + (v - 1) * group, total)
    held = sum(chunks[order[k]] for k in range(warmup))
    peak = held
    for j in range(total - warmup):
        held += chunks[order[warmup + j]]
        peak = max(peak, held)
        held -= chunks[v - 1 - order[j]]
    return float(peak)


def _kind_name(model) -> str:
    kinds = getattr(model, "layer_kinds", ())
    return kinds[0].name if len(kinds) == 1 else ("moe" if model.num_experts else "dense")


def _layers_bytes(count: int, params_one: float, expert_one: float, kept_one: float,
                  in_flight: float, per_param, o_be: float) -> int:
    """Bytes of ``count`` layers of one kind on a device: weights, gradients and optimizer
    state (the routed experts' at the expert-DP sharding ``o_be``) and their activations
    kept for the in-flight micro-batches."""
    w_b, g_b, o_b = per_param
    state = count * (params_one * (w_b + g_b) + (params_one - expert_one) * o_b
                     + expert_one * o_be)
    return math.ceil(state + count * kept_one * in_flight)


def _assembled(model, shape: dict, *, stage: int, num_stages: int, per_microbatch: float,
               in_flight: float, layer_in_flight: float, layers: int, recompute_buffer: float,
               params: float, per_param, reserve_bytes: int, activations_measured: bool,
               params_measured: bool, expert_params: float = 0.0, o_be: float | None = None,
               layer_parts: tuple = (), ep: int = 1,
               setup: TrainingSetup | None = None) -> StageMemory:
    """The ``StageMemory`` of a stage from its decoder layers' activations per micro-batch
    (``per_microbatch``, held ``layer_in_flight / layers`` times; the embedding's on the first
    stage, the output layer's and the MTP layers' on the last are added here, held
    ``in_flight`` times) and its parameters on one device (the MTP layers' added here)."""
    w_b, g_b, o_b = per_param
    decoder = per_microbatch * layer_in_flight / layers if layers else 0.0
    ends = 0.0
    if stage == 0:
        ends += embedding_activation_bytes(model, **shape)
    if stage == num_stages - 1:
        ends += output_activation_bytes(model, **shape)
        if getattr(model, "mtp_num_layers", 0):
            ends += mtp_activation_bytes(model, **shape, setup=setup)
            mtp = model.mtp_param_split()
            params += mtp.per_device(shape["tp"], ep)
            expert_params += mtp.expert_per_device(shape["tp"], ep)
    activations = decoder + ends * in_flight + recompute_buffer
    weights = math.ceil(params * w_b)
    gradients = math.ceil(params * g_b)
    if expert_params and o_be is not None and o_be != o_b:
        # the routed experts' optimizer state sharded over expert-DP, the rest over DP
        optimizer = math.ceil((params - expert_params) * o_b + expert_params * o_be)
    else:
        optimizer = math.ceil(params * o_b)
    activations_bytes = math.ceil(activations)
    reserve = int(reserve_bytes)
    return StageMemory(weights_bytes=weights, gradients_bytes=gradients,
                       optimizer_bytes=optimizer, activations_bytes=activations_bytes,
                       total_bytes=weights + gradients + optimizer + activations_bytes + reserve,
                       reserve_bytes=reserve, activations_measured=activations_measured,
                       params_measured=params_measured, layer_parts=tuple(layer_parts))


@functools.lru_cache(maxsize=64)
def _kind_model(model, index: int):
    """``model.kind_model(index)``, built once (a ``ModelSpec`` is frozen and hashable)."""
    return model.kind_model(index)


def _stage_memory_by_kind(model, kind_counts, kind_overrides, *, shape: dict,
                          setup: TrainingSetup, stage: int, num_stages: int, in_flight: float,
                          layer_in_flight: float, per_param, o_be: float, reserve_bytes: int,
                          ep: int = 1) -> StageMemory:
    """``stage_memory`` of a device holding ``kind_counts[k]`` layers of each kind ``k``."""
    w_b, g_b, o_b = per_param
    tp = shape["tp"]
    kinds = model.layer_kinds
    overrides = kind_overrides or ((None, None),) * len(kinds)
    params = stage_params(model, layers=0, stage=stage, num_stages=num_stages, tp=tp)
    buffer = TrainingSetup(attention=setup.attention, params_dtype=setup.params_dtype)
    per_microbatch = 0.0
    recompute_buffer = 0.0
    act_measured = par_measured = False
    expert_params = 0.0
    experts = bool(getattr(model, "num_experts", 0))
    layers = sum(kind_counts)
    parts = []
    for k, count in enumerate(kind_counts):
        if not count:
            continue
        act, par = overrides[k]
        split = kinds[k].param_split()
        one_p = par / w_b if par is not None else split.per_device(tp, ep)
        par_measured = par_measured or par is not None
        params += count * one_p
        e_one = split.expert_per_device(tp, ep)
        expert_params += count * e_one
        one = _kind_model(model, k)
        act_measured = act_measured or act is not None
        if setup.recompute == "full":
            kept = float(act) if act is not None else layer_input_bytes(one, **shape)
            recompute_buffer = max(recompute_buffer,
                                   layer_activation_bytes(one, **shape, setup=buffer))
        else:
            kept = float(act) if act is not None else layer_activation_bytes(one, **shape,
                                                                              setup=setup)
        per_microbatch += count * kept
        if experts:
            parts.append((kinds[k].name, count,
                          _layers_bytes(count, one_p, e_one, kept, layer_in_flight / layers,
                                        per_param, o_be)))
    return _assembled(model, shape, stage=stage, num_stages=num_stages,
                      per_microbatch=per_microbatch, in_flight=in_flight,
                      layer_in_flight=layer_in_flight, layers=layers,
                      recompute_buffer=recompute_buffer, params=params, per_param=per_param,
                      reserve_bytes=reserve_bytes, activations_measured=act_measured,
                      params_measured=par_measured, expert_params=expert_params, o_be=o_be,
                      layer_parts=tuple(parts), ep=ep, setup=setup)
