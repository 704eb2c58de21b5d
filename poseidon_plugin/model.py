"""Model specification: presets, YAML and Megatron-args construction; parameter and FLOP counts.

Conventions
-----------
* h = hidden_size, a = heads, g = query groups (KV heads), d = kv_channels (head dim, default h/a),
  f = ffn_hidden_size (per expert: ``moe_ffn_hidden_size`` or f), E = experts, k = top-k, V = vocab.
* Parameters per decoder layer (Megatron's GPT layer, as megatron-core's
  ``theoretical_memory_usage`` counts them, plus optional linear biases):
  attention ``h*a*d`` (Q) + ``2*h*g*d`` (K, V) + ``a*d*h`` (output projection);
  MLP ``h*f*(3 if swiglu else 2)``; MoE: E such MLPs + router ``h*E``;
  two norms ``2*h*(1 if RMSNorm else 2)``.
* FLOPs: a multiply-add is 2 FLOPs. Attention core (QK^T and attention x V) uses a **causal**
  mask: half of the ``4*b*s^2*a*d`` products, as megatron-core 0.19's
  ``num_floating_point_operations`` counts and as flash attention executes. MoE layers count the
  top-k experts each token visits plus the router GEMM. Norms, softmax and element-wise ops are
  not counted (they are memory-bound and small next to the GEMMs).

YAML model file: the ``ModelSpec`` field names, e.g. ``examples/models/tiny-gpt.yaml``; ``name``
defaults to the file stem; unknown keys are errors. Sizes are bounded (``_LIMITS``: e.g. at most
4096 layers, a hidden size of 2^20) so that no count or FLOP figure overflows or hangs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any, Mapping

from .errors import SpecError
from .specfile import load_yaml_mapping, require_mapping

_NORMALIZATIONS = ("RMSNorm", "LayerNorm")
# field -> the largest value accepted (llama3-405b: 126 layers, hidden 16384, vocab 128256)
_LIMITS: dict[str, int] = {
    "num_layers": 4096, "hidden_size": 1 << 20, "ffn_hidden_size": 1 << 22,
    "num_attention_heads": 1 << 16, "num_query_groups": 1 << 16, "vocab_size": 1 << 24,
    "seq_length": 1 << 24, "num_experts": 1 << 16, "moe_top_k": 1 << 16, "kv_channels": 1 << 16,
    "moe_ffn_hidden_size": 1 << 22,
}
NAME_MAX_CHARS = 200
_POSITION_EMBEDDINGS = ("rope", "learned_absolute", "none")


@dataclass(frozen=True)
class LayerParams:
    """One decoder layer's parameters by how tensor parallelism holds them."""
    tp_sharded: int    # attention + dense MLP weights: split over TP ranks
    replicated: int    # norms, router, row-parallel biases: a full copy on every TP rank
    expert: int        # routed experts (split over expert-TP = TP, expert-parallel 1)

    @property
    def total(self) -> int:
        return self.tp_sharded + self.replicated + self.expert

    def per_device(self, tp: int) -> float:
        return (self.tp_sharded + self.expert) / tp + self.replicated


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int          # = heads without GQA
    vocab_size: int                # padded vocabulary (what the embedding table holds)
    seq_length: int                # default sequence length (a plan may override)
    num_experts: int = 0           # 0 -> dense MLP
    moe_top_k: int = 0
    swiglu: bool = True
    untie_embeddings: bool = True  # LLaMA: separate output layer
    normalization: str = "RMSNorm"  # or "LayerNorm"
    kv_channels: int | None = None  # default hidden / heads
    # --- extensions (defaults keep the stub's meaning) ---
    moe_ffn_hidden_size: int | None = None  # per-expert FFN; None -> ffn_hidden_size
    add_bias_linear: bool = False           # Megatron's default is True; LLaMA disables it
    position_embedding_type: str = "rope"   # "learned_absolute" adds seq_length*h parameters

    def __post_init__(self) -> None:
        _validate(self, "<ModelSpec>")

    # --- derived sizes ---
    @property
    def head_dim(self) -> int:
        return self.kv_channels if self.kv_channels else self.hidden_size // self.num_attention_heads

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def expert_ffn_hidden_size(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    @property
    def norm_params(self) -> int:
        """Parameters of one norm: weight (RMSNorm) or weight + bias (LayerNorm)."""
        return self.hidden_size * (1 if self.normalization == "RMSNorm" else 2)

    def signature(self) -> str:
        """Stable string of everything that shapes a layer's cost (profile DB key).

        Excludes the name, the layer count and the sequence length (those are in the profile key or
        do not change one layer's cost), so two presets of the same shape share profiles.
        """
        parts = [
            f"h{self.hidden_size}", f"f{self.ffn_hidden_size}", f"a{self.num_attention_heads}",
            f"g{self.num_query_groups}", f"d{self.head_dim}", f"v{self.vocab_size}",
            "swiglu" if self.swiglu else "gelu", self.normalization.lower(),
            "bias" if self.add_bias_linear else "nobias",
            "untied" if self.untie_embeddings else "tied",
            f"pos-{self.position_embedding_type}",
        ]
        if self.is_moe:
            parts.append(f"moe-e{self.num_experts}-k{self.moe_top_k}-f{self.expert_ffn_hidden_size}")
        return "-".join(parts)

    # --- parameter counts (whole, unsharded) ---
    def _mlp_params(self, ffn: int) -> tuple[int, int]:
        """(column/row-parallel weights + column bias, replicated row bias) of one MLP."""
        h = self.hidden_size
        fc1_out = ffn * (2 if self.swiglu else 1)
        weights = h * fc1_out + ffn * h
        if self.add_bias_linear:
            return weights + fc1_out, h
        return weights, 0

    def layer_param_split(self) -> LayerParams:
        """One decoder layer's parameters split into TP-sharded, replicated and expert parts."""
        h, a, g, d = self.hidden_size, self.num_attention_heads, self.num_query_groups, self.head_dim
        qkv_out = a * d + 2 * g * d
        attention = h * qkv_out + a * d * h
        replicated = 2 * self.norm_params
        if self.add_bias_linear:
            attention += qkv_out       # column-parallel QKV bias is sharded
            replicated += h            # row-parallel output bias is replicated
        if self.is_moe:
            mlp, mlp_bias = self._mlp_params(self.expert_ffn_hidden_size)
            expert = self.num_experts * (mlp + mlp_bias)
            router = h * self.num_experts + (self.num_experts if self.add_bias_linear else 0)
            return LayerParams(tp_sharded=attention, replicated=replicated + router, expert=expert)
        mlp, mlp_bias = self._mlp_params(self.ffn_hidden_size)
        return LayerParams(tp_sharded=attention + mlp, replicated=replicated + mlp_bias, expert=0)

    def layer_params(self) -> int:
        """One decoder layer (attention + MLP/experts + norms)."""
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

    def total_params(self) -> int:
        return self.num_layers * self.layer_params() + self.embedding_params() + self.output_params()

    def active_params(self) -> int:
        """Parameters one token touches (MoE: top-k experts instead of all)."""
        if not self.is_moe:
            return self.total_params()
        split = self.layer_param_split()
        active_expert = split.expert // self.num_experts * self.moe_top_k
        per_layer = split.tp_sharded + split.replicated + active_expert
        return self.num_layers * per_layer + self.embedding_params() + self.output_params()

    # --- FLOPs, forward, one micro-batch of b sequences of length s (multiply-add = 2 FLOPs) ---
    def attention_forward_flops(self, micro_batch_size: int, seq_length: int) -> float:
        b, s = micro_batch_size, seq_length
        h, a, g, d = self.hidden_size, self.num_attention_heads, self.num_query_groups, self.head_dim
        projections = 2.0 * b * s * h * (a * d + 2 * g * d) + 2.0 * b * s * a * d * h
        core = 4.0 * b * s * s * a * d / 2  # QK^T and attn x V, causal mask: half
        return projections + core

    def mlp_forward_flops(self, micro_batch_size: int, seq_length: int) -> float:
        tokens = float(micro_batch_size * seq_length)
        gemms = 3 if self.swiglu else 2
        if self.is_moe:
            expert = 2.0 * tokens * self.hidden_size * self.expert_ffn_hidden_size * gemms
            router = 2.0 * tokens * self.hidden_size * self.num_experts
            return self.moe_top_k * expert + router
        return 2.0 * tokens * self.hidden_size * self.ffn_hidden_size * gemms

    def layer_forward_flops(self, micro_batch_size: int, seq_length: int) -> float:
        return (self.attention_forward_flops(micro_batch_size, seq_length)
                + self.mlp_forward_flops(micro_batch_size, seq_length))

    def output_forward_flops(self, micro_batch_size: int, seq_length: int) -> float:
        """The logits GEMM (2*b*s*h*V); the loss is ``loss_forward_flops``."""
        return 2.0 * micro_batch_size * seq_length * self.hidden_size * self.vocab_size

    def loss_forward_flops(self, micro_batch_size: int, seq_length: int) -> float:
        """Softmax cross-entropy over the logits: ~5 element-wise ops per logit (max, sub/exp,
        sum, log, gather)."""
        return 5.0 * micro_batch_size * seq_length * self.vocab_size

    def model_flops_per_iteration(self, global_batch_size: int, seq_length: int) -> float:
        """Forward + backward (3x forward) FLOPs of one iteration, no recompute (for MFU)."""
        forward = (self.num_layers * self.layer_forward_flops(global_batch_size, seq_length)
                   + self.output_forward_flops(global_batch_size, seq_length))
        return 3.0 * forward


def _validate(spec: ModelSpec, source: str) -> None:
    def need(cond: bool, field: str, expected: str) -> None:
        if not cond:
            raise SpecError(source, field, expected, getattr(spec, field))

    def pos_int(field: str, low: int = 1) -> None:
        value = getattr(spec, field)
        need(isinstance(value, int) and not isinstance(value, bool) and value >= low, field,
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
    for field in ("swiglu", "untie_embeddings", "add_bias_linear"):
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
}

_FIELD_NAMES = {f.name for f in fields(ModelSpec)}
_REQUIRED = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "vocab_size",
             "seq_length")
