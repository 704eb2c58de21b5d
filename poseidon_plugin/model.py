"""Model specification: presets, YAML and Megatron-args construction; parameter and FLOP counts.

A model is a sequence of decoder layers, each of one kind (``layers.LayerKind``: its attention --
MHA / GQA, or multi-latent attention -- and its MLP -- dense, or MoE with routed and shared
experts), plus the embedding, the output layer and optional multi-token-prediction (MTP) layers.

Conventions
-----------
* h = hidden_size, a = heads, g = query groups (KV heads), d = kv_channels (head dim, default h/a),
  f = ffn_hidden_size (per expert: ``moe_ffn_hidden_size`` or f), E = experts, k = top-k, V = vocab.
* Parameters per decoder layer (Megatron's GPT layer, as megatron-core's
  ``theoretical_memory_usage`` counts them, plus optional linear biases):
  attention ``h*a*d`` (Q) + ``2*h*g*d`` (K, V) + ``a*d*h`` (output projection);
  MLP ``h*f*(3 if swiglu else 2)``; MoE: E such MLPs + router ``h*E`` + the shared experts' MLP;
  MLA: the Q/KV down and up projections and the output projection (``layers.py``);
  two norms ``2*h*(1 if RMSNorm else 2)``.
* FLOPs: a multiply-add is 2 FLOPs. Attention core (QK^T and attention x V) uses a **causal**
  mask: half of the ``4*b*s^2*a*d`` products, as megatron-core 0.19's
  ``num_floating_point_operations`` counts and as flash attention executes. MoE layers count the
  top-k experts each token visits, the shared experts and the router GEMM. Norms, softmax and
  element-wise ops are not counted (they are memory-bound and small next to the GEMMs).

Layer kinds
-----------
``num_experts`` > 0 makes the layers MoE by Megatron's ``moe_layer_freq`` (an int N: layer i,
0-based, is MoE when ``i % N == 0``; a tuple of 0/1 per layer, or in a YAML file a list or a list
expression such as ``"[0]*3+[1]*58"``) and MindSpeed-LLM's ``first_k_dense_replace`` (the first k
layers dense); the others are dense layers of ``ffn_hidden_size``. ``layer_kinds`` lists the
distinct kinds in the order they first appear, ``layer_kind_of`` gives each layer's index into it;
``kind_counts_in(start, stop)`` counts the kinds of layers ``[start, stop)`` from prefix sums, and
``layers_param_split`` / ``layers_forward_flops`` sum a layer range exactly.

The planner's *per-layer* figures (``layer_param_split``, ``layer_forward_flops``,
``attention_forward_flops``, ``mlp_forward_flops``, ``layer_params``) are exact for a uniform
model. For a mixed model (DeepSeek-V3: 3 dense layers, then 58 MoE) they are each part's maximum
over the kinds -- no layer of any kind is larger -- an upper bound for what is priced without a
layer range (the memory of a stage size alone). The planner costs each stage by the layers it
holds (``costs.CostModel`` with ``layer_kinds="per-kind"``, the default, and the search from the
stage's first layer). ``planning_note()`` notes what is not yet costed (MTP). Whole-model
figures (``total_params``, ``active_params``, ``model_flops_per_iteration``) are
exact sums over the layers.

YAML model file: the ``ModelSpec`` field names, e.g. ``examples/models/tiny-gpt.yaml`` or
``examples/models/tiny-moe.yaml``; ``name`` defaults to the file stem; unknown keys are
errors. Sizes are bounded (``_LIMITS``: e.g. at most 4096 layers, a hidden size of 2^20) so that
no count or FLOP figure overflows or hangs.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, fields, replace
from functools import cached_property
from typing import Any, Callable, Mapping

from .errors import SpecError
from .layers import (
    AttentionSpec, LayerKind, LayerParams, MLPSpec, PatternError, moe_layer_pattern,
    norm_params, parse_layer_pattern, pattern_expression, runs,
)
from .specfile import load_yaml_mapping, require_mapping

_NORMALIZATIONS = ("RMSNorm", "LayerNorm")
MAX_SEQ_LENGTH = 1 << 24   # tokens per sequence: a model's seq_length, `poseidon plan` and
                           # `poseidon profile`'s --seq-length (SearchOptions), the launch's
# field -> the largest value accepted (llama3-405b: 126 layers, hidden 16384, vocab 128256)
_LIMITS: dict[str, int] = {
    "num_layers": 4096, "hidden_size": 1 << 20, "ffn_hidden_size": 1 << 22,
    "num_attention_heads": 1 << 16, "num_query_groups": 1 << 16, "vocab_size": 1 << 24,
    "seq_length": MAX_SEQ_LENGTH, "num_experts": 1 << 16, "moe_top_k": 1 << 16, "kv_channels": 1 << 16,
    "moe_ffn_hidden_size": 1 << 22, "moe_shared_expert_intermediate_size": 1 << 22,
    "first_k_dense_replace": 4096, "moe_layer_freq": 4096, "mtp_num_layers": 64,
    "q_lora_rank": 1 << 16, "kv_lora_rank": 1 << 16, "qk_head_dim": 1 << 16,
    "qk_pos_emb_head_dim": 1 << 16, "v_head_dim": 1 << 16,
}
NAME_MAX_CHARS = 200
_POSITION_EMBEDDINGS = ("rope", "learned_absolute", "none")
_MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")
_PATTERN_EXAMPLE = "an integer N >= 1 or a 0/1 list expression like '[0]*3+[1]*58'"
# Megatron's token dispatchers (--moe-token-dispatcher-type; alltoall_seq: megatron-core <= 0.12)
MOE_DISPATCHERS = ("alltoall", "allgather", "flex", "alltoall_seq")


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int           # dense layers' MLP
    num_attention_heads: int
    num_query_groups: int          # = heads without GQA (and with MLA)
    vocab_size: int                # padded vocabulary (what the embedding table holds)
    seq_length: int                # default sequence length (a plan may override)
    num_experts: int = 0           # 0 -> dense MLP in every layer
    moe_top_k: int = 0
    swiglu: bool = True
    untie_embeddings: bool = True  # LLaMA: separate output layer
    normalization: str = "RMSNorm"  # or "LayerNorm"
    kv_channels: int | None = None  # default hidden / heads (unset with MLA)
    # --- extensions (defaults keep the stub's meaning) ---
    moe_ffn_hidden_size: int | None = None  # per-expert FFN; None -> ffn_hidden_size
    add_bias_linear: bool = False           # Megatron's default is True; LLaMA disables it
    position_embedding_type: str = "rope"   # "learned_absolute" adds seq_length*h parameters
    # --- layer kinds (defaults: every layer alike; with experts, every layer MoE) ---
    moe_layer_freq: int | tuple[int, ...] = 1   # Megatron's --moe-layer-freq (int or 0/1 per layer)
    first_k_dense_replace: int = 0              # MindSpeed-LLM: the first k layers dense
    moe_shared_expert_intermediate_size: int = 0  # all shared experts' FFN together; 0: none
    moe_shared_expert_gate: bool = False        # a sigmoid gate on the shared experts' output
    qk_layernorm: bool = False                  # norms on Q/K heads (MLA: on the two latents)
    multi_latent_attention: bool = False        # MLA (DeepSeek-V2/V3)
    q_lora_rank: int | None = None              # MLA: Q latent rank; None -> full-rank Q
    kv_lora_rank: int | None = None             # MLA: K/V latent rank
    qk_head_dim: int | None = None              # MLA: Q/K head dim without RoPE
    qk_pos_emb_head_dim: int | None = None      # MLA: the RoPE part of a Q/K head
    v_head_dim: int | None = None               # MLA: V head dim
    mtp_num_layers: int = 0                     # multi-token-prediction layers (DeepSeek-V3: 1)
    # Megatron's --moe-token-dispatcher-type the plan prices and its flags pin (a MoE model)
    moe_token_dispatcher_type: str = "alltoall"

    def __post_init__(self) -> None:
        if isinstance(self.moe_layer_freq, list):
            object.__setattr__(self, "moe_layer_freq", tuple(self.moe_layer_freq))
        _validate(self, "<ModelSpec>")

    # --- derived sizes ---
    @property
    def head_dim(self) -> int:
        """The Q/K head dim: kv_channels (default h/a); MLA: qk_head_dim + qk_pos_emb_head_dim."""
        if self.multi_latent_attention:
            return self.qk_head_dim + self.qk_pos_emb_head_dim  # type: ignore[operator]
        return self.kv_channels if self.kv_channels else self.hidden_size // self.num_attention_heads

    @property
    def is_moe(self) -> bool:
        """Some layer is MoE (``num_experts`` > 0)."""
        return self.num_experts > 0

    @property
    def expert_ffn_hidden_size(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    @property
    def norm_params(self) -> int:
        """Parameters of one norm: weight (RMSNorm) or weight + bias (LayerNorm)."""
        return norm_params(self.hidden_size, self.normalization)

    # --- layer kinds ---
    @cached_property
    def attention(self) -> AttentionSpec:
        """Every layer's self-attention (Megatron builds one attention for all layers)."""
        if self.multi_latent_attention:
            return AttentionSpec(
                num_attention_heads=self.num_attention_heads,
                num_query_groups=self.num_attention_heads, head_dim=self.head_dim,
                qk_layernorm=self.qk_layernorm, multi_latent=True, q_lora_rank=self.q_lora_rank,
                kv_lora_rank=int(self.kv_lora_rank or 0), qk_head_dim=int(self.qk_head_dim or 0),
                qk_pos_emb_head_dim=int(self.qk_pos_emb_head_dim or 0),
                v_head_dim=int(self.v_head_dim or 0))
        return AttentionSpec(num_attention_heads=self.num_attention_heads,
                             num_query_groups=self.num_query_groups, head_dim=self.head_dim,
                             qk_layernorm=self.qk_layernorm)

    @cached_property
    def moe_pattern(self) -> tuple[int, ...]:
        """1 (MoE) or 0 (dense) per layer; all 0 for a dense model."""
        if not self.is_moe:
            return (0,) * self.num_layers
        return moe_layer_pattern(self.num_layers, self.moe_layer_freq, self.first_k_dense_replace)

    def _kind(self, moe: bool) -> LayerKind:
        if moe:
            mlp = MLPSpec(ffn_hidden_size=self.expert_ffn_hidden_size, swiglu=self.swiglu,
                          num_experts=self.num_experts, top_k=self.moe_top_k,
                          shared_ffn_hidden_size=self.moe_shared_expert_intermediate_size,
                          shared_expert_gate=self.moe_shared_expert_gate)
        else:
            mlp = MLPSpec(ffn_hidden_size=self.ffn_hidden_size, swiglu=self.swiglu)
        return LayerKind(name="moe" if moe else "dense", hidden_size=self.hidden_size,
                         attention=self.attention, mlp=mlp, normalization=self.normalization,
                         add_bias_linear=self.add_bias_linear)

    @cached_property
    def _kinds(self) -> tuple[tuple[LayerKind, ...], tuple[int, ...]]:
        order: list[int] = []          # pattern values in the order they first appear
        for value in self.moe_pattern:
            if value not in order:
                order.append(value)
        kinds = tuple(self._kind(bool(v)) for v in order)
        index = {v: i for i, v in enumerate(order)}
        return kinds, tuple(index[v] for v in self.moe_pattern)

    @property
    def layer_kinds(self) -> tuple[LayerKind, ...]:
        """The distinct layer kinds, in the order they first appear (one for a uniform model)."""
        return self._kinds[0]

    @property
    def layer_kind_of(self) -> tuple[int, ...]:
        """Each decoder layer's index into ``layer_kinds`` (``num_layers`` entries)."""
        return self._kinds[1]

    @property
    def is_mixed(self) -> bool:
        """Layers of more than one kind (the planner's per-layer figures are then maxima)."""
        return len(self.layer_kinds) > 1

    @cached_property
    def kind_counts(self) -> tuple[int, ...]:
        """How many decoder layers of each kind (aligned with ``layer_kinds``)."""
        return tuple(self.layer_kind_of.count(i) for i in range(len(self.layer_kinds)))

    @cached_property
    def _kind_prefix(self) -> tuple[tuple[int, ...], ...]:
        """Per kind, the number of its layers among layers [0, i) for i = 0..num_layers."""
        out = []
        for k in range(len(self.layer_kinds)):
            prefix, n = [0], 0
            for kind in self.layer_kind_of:
                n += kind == k
                prefix.append(n)
            out.append(tuple(prefix))
        return tuple(out)

    def kind_counts_in(self, start: int, stop: int) -> tuple[int, ...]:
        """Layers of each kind among decoder layers ``[start, stop)`` (0-based), in O(kinds)."""
        if not 0 <= start <= stop <= self.num_layers:
            raise ValueError(f"layer range [{start}, {stop}) outside 0..{self.num_layers}")
        return tuple(p[stop] - p[start] for p in self._kind_prefix)

    def layers_param_split(self, start: int, stop: int) -> LayerParams:
        """Exact parameters of decoder layers ``[start, stop)``, split as ``LayerParams``."""
        total = LayerParams(0, 0, 0)
        for kind, count in zip(self.layer_kinds, self.kind_counts_in(start, stop)):
            if count:
                total = total + kind.param_split().scaled(count)
        return total

    def layers_forward_flops(self, start: int, stop: int, micro_batch_size: int,
                             seq_length: int) -> float:
        """Exact forward FLOPs of decoder layers ``[start, stop)`` for one micro-batch."""
        return sum(count * kind.forward_flops(micro_batch_size, seq_length)
                   for kind, count in zip(self.layer_kinds, self.kind_counts_in(start, stop))
                   if count)

    def kind_model(self, index: int) -> ModelSpec:
        """A uniform model of ``layer_kinds[index]`` (same name, size and vocabulary; no MTP): what
        one kind is profiled and keyed as."""
        kind = self.layer_kinds[index]
        uniform = dict(moe_layer_freq=1, first_k_dense_replace=0, mtp_num_layers=0)
        if kind.is_moe:
            return replace(self, **uniform)
        return replace(self, num_experts=0, moe_top_k=0, moe_ffn_hidden_size=None,
                       moe_shared_expert_intermediate_size=0, moe_shared_expert_gate=False,
                       **uniform)

    def signature(self) -> str:
        """Stable string of everything that shapes a layer's cost (profile DB key).

        Excludes the name, the layer count and the sequence length (those are in the profile key or
        do not change one layer's cost), so two presets of the same shape share profiles. A mixed
        model adds its layer pattern; ``kind_model(i).signature()`` is one kind's.
        """
        parts = [
            f"h{self.hidden_size}", f"f{self.ffn_hidden_size}", f"a{self.num_attention_heads}",
            f"g{self.num_query_groups}", f"d{self.head_dim}", f"v{self.vocab_size}",
            "swiglu" if self.swiglu else "gelu", self.normalization.lower(),
            "bias" if self.add_bias_linear else "nobias",
            "untied" if self.untie_embeddings else "tied",
            f"pos-{self.position_embedding_type}",
        ]
        attention = self.attention.signature()
        if attention:
            parts.append(attention)
        if self.is_moe:  # last: profiles.signature_fields reads everything after "moe" as its tail
            parts.append(self._kind(True).mlp.signature())
            if self.is_mixed:
                parts.append("layers-" + self._pattern_token())
        return "-".join(parts)

    def _pattern_token(self) -> str:
        """The dense/MoE pattern in a signature: runs (``d3m58``), or counts and a hash when the
        pattern has more than 8 runs."""
        pattern = runs(self.moe_pattern)
        if len(pattern) <= 8:
            return "".join(f"{'m' if v else 'd'}{n}" for v, n in pattern)
        moe = sum(self.moe_pattern)
        digest = hashlib.sha1(bytes(self.moe_pattern)).hexdigest()[:10]
        return f"d{self.num_layers - moe}m{moe}x{digest}"

    def planning_note(self) -> str | None:
        """One line for what the planner does not yet cost layer by layer (None: nothing). A
        model of several layer kinds is planned exactly (each stage costs the layers it holds:
        ``CostModel(layer_kinds="per-kind")``), and MTP layers are on the last stage in its time
        and its memory; the ``alltoall`` and ``allgather`` token dispatchers each at its own
        communication (``tp_traffic.py``). What is left: ``flex`` and ``alltoall_seq`` are
        priced with the ``alltoall`` dispatcher's communication (the EP all-to-alls and the TP
        gather / scatter of the token copies), and the plan keeps the user's dispatcher in its
        flags."""
        dispatcher = getattr(self, "moe_token_dispatcher_type", "alltoall")
        if self.is_moe and dispatcher not in ("alltoall", "allgather"):
            return (f"--moe-token-dispatcher-type {dispatcher}: its communication is priced as "
                    "the alltoall dispatcher's (the EP all-to-alls and the TP gather / scatter "
                    "of the token copies); the plan keeps your dispatcher, its predicted time "
                    "is less sure (alltoall is the one the planner models)")
        return None

    # --- parameter counts (whole, unsharded) ---
    def layer_param_split(self) -> LayerParams:
        """One decoder layer's parameters split into TP-sharded, replicated and expert parts:
        exact for a uniform model; each part's maximum over the kinds for a mixed one."""
        kinds = self.layer_kinds
        if len(kinds) == 1:
            return kinds[0].param_split()
        return LayerParams.envelope(k.param_split() for k in kinds)

    def layer_params(self) -> int:
        """One decoder layer (attention + MLP/experts + norms); a mixed model: see above."""
        return self.layer_param_split().total

    def embedding_params(self) -> int:
        """Word embeddings (h * V), plus learned position embeddings if any."""
        params = self.hidden_size * self.vocab_size
        if self.position_embedding_type == "learned_absolute":
            params += self.seq_length * self.hidden_size
        return params

    def output_params(self) -> int:
        """Final norm + output layer (the output weight counts 0 here if tied to the embedding)."""
        return self.norm_params + (self.hidden_size * self.vocab_size if self.untie_embeddings else 0)

    @property
    def mtp_layer_kind(self) -> int | None:
        """The kind of the MTP layers (Megatron builds them as the last decoder layer), or None."""
        return self.layer_kind_of[-1] if self.mtp_num_layers else None

    def mtp_param_split(self) -> LayerParams:
        """All MTP layers: each a decoder layer of ``mtp_layer_kind``, the 2h -> h projection
        (column-parallel) and three norms; embedding and output layer are the model's own."""
        if not self.mtp_num_layers:
            return LayerParams(0, 0, 0)
        h = self.hidden_size
        one = self.layer_kinds[self.layer_kind_of[-1]].param_split() \
            + LayerParams(2 * h * h, 3 * self.norm_params, 0)
        return one.scaled(self.mtp_num_layers)

    def mtp_params(self) -> int:
        return self.mtp_param_split().total

    def total_params(self) -> int:
        """Decoder layers, embedding, output layer and MTP layers."""
        layers = sum(count * kind.params()
                     for kind, count in zip(self.layer_kinds, self.kind_counts))
        return layers + self.embedding_params() + self.output_params() + self.mtp_params()

    def active_params(self) -> int:
        """Parameters one token touches (MoE: top-k routed experts instead of all)."""
        layers = sum(count * kind.active_params()
                     for kind, count in zip(self.layer_kinds, self.kind_counts))
        mtp = 0
        if self.mtp_num_layers:
            kind = self.layer_kinds[self.layer_kind_of[-1]]
            mtp = self.mtp_params() - self.mtp_num_layers * (kind.params() - kind.active_params())
        return layers + self.embedding_params() + self.output_params() + mtp

    # --- FLOPs, forward, one micro-batch of b sequences of length s (multiply-add = 2 FLOPs) ---
    def attention_forward_flops(self, micro_batch_size: int, seq_length: int) -> float:
        return max(k.attention_forward_flops(micro_batch_size, seq_length)
                   for k in self.layer_kinds)

    def mlp_forward_flops(self, micro_batch_size: int, seq_length: int) -> float:
        """One layer's MLP; a mixed model: the largest kind's."""
        return max(k.mlp_forward_flops(micro_batch_size, seq_length) for k in self.layer_kinds)

    def layer_forward_flops(self, micro_batch_size: int, seq_length: int) -> float:
        """One decoder layer: exact for a uniform model, the largest kind's for a mixed one."""
        return max(k.forward_flops(micro_batch_size, seq_length) for k in self.layer_kinds)

    def output_forward_flops(self, micro_batch_size: int, seq_length: int) -> float:
        """The logits GEMM (2*b*s*h*V); the loss is ``loss_forward_flops``."""
        return 2.0 * micro_batch_size * seq_length * self.hidden_size * self.vocab_size

    def loss_forward_flops(self, micro_batch_size: int, seq_length: int) -> float:
        """Softmax cross-entropy over the logits: ~5 element-wise ops per logit (max, sub/exp,
        sum, log, gather)."""
        return 5.0 * micro_batch_size * seq_length * self.vocab_size

    def mtp_forward_flops(self, micro_batch_size: int, seq_length: int) -> float:
        """All MTP layers: each its decoder layer, the 2h -> h projection and its logits GEMM."""
        if not self.mtp_num_layers:
            return 0.0
        tokens = float(micro_batch_size * seq_length)
        kind = self.layer_kinds[self.layer_kind_of[-1]]
        one = (kind.forward_flops(micro_batch_size, seq_length)
               + 2.0 * tokens * 2 * self.hidden_size * self.hidden_size
               + self.output_forward_flops(micro_batch_size, seq_length))
        return self.mtp_num_layers * one

    def model_flops_per_iteration(self, global_batch_size: int, seq_length: int) -> float:
        """Forward + backward (3x forward) FLOPs of one iteration, no recompute (for MFU): every
        decoder layer as its kind, the logits, the MTP layers."""
        forward = sum(count * kind.forward_flops(global_batch_size, seq_length)
                      for kind, count in zip(self.layer_kinds, self.kind_counts)) \
            + self.output_forward_flops(global_batch_size, seq_length)
        if self.mtp_num_layers:
            forward += self.mtp_forward_flops(global_batch_size, seq_length)
        return 3.0 * forward


def _validate(spec: ModelSpec, source: str) -> None:
    def need(cond: bool, field: str, expected: str) -> None:
        if not cond:
            raise SpecError(source, field, expected, getattr(spec, field))

    def is_int(value: object) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    def pos_int(field: str, low: int = 1) -> None:
        value = getattr(spec, field)
        need(is_int(value) and value >= low, field,
             "an integer > 0" if low else "an integer >= 0")
        need(value <= _LIMITS[field], field, f"an integer <= {_LIMITS[field]}")

    need(isinstance(spec.name, str) and bool(spec.name), "name", "a non-empty string")
    need(len(spec.name) <= NAME_MAX_CHARS and spec.name.isprintable(), "name",
         f"a printable name of at most {NAME_MAX_CHARS} characters")
    for field in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                  "num_query_groups", "vocab_size", "seq_length"):
        pos_int(field)
    for field in ("num_experts", "moe_top_k"):
        pos_int(field, low=0)
    for field in ("swiglu", "untie_embeddings", "add_bias_linear", "moe_shared_expert_gate",
                  "qk_layernorm", "multi_latent_attention"):
        need(isinstance(getattr(spec, field), bool), field, "true or false")
    need(spec.num_attention_heads % spec.num_query_groups == 0, "num_query_groups",
         f"a divisor of num_attention_heads ({spec.num_attention_heads})")
    if spec.kv_channels is None:
        need(spec.hidden_size % spec.num_attention_heads == 0, "hidden_size",
             f"a multiple of num_attention_heads ({spec.num_attention_heads}) or kv_channels set")
    else:
        pos_int("kv_channels")
    if spec.moe_ffn_hidden_size is not None:
        pos_int("moe_ffn_hidden_size")
    if spec.num_experts:
        need(1 <= spec.moe_top_k <= spec.num_experts, "moe_top_k",
             f"1 <= moe_top_k <= num_experts ({spec.num_experts})")
    else:
        need(spec.moe_top_k == 0, "moe_top_k", "0 for a dense model (num_experts = 0)")
    need(spec.normalization in _NORMALIZATIONS, "normalization",
         f"one of {', '.join(_NORMALIZATIONS)}")
    need(spec.position_embedding_type in _POSITION_EMBEDDINGS, "position_embedding_type",
         f"one of {', '.join(_POSITION_EMBEDDINGS)}")
    _validate_layer_kinds(spec, source, need, pos_int, is_int)