_TOP_LEVEL = "a mapping of model fields"   # what a model spec's top level must be


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
    # validate with the file's name as source (ModelSpec.__post_init__ would say <ModelSpec>)
    probe = object.__new__(ModelSpec)
    for f in fields(ModelSpec):
        object.__setattr__(probe, f.name, values.get(f.name, f.default))
    _validate(probe, source)
    return ModelSpec(**values)


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


def _arg(args: Any, name: str, default: Any = None) -> Any:
    value = getattr(args, name, default)
    return default if value is None else value


def model_from_megatron_args(args: Any, name: str = "megatron") -> ModelSpec:
    """A ModelSpec from a Megatron (or MindSpeed-LLM) args namespace, validated or not.

    Vocabulary: ``padded_vocab_size`` if set (validated args), else ``vocab_size`` rounded up to
    ``make_vocab_size_divisible_by`` (default 128; Megatron also multiplies that by TP, which the
    planner is choosing, so the result may be up to 128*(TP-1) rows short). Unvalidated defaults
    follow ``validate_args``: ``ffn_hidden_size`` 4h (SwiGLU: int(8h/3 / 64)*64),
    ``kv_channels`` h/a, query groups = heads unless ``group_query_attention``.
    """
    source = "<megatron args>"
    hidden = _arg(args, "hidden_size")
    heads = _arg(args, "num_attention_heads")
    for field, value in (("num_layers", _arg(args, "num_layers")), ("hidden_size", hidden),
                         ("num_attention_heads", heads), ("seq_length", _arg(args, "seq_length"))):
        if not isinstance(value, int) or value <= 0:
            raise SpecError(source, field, "an integer > 0", value)
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
    num_experts = _arg(args, "num_experts", 0)
    position = _arg(args, "position_embedding_type", "learned_absolute")
    if position not in _POSITION_EMBEDDINGS:
        position = "rope"  # yarn / mrope / relative: no extra parameters worth counting
    spec = dict(
        name=name,
        num_layers=args.num_layers,
        hidden_size=hidden,
        ffn_hidden_size=int(ffn),
        num_attention_heads=heads,
        num_query_groups=int(groups),
        vocab_size=int(vocab),
        seq_length=args.seq_length,
        num_experts=int(num_experts),
        moe_top_k=int(_arg(args, "moe_router_topk", 2)) if num_experts else 0,
        swiglu=swiglu,
        untie_embeddings=bool(_arg(args, "untie_embeddings_and_output_weights", False)),
        normalization=_arg(args, "normalization", "LayerNorm"),
        kv_channels=_arg(args, "kv_channels"),
        moe_ffn_hidden_size=_arg(args, "moe_ffn_hidden_size") if num_experts else None,
        add_bias_linear=bool(_arg(args, "add_bias_linear", False)),
        position_embedding_type=position,
    )
    return model_from_dict(spec, source=source)