def _validate_layer_kinds(spec: ModelSpec, source: str, need, pos_int, is_int) -> None:
    """The MoE layer pattern, shared experts, MLA and MTP fields."""
    for field in ("first_k_dense_replace", "moe_shared_expert_intermediate_size",
                  "mtp_num_layers"):
        pos_int(field, low=0)
    need(spec.moe_token_dispatcher_type in MOE_DISPATCHERS, "moe_token_dispatcher_type",
         f"one of {', '.join(MOE_DISPATCHERS)}")
    freq = spec.moe_layer_freq
    if isinstance(freq, tuple):
        need(len(freq) == spec.num_layers, "moe_layer_freq",
             f"one 0/1 entry per layer ({spec.num_layers})")
        need(all(is_int(v) and v in (0, 1) for v in freq), "moe_layer_freq",
             "entries 0 (dense) or 1 (MoE)")
    else:
        need(is_int(freq) and 1 <= freq <= _LIMITS["moe_layer_freq"], "moe_layer_freq",
             _PATTERN_EXAMPLE)
    if not spec.num_experts:
        dense = "for a dense model (num_experts = 0)"
        need(freq == 1, "moe_layer_freq", f"1 (the default) {dense}")
        need(spec.first_k_dense_replace == 0, "first_k_dense_replace", f"0 {dense}")
        need(spec.moe_shared_expert_intermediate_size == 0,
             "moe_shared_expert_intermediate_size", f"0 {dense}")
        need(not spec.moe_shared_expert_gate, "moe_shared_expert_gate", f"false {dense}")
    else:
        need(spec.first_k_dense_replace < spec.num_layers, "first_k_dense_replace",
             f"fewer than num_layers ({spec.num_layers}): a MoE model needs a MoE layer")
        pattern = moe_layer_pattern(spec.num_layers, freq, spec.first_k_dense_replace)
        if not any(pattern):
            raise SpecError(source, "moe_layer_freq",
                            f"a pattern with at least one MoE layer after the first "
                            f"{spec.first_k_dense_replace} dense (num_experts = "
                            f"{spec.num_experts})", freq)
        need(not spec.moe_shared_expert_gate or spec.moe_shared_expert_intermediate_size > 0,
             "moe_shared_expert_gate", "false without shared experts "
             "(moe_shared_expert_intermediate_size 0)")
        need(not (spec.moe_shared_expert_intermediate_size and spec.add_bias_linear),
             "moe_shared_expert_intermediate_size",
             "0 with add_bias_linear (megatron-core's shared experts take no bias)")
    if spec.multi_latent_attention:
        for field in _MLA_FIELDS[1:]:
            need(getattr(spec, field) is not None, field, "a value with multi_latent_attention")
            pos_int(field)
        if spec.q_lora_rank is not None:
            pos_int("q_lora_rank")
        need(spec.kv_channels is None, "kv_channels",
             "unset with multi_latent_attention (heads are qk_head_dim + qk_pos_emb_head_dim "
             "and v_head_dim)")
        need(spec.num_query_groups == spec.num_attention_heads, "num_query_groups",
             f"num_attention_heads ({spec.num_attention_heads}) with multi_latent_attention")
    else:
        for field in _MLA_FIELDS:
            need(getattr(spec, field) is None, field, "unset without multi_latent_attention")


# --------------------------------------------------------------------------- presets
# Public architecture figures (Hugging Face config.json of each model).

PRESETS: dict[str, ModelSpec] = {
    # Meta-Llama-3-8B: 8.03 B parameters.
    "llama3-8b": ModelSpec(
        name="llama3-8b", num_layers=32, hidden_size=4096, ffn_hidden_size=14336,
        num_attention_heads=32, num_query_groups=8, vocab_size=128256, seq_length=8192),
    # Llama-2-13b: 13.0 B.
    "llama2-13b": ModelSpec(
        name="llama2-13b", num_layers=40, hidden_size=5120, ffn_hidden_size=13824,
        num_attention_heads=40, num_query_groups=40, vocab_size=32000, seq_length=4096),
    # LLaMA-1 "30B" (released as 33B): 32.5 B.
    "llama-30b": ModelSpec(
        name="llama-30b", num_layers=60, hidden_size=6656, ffn_hidden_size=17920,
        num_attention_heads=52, num_query_groups=52, vocab_size=32000, seq_length=2048),
    # Mixtral-8x7B: 46.7 B total, 12.9 B active. Native context is 32768; the preset trains at
    # 4096 (override per plan with --seq-length).
    "mixtral-8x7b": ModelSpec(
        name="mixtral-8x7b", num_layers=32, hidden_size=4096, ffn_hidden_size=14336,
        num_attention_heads=32, num_query_groups=8, vocab_size=32000, seq_length=4096,
        num_experts=8, moe_top_k=2),
    # Meta-Llama-3-70B: 70.6 B.
    "llama3-70b": ModelSpec(
        name="llama3-70b", num_layers=80, hidden_size=8192, ffn_hidden_size=28672,
        num_attention_heads=64, num_query_groups=8, vocab_size=128256, seq_length=8192),
    # LLaMA-3.1 405B (Meta's model card: 126 layers, d 16384, FFN 53248, 128 heads, 8 KV heads)
    "llama3-405b": ModelSpec(
        name="llama3-405b", num_layers=126, hidden_size=16384, ffn_hidden_size=53248,
        num_attention_heads=128, num_query_groups=8, vocab_size=128256, seq_length=8192),
    # DeepSeek-V3 (config.json: 61 layers, first_k_dense_replace 3, 256 routed experts top-8,
    # 1 shared expert, moe_intermediate_size 2048, intermediate_size 18432, hidden 7168, 128
    # heads; MLA q_lora_rank 1536, kv_lora_rank 512, qk_nope_head_dim 128, qk_rope_head_dim 64,
    # v_head_dim 128, q/kv latent norms; vocab 129280, untied; num_nextn_predict_layers 1):
    # 671 B main model + 11.5 B MTP, 37 B active. Pre-trained at 4096 tokens.
    "deepseek-v3": ModelSpec(
        name="deepseek-v3", num_layers=61, hidden_size=7168, ffn_hidden_size=18432,
        num_attention_heads=128, num_query_groups=128, vocab_size=129280, seq_length=4096,
        num_experts=256, moe_top_k=8, moe_ffn_hidden_size=2048, first_k_dense_replace=3,
        moe_shared_expert_intermediate_size=2048, qk_layernorm=True,
        multi_latent_attention=True, q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128,
        qk_pos_emb_head_dim=64, v_head_dim=128, mtp_num_layers=1),
    # Qwen3-235B-A22B (config.json: 94 layers, all MoE, 128 experts top-8, moe_intermediate_size
    # 1536, hidden 4096, 64 heads, 4 KV heads of 128, Q/K norms, vocab 151936, untied): 235 B,
    # 22 B active. intermediate_size 12288 is unused (no dense layer).
    "qwen3-235b-a22b": ModelSpec(
        name="qwen3-235b-a22b", num_layers=94, hidden_size=4096, ffn_hidden_size=12288,
        num_attention_heads=64, num_query_groups=4, kv_channels=128, vocab_size=151936,
        seq_length=4096, num_experts=128, moe_top_k=8, moe_ffn_hidden_size=1536,
        qk_layernorm=True),
    # Qwen3-30B-A3B (config.json: 48 layers, all MoE, 128 experts top-8, moe_intermediate_size
    # 768, hidden 2048, 32 heads, 4 KV heads of 128, Q/K norms, vocab 151936, untied): 30.5 B,
    # 3.3 B active.
    "qwen3-30b-a3b": ModelSpec(
        name="qwen3-30b-a3b", num_layers=48, hidden_size=2048, ffn_hidden_size=6144,
        num_attention_heads=32, num_query_groups=4, kv_channels=128, vocab_size=151936,
        seq_length=4096, num_experts=128, moe_top_k=8, moe_ffn_hidden_size=768,
        qk_layernorm=True),
}

_FIELD_NAMES = {f.name for f in fields(ModelSpec)}
_REQUIRED = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "vocab_size",
             "seq_length")
_TOP_LEVEL = "a mapping of model fields"   # what a model spec's top level must be


def _layer_freq(value: Any, source: str) -> Any:
    """A YAML / args ``moe_layer_freq`` as ModelSpec holds it: an int, or a tuple from a list or
    a list expression (other values are left for validation to refuse)."""
    if isinstance(value, list):
        return tuple(value)
    if isinstance(value, str):
        text = value.strip()
        if "[" in text:
            try:
                return parse_layer_pattern(text)
            except PatternError as exc:
                raise SpecError(source, "moe_layer_freq", f"{_PATTERN_EXAMPLE} ({exc})",
                                value) from None
        try:
            return int(text)
        except ValueError:
            raise SpecError(source, "moe_layer_freq", _PATTERN_EXAMPLE, value) from None
    return value


def model_from_dict(data: Mapping[str, Any], source: str = "<dict>") -> ModelSpec:
    """Validate a parsed model spec (``ModelSpec`` field names); SpecError on a bad field."""
    data = require_mapping(data, source, "<top level>", _TOP_LEVEL)
    for key in data:
        if key not in _FIELD_NAMES:
            raise SpecError(source, str(key)[:80],
                            f"a known key (one of: {', '.join(sorted(_FIELD_NAMES))})",
                            "unknown key")
    for key in _REQUIRED:
        if key not in data:
            raise SpecError(source, key, "a value", "missing")
    values = dict(data)
    if "name" not in values:
        values["name"] = os.path.splitext(os.path.basename(source))[0] \
            if source[:1] != "<" else "custom"
    values.setdefault("num_query_groups", values["num_attention_heads"])
    if "moe_layer_freq" in values:
        values["moe_layer_freq"] = _layer_freq(values["moe_layer_freq"], source)
    # validate with the file's name as source (ModelSpec.__post_init__ would say <ModelSpec>)
    probe = object.__new__(ModelSpec)
    for f in fields(ModelSpec):
        object.__setattr__(probe, f.name, values.get(f.name, f.default))
    _validate(probe, source)
    return ModelSpec(**values)


def model_to_dict(spec: ModelSpec) -> dict[str, Any]:
    """``spec`` as a YAML model file's mapping: the name, the required fields and every field that
    differs from its default (a layer pattern as its list expression). ``model_from_dict`` of it
    is ``spec`` again."""
    out: dict[str, Any] = {}
    for f in fields(ModelSpec):
        value = getattr(spec, f.name)
        if f.name in ("name", *_REQUIRED, "num_query_groups") or value != f.default:
            out[f.name] = pattern_expression(value) if isinstance(value, tuple) else value
    return out


def load_model(path: str) -> ModelSpec:
    """Load and validate a YAML model file; raises SpecError naming file and field."""
    return model_from_dict(load_yaml_mapping(path, "model", _TOP_LEVEL), source=path)


def get_model(name_or_path: str) -> ModelSpec:
    """A preset name or a YAML file path; SpecError on unknown name / bad file."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    if name_or_path.endswith((".yaml", ".yml")) or os.path.exists(name_or_path):
        return load_model(name_or_path)
    raise SpecError("<model>", "model",
                    f"a preset ({', '.join(sorted(PRESETS))}) or a YAML file path", name_or_path)


# --------------------------------------------------------------------------- Megatron args

def _arg(args: Any, name: str, default: Any = None) -> Any:
    value = getattr(args, name, default)
    return default if value is None else value


def _first_arg(args: Any, *names: str) -> Any:
    """The first of ``names`` that is set (not None, not False) on ``args``, else None."""
    for name in names:
        value = getattr(args, name, None)
        if value is not None and value is not False:
            return value
    return None


# Arguments that change what a decoder layer is in ways the planner does not model: a launch that
# sets one is refused, naming it, rather than planned as if it were a plain GPT layer.
# (namespace attribute, flag, what it builds)
_UNMODELLED_ARGS: tuple[tuple[str, str, str], ...] = (
    ("experimental_attention_variant", "--experimental-attention-variant",
     "an experimental attention variant"),
    ("linear_attention_freq", "--linear-attention-freq", "linear-attention layers"),
    ("heterogeneous_layers_config_path", "--heterogeneous-layers-config-path",
     "heterogeneous layers"),
    ("heterogeneous_layers_config_encoded_json", "--heterogeneous-layers-config-encoded-json",
     "heterogeneous layers"),
    ("hybrid_layer_pattern", "--hybrid-layer-pattern", "hybrid (Mamba) layers"),
    ("hybrid_override_pattern", "--hybrid-override-pattern", "hybrid (Mamba) layers"),
    ("moe_latent_size", "--moe-latent-size", "MoE latent projections"),
    ("attention_output_gate", "--attention-output-gate", "a gated attention output"),
    ("mtp_use_repeated_layer", "--mtp-use-repeated-layer", "MTP layers sharing one's weights"),
    ("full_attention_interval", "--full-attention-interval",
     "MindSpeed-LLM's linear / full attention layers"),
)
_MODELLED = ("the planner models GPT decoder layers: MHA/GQA or MLA attention, a dense or MoE "
             "MLP with shared experts")


def unmodelled_flag_refusal(present: Callable[[str], bool]) -> str | None:
    """Why a command line with the flags ``present`` says it has cannot be planned (the first
    flag of a layer the planner does not model), or None; ``_refuse_unmodelled``'s rule for
    flags not yet parsed (``poseidon plan --megatron-args``)."""
    for _attr, flag, what in _UNMODELLED_ARGS:
        if present(flag):
            return f"{flag}: {_MODELLED}; not {what}"
    return None


def _refuse_unmodelled(args: Any, source: str) -> None:
    for attr, flag, what in _UNMODELLED_ARGS:
        value = getattr(args, attr, None)
        if value is not None and value is not False and value != 0:
            raise SpecError(source, flag, f"unset ({_MODELLED}; not {what})", value)
    gate_dim = getattr(args, "shared_expert_gate_output_dimension", None)
    if gate_dim not in (None, 1) and getattr(args, "shared_expert_gate", False):
        raise SpecError(source, "--shared-expert-gate-output-dimension",
                        "1 (a shared-expert gate of one output; wider gates are not modelled)",
                        gate_dim)


def _moe_fields(args: Any, ffn: int, source: str) -> dict[str, Any]:
    """The MoE fields of a ModelSpec from Megatron / MindSpeed-LLM args (empty: dense)."""
    num_experts = _arg(args, "num_experts", 0)
    if not num_experts:
        for attr, flag in (("first_k_dense_replace", "--first-k-dense-replace"),
                           ("moe_shared_expert_intermediate_size",
                            "--moe-shared-expert-intermediate-size"),
                           ("n_shared_experts", "--n-shared-experts")):
            if getattr(args, attr, None):
                raise SpecError(source, flag, "unset without --num-experts (a dense model)",
                                getattr(args, attr))
        return {}
    expert_ffn = _first_arg(args, "moe_ffn_hidden_size", "deprecated_moe_intermediate_size",
                            "moe_intermediate_size")
    shared = _arg(args, "moe_shared_expert_intermediate_size")
    if shared is None and getattr(args, "n_shared_experts", None):
        # MindSpeed-LLM: n shared experts of the routed experts' width
        shared = int(args.n_shared_experts) * int(expert_ffn or ffn)
    freq = getattr(args, "moe_layer_freq", None)
    return dict(
        num_experts=int(num_experts),
        moe_top_k=int(_arg(args, "moe_router_topk", 2)),
        moe_ffn_hidden_size=expert_ffn,
        moe_layer_freq=_layer_freq(1 if freq is None else freq, source),
        first_k_dense_replace=int(_arg(args, "first_k_dense_replace", 0)),
        moe_shared_expert_intermediate_size=int(shared or 0),
        moe_shared_expert_gate=bool(shared) and bool(
            _first_arg(args, "moe_shared_expert_gate", "shared_expert_gate")),
        moe_token_dispatcher_type=str(_arg(args, "moe_token_dispatcher_type", "alltoall")),
    )


def _mla_fields(args: Any) -> dict[str, Any]:
    """The MLA fields (MindSpeed-LLM's deprecated names win, as its validation applies them)."""
    if not _first_arg(args, "multi_latent_attention", "deprecated_multi_head_latent_attention",
                      "multi_head_latent_attention"):
        return {}
    return dict(
        multi_latent_attention=True,
        q_lora_rank=_arg(args, "q_lora_rank"),
        kv_lora_rank=_arg(args, "kv_lora_rank", 32),
        qk_head_dim=_first_arg(args, "deprecated_qk_nope_head_dim", "qk_nope_head_dim")
        or _arg(args, "qk_head_dim", 128),
        qk_pos_emb_head_dim=_first_arg(args, "deprecated_qk_rope_head_dim", "qk_rope_head_dim")
        or _arg(args, "qk_pos_emb_head_dim", 64),
        v_head_dim=_arg(args, "v_head_dim", 128),
    )


def model_from_megatron_args(args: Any, name: str = "megatron") -> ModelSpec:
    """A ModelSpec from a Megatron (or MindSpeed-LLM) args namespace, validated or not.

    Vocabulary: ``padded_vocab_size`` if set (validated args), else ``vocab_size`` rounded up to
    ``make_vocab_size_divisible_by`` (default 128; Megatron also multiplies that by TP, which the
    planner is choosing, so the result may be up to 128*(TP-1) rows short). Unvalidated defaults
    follow ``validate_args``: ``ffn_hidden_size`` 4h (SwiGLU: int(8h/3 / 64)*64),
    ``kv_channels`` h/a, query groups = heads unless ``group_query_attention``.

    Layer kinds: ``--num-experts``, ``--moe-ffn-hidden-size``, ``--moe-router-topk``,
    ``--moe-layer-freq`` (int or list), ``--first-k-dense-replace`` (MindSpeed-LLM),
    ``--moe-shared-expert-intermediate-size`` (or MindSpeed-LLM's ``--n-shared-experts``), the
    shared-expert gate, ``--multi-latent-attention`` with ``--q-lora-rank``, ``--kv-lora-rank``,
    ``--qk-head-dim``, ``--qk-pos-emb-head-dim``, ``--v-head-dim``, ``--qk-layernorm``,
    ``--mtp-num-layers``, ``--moe-token-dispatcher-type`` (Megatron's default ``allgather``
    when the flag is absent: a launch pins ``alltoall`` before parsing). An argument that builds a layer the planner does not model
    (``_UNMODELLED_ARGS``) is a SpecError naming the flag.
    """
    source = "<megatron args>"
    hidden = _arg(args, "hidden_size")
    heads = _arg(args, "num_attention_heads")
    for field, value in (("num_layers", _arg(args, "num_layers")), ("hidden_size", hidden),
                         ("num_attention_heads", heads), ("seq_length", _arg(args, "seq_length"))):
        if not isinstance(value, int) or value <= 0:
            raise SpecError(source, field, "an integer > 0", value)
    _refuse_unmodelled(args, source)
    swiglu = bool(_arg(args, "swiglu", False))
    ffn = _arg(args, "ffn_hidden_size")
    if ffn is None:
        ffn = int((4 * hidden * 2 / 3) / 64) * 64 if swiglu else 4 * hidden
    groups = heads
    if _arg(args, "group_query_attention", False) and _arg(args, "num_query_groups") is not None:
        groups = args.num_query_groups
    vocab = _arg(args, "padded_vocab_size")
    if vocab is None:
        raw = _arg(args, "vocab_size")
        if raw is None:
            raise SpecError(source, "padded_vocab_size",
                            "padded_vocab_size or vocab_size (pass --vocab-size with this "
                            "tokenizer)", None)
        multiple = int(_arg(args, "make_vocab_size_divisible_by", 128))
        vocab = -(-int(raw) // multiple) * multiple
    position = _arg(args, "position_embedding_type", "learned_absolute")
    if position not in _POSITION_EMBEDDINGS:
        position = "rope"  # yarn / mrope / relative: no extra parameters worth counting
    moe = _moe_fields(args, int(ffn), source)
    mla = _mla_fields(args)
    spec = dict(
        name=name,
        num_layers=args.num_layers,
        hidden_size=hidden,
        ffn_hidden_size=int(ffn),
        num_attention_heads=heads,
        num_query_groups=int(heads if mla else groups),
        vocab_size=int(vocab),
        seq_length=args.seq_length,
        swiglu=swiglu,
        untie_embeddings=bool(_arg(args, "untie_embeddings_and_output_weights", False)),
        normalization=_arg(args, "normalization", "LayerNorm"),
        kv_channels=None if mla else _arg(args, "kv_channels"),   # MLA ignores --kv-channels
        add_bias_linear=bool(_arg(args, "add_bias_linear", False)),
        position_embedding_type=position,
        qk_layernorm=bool(_arg(args, "qk_layernorm", False)),
        mtp_num_layers=int(_arg(args, "mtp_num_layers", 0)),
        **moe, **mla,
    )
    return model_from_dict(spec, source=source)
