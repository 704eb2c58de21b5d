"""Layer kinds: what one decoder layer of a model is, its parameters and FLOPs; layer patterns.

A model is a sequence of decoder layers, each of one ``LayerKind`` (``ModelSpec.layer_kinds``,
indexed per layer by ``ModelSpec.layer_kind_of``). A kind is self-contained: its hidden size,
norms and linear biases, its self-attention (``AttentionSpec``: MHA / GQA, or multi-latent
attention with its ranks and head dims) and its MLP (``MLPSpec``: dense, or MoE with routed and
shared experts), so one kind can be counted, profiled or keyed on its own.

Counts follow megatron-core 0.19's modules (``SelfAttention``, ``MLASelfAttention`` with the
Transformer Engine spec, ``MLP``, ``MoELayer`` with ``SharedExpertMLP``). Parameters are split
by how tensor parallelism holds them (``LayerParams``): the Q/K/V/output projections, the dense
MLP and the shared experts are TP-sharded; norms, the router, row-parallel biases, the shared
experts' gate and MLA's down projections (``TELinear``, ``parallel_mode='duplicated'``) are
replicated; the routed experts are ``expert`` (split over expert-TP = TP and over
the expert-parallel ranks: ``LayerParams.per_device(tp, ep)``).

FLOPs (forward, one micro-batch of ``b`` sequences of length ``s``; a multiply-add is 2 FLOPs):
the projection GEMMs, the causal attention core (half of QK^T and attention x V), the MLP
GEMMs -- MoE: the top-k routed experts each token visits, the shared experts and the router
GEMM. Norms, softmax and element-wise ops are not counted.

Layer patterns (which layers are MoE) are Megatron's ``--moe-layer-freq``: an int N makes layer
i (0-based) MoE when ``i % N == 0``; a list expression such as ``"[0]*3+[1]*58"`` or
``"([0]+[1]*3)*2"`` gives one 0 (dense) / 1 (MoE) per layer. MindSpeed-LLM's
``--first-k-dense-replace k`` makes the first k layers dense as well.
"""

from __future__ import annotations

import re

import functools

from dataclasses import dataclass

ATTENTION_KINDS = ("mha", "gqa", "mla")
MAX_PATTERN_LAYERS = 4096          # = model.py's num_layers limit
_MAX_PATTERN_CHARS = 65536


# --------------------------------------------------------------------------- parameters


@dataclass(frozen=True)
class LayerParams:
    """One decoder layer's parameters by how tensor parallelism holds them."""
    tp_sharded: int    # attention, dense MLP and shared-expert weights: split over TP ranks
    replicated: int    # norms, router, row-parallel biases, MLA down projections: on every TP rank
    expert: int        # routed experts (split over expert-TP = TP and EP)

    @property
    def total(self) -> int:
        return self.tp_sharded + self.replicated + self.expert

    def per_device(self, tp: int, ep: int = 1) -> float:
        """Parameters on one device: TP-sharded and routed experts / TP (the experts also
        / EP: expert-TP = TP, each EP rank holds num_experts / EP of them), replicated whole."""
        if ep == 1:
            return (self.tp_sharded + self.expert) / tp + self.replicated
        return (self.tp_sharded + self.expert / ep) / tp + self.replicated

    def expert_per_device(self, tp: int, ep: int = 1) -> float:
        """The routed experts' parameters on one device (expert-TP = TP, / EP)."""
        return self.expert / (tp * ep)

    def __add__(self, other: LayerParams) -> LayerParams:
        return LayerParams(self.tp_sharded + other.tp_sharded,
                           self.replicated + other.replicated, self.expert + other.expert)

    def scaled(self, count: int) -> LayerParams:
        """``count`` layers of this split."""
        return LayerParams(count * self.tp_sharded, count * self.replicated, count * self.expert)

    @staticmethod
    def envelope(splits) -> LayerParams:
        """Each part's largest value over ``splits``: a split no smaller than any of them, part by
        part (so ``per_device(tp)`` bounds every one's at every TP)."""
        splits = list(splits)
        return LayerParams(max(p.tp_sharded for p in splits), max(p.replicated for p in splits),
                           max(p.expert for p in splits))


ZERO_PARAMS = LayerParams(0, 0, 0)


def norm_params(size: int, normalization: str) -> int:
    """Parameters of one norm over ``size`` features: weight (RMSNorm) or weight + bias."""
    return size * (1 if normalization == "RMSNorm" else 2)


# --------------------------------------------------------------------------- attention


@dataclass(frozen=True)
class AttentionSpec:
    """One layer's self-attention.

    MHA / GQA: ``num_query_groups`` K/V heads (= heads for MHA) of ``head_dim`` (kv_channels).
    MLA (``multi_latent``): Q through a rank-``q_lora_rank`` latent (None: one full-rank
    projection), K/V through a rank-``kv_lora_rank`` latent plus a shared RoPE key of
    ``qk_pos_emb_head_dim``; Q/K heads of ``qk_head_dim + qk_pos_emb_head_dim``, V heads of
    ``v_head_dim``. ``head_dim`` is then the Q/K head dim and ``num_query_groups`` the heads.
    ``qk_layernorm``: norms on Q and K per head (MHA/GQA) or on the two latents (MLA).
    """
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    qk_layernorm: bool = False
    multi_latent: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_head_dim: int = 0
    qk_pos_emb_head_dim: int = 0
    v_head_dim: int = 0

    @property
    def kind(self) -> str:
        """``mla``, ``mha`` (groups = heads) or ``gqa``."""
        if self.multi_latent:
            return "mla"
        return "mha" if self.num_query_groups == self.num_attention_heads else "gqa"

    def param_split(self, hidden_size: int, normalization: str,
                    add_bias_linear: bool) -> LayerParams:
        h, a = hidden_size, self.num_attention_heads
        replicated = 0
        if self.multi_latent:
            qh = self.qk_head_dim + self.qk_pos_emb_head_dim
            sharded = self.kv_lora_rank * a * (self.qk_head_dim + self.v_head_dim) \
                + a * self.v_head_dim * h
            replicated += h * (self.kv_lora_rank + self.qk_pos_emb_head_dim)
            if self.q_lora_rank is None:
                sharded += h * a * qh
            else:
                sharded += self.q_lora_rank * a * qh
                replicated += h * self.q_lora_rank
            if self.qk_layernorm:
                replicated += norm_params(self.kv_lora_rank, normalization)
                if self.q_lora_rank is not None:
                    replicated += norm_params(self.q_lora_rank, normalization)
            if add_bias_linear:
                replicated += h        # the row-parallel output bias (MLA projections: none)
            return LayerParams(tp_sharded=sharded, replicated=replicated, expert=0)
        g, d = self.num_query_groups, self.head_dim
        qkv_out = a * d + 2 * g * d
        sharded = h * qkv_out + a * d * h
        if add_bias_linear:
            sharded += qkv_out         # column-parallel QKV bias is sharded
            replicated += h            # row-parallel output bias is replicated
        if self.qk_layernorm:
            replicated += 2 * norm_params(d, normalization)
        return LayerParams(tp_sharded=sharded, replicated=replicated, expert=0)

    def forward_flops(self, hidden_size: int, micro_batch_size: int, seq_length: int) -> float:
        b, s, h, a = micro_batch_size, seq_length, hidden_size, self.num_attention_heads
        if self.multi_latent:
            qh, vh = self.qk_head_dim + self.qk_pos_emb_head_dim, self.v_head_dim
            q = h * a * qh if self.q_lora_rank is None \
                else self.q_lora_rank * (h + a * qh)
            kv = self.kv_lora_rank * (h + a * (self.qk_head_dim + vh)) \
                + h * self.qk_pos_emb_head_dim
            projections = 2.0 * b * s * (q + kv + a * vh * h)
            core = 1.0 * b * s * s * a * (qh + vh)  # QK^T and attn x V, causal: half
            return projections + core
        g, d = self.num_query_groups, self.head_dim
        projections = 2.0 * b * s * h * (a * d + 2 * g * d) + 2.0 * b * s * a * d * h
        core = 4.0 * b * s * s * a * d / 2  # QK^T and attn x V, causal mask: half
        return projections + core

    def core_forward_flops(self, micro_batch_size: int, seq_length: int) -> float:
        """The attention core alone (what selective recompute repeats)."""
        b, s, a = micro_batch_size, seq_length, self.num_attention_heads
        if self.multi_latent:
            return 1.0 * b * s * s * a * (self.qk_head_dim + self.qk_pos_emb_head_dim
                                          + self.v_head_dim)
        return 4.0 * b * s * s * a * self.head_dim / 2

    def signature(self) -> str:
        """Tokens a model signature adds for this attention (empty for plain MHA/GQA)."""
        parts = []
        if self.multi_latent:
            q = "full" if self.q_lora_rank is None else str(self.q_lora_rank)
            parts.append(f"mla-q{q}-kv{self.kv_lora_rank}-qk{self.qk_head_dim}"
                         f"-r{self.qk_pos_emb_head_dim}-v{self.v_head_dim}")
        if self.qk_layernorm:
            parts.append("qkln")
        return "-".join(parts)


# --------------------------------------------------------------------------- MLP


@dataclass(frozen=True)
class MLPSpec:
    """One layer's MLP: dense (``num_experts`` 0) or MoE.

    ``ffn_hidden_size`` is the dense MLP's width, or one routed expert's; ``top_k`` routed experts
    per token; ``shared_ffn_hidden_size`` all shared experts together (Megatron's
    ``--moe-shared-expert-intermediate-size``; 0: none) with an optional sigmoid gate.
    """
    ffn_hidden_size: int
    swiglu: bool = True
    num_experts: int = 0
    top_k: int = 0
    shared_ffn_hidden_size: int = 0
    shared_expert_gate: bool = False

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def _one_mlp(self, hidden_size: int, ffn: int, add_bias_linear: bool) -> tuple[int, int]:
        """(column/row-parallel weights + column bias, replicated row bias) of one MLP."""
        h = hidden_size
        fc1_out = ffn * (2 if self.swiglu else 1)
        weights = h * fc1_out + ffn * h
        if add_bias_linear:
            return weights + fc1_out, h
        return weights, 0

    def param_split(self, hidden_size: int, add_bias_linear: bool) -> LayerParams:
        h = hidden_size
        if not self.is_moe:
            mlp, mlp_bias = self._one_mlp(h, self.ffn_hidden_size, add_bias_linear)
            return LayerParams(tp_sharded=mlp, replicated=mlp_bias, expert=0)
        mlp, mlp_bias = self._one_mlp(h, self.ffn_hidden_size, add_bias_linear)
        expert = self.num_experts * (mlp + mlp_bias)
        replicated = h * self.num_experts + (self.num_experts if add_bias_linear else 0)
        sharded = 0
        if self.shared_ffn_hidden_size:
            shared, shared_bias = self._one_mlp(h, self.shared_ffn_hidden_size, add_bias_linear)
            sharded += shared
            replicated += shared_bias + (h if self.shared_expert_gate else 0)
        return LayerParams(tp_sharded=sharded, replicated=replicated, expert=expert)

    def forward_flops(self, hidden_size: int, micro_batch_size: int, seq_length: int) -> float:
        tokens = float(micro_batch_size * seq_length)
        gemms = 3 if self.swiglu else 2
        if not self.is_moe:
            return 2.0 * tokens * hidden_size * self.ffn_hidden_size * gemms
        expert = 2.0 * tokens * hidden_size * self.ffn_hidden_size * gemms
        router = 2.0 * tokens * hidden_size * self.num_experts
        flops = self.top_k * expert + router
        if self.shared_ffn_hidden_size:
            flops += 2.0 * tokens * hidden_size * self.shared_ffn_hidden_size * gemms
            if self.shared_expert_gate:
                flops += 2.0 * tokens * hidden_size
        return flops

    def signature(self) -> str:
        """Tokens a model signature ends with for this MLP (empty for a dense MLP)."""
        if not self.is_moe:
            return ""
        text = f"moe-e{self.num_experts}-k{self.top_k}-f{self.ffn_hidden_size}"
        if self.shared_ffn_hidden_size:
            text += f"-s{self.shared_ffn_hidden_size}" + ("g" if self.shared_expert_gate else "")
        return text


# --------------------------------------------------------------------------- layer kind


@dataclass(frozen=True)
class LayerKind:
    """One kind of decoder layer: pre-norm attention and MLP (Megatron's ``TransformerLayer``)."""
    name: str                      # "dense" or "moe"
    hidden_size: int
    attention: AttentionSpec
    mlp: MLPSpec
    normalization: str = "RMSNorm"
    add_bias_linear: bool = False

    @property
    def is_moe(self) -> bool:
        return self.mlp.is_moe

    def param_split(self) -> LayerParams:
        """Parameters of one layer of this kind (two norms, attention, MLP / experts);
        computed once per kind (the memory model asks for it per stage it prices)."""
        return _kind_param_split(self)

    def params(self) -> int:
        return self.param_split().total

    def active_params(self) -> int:
        """Parameters one token touches: the top-k routed experts of all of them."""
        split = self.param_split()
        if not self.is_moe:
            return split.total
        return split.tp_sharded + split.replicated \
            + split.expert // self.mlp.num_experts * self.mlp.top_k

    def attention_forward_flops(self, micro_batch_size: int, seq_length: int) -> float:
        return self.attention.forward_flops(self.hidden_size, micro_batch_size, seq_length)

    def mlp_forward_flops(self, micro_batch_size: int, seq_length: int) -> float:
        return self.mlp.forward_flops(self.hidden_size, micro_batch_size, seq_length)

    def forward_flops(self, micro_batch_size: int, seq_length: int) -> float:
        return (self.attention_forward_flops(micro_batch_size, seq_length)
                + self.mlp_forward_flops(micro_batch_size, seq_length))


# --------------------------------------------------------------------------- patterns


class PatternError(ValueError):
    """A layer-pattern expression that is not a list of 0/1 built from ``[..]``, ``+``, ``*``."""


def parse_layer_pattern(text: str, max_length: int = MAX_PATTERN_LAYERS) -> tuple[int, ...]:
    """A Megatron list expression (``"[0]*3+[1]*58"``, ``"([0]+[1]*3)*2"``, ``"[1,0,1]"``) as a
    tuple of ints, without ``eval``: integers, ``[a, b, ...]``, ``( )``, ``+`` and ``*`` (list by
    int either side); whitespace is ignored. ``PatternError`` on anything else, on a list longer
    than ``max_length`` (checked before it is built) or on a result that is not a list."""
    if len(text) > _MAX_PATTERN_CHARS:
        raise PatternError(f"an expression of at most {_MAX_PATTERN_CHARS} characters")
    split = re.search(r"[0-9]\s+[0-9]", text)
    if split:   # Python (Megatron eval()s the expression) reads "1 0" as no integer
        raise PatternError(f"unexpected white space inside {split.group()!r}")
    parser = _PatternParser("".join(text.split()), max_length)
    value = parser.expression()
    if parser.pos != len(parser.text):
        raise PatternError(f"unexpected {parser.text[parser.pos]!r} at character {parser.pos + 1}")
    if not isinstance(value, list):
        raise PatternError("a list expression, e.g. [0]*3+[1]*58")
    return tuple(value)


_DIGITS = "0123456789"


class _PatternParser:
    """Recursive descent over ``expr := term ('+' term)*``, ``term := atom ('*' atom)*``,
    ``atom := INT | '[' expr (',' expr)* ']' | '(' expr ')'``; values are ints or int lists."""

    _MAX_DEPTH = 32

    def __init__(self, text: str, max_length: int) -> None:
        self.text, self.pos, self.max_length, self.depth = text, 0, max_length, 0

    def _peek(self) -> str:
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def _expect(self, char: str) -> None:
        if self._peek() != char:
            got = repr(self._peek()) if self._peek() else "the end"
            raise PatternError(f"{char!r} at character {self.pos + 1}, found {got}")
        self.pos += 1

    def expression(self) -> int | list[int]:
        self.depth += 1
        if self.depth > self._MAX_DEPTH:
            raise PatternError(f"brackets nested at most {self._MAX_DEPTH} deep")
        value = self.term()
        while self._peek() == "+":
            self.pos += 1
            right = self.term()
            if isinstance(value, list) != isinstance(right, list):
                raise PatternError("'+' between two lists or two integers")
            if isinstance(value, list):
                self._check_length(len(value) + len(right))
                value = value + right            # type: ignore[operator]
            else:
                value = self._check_int(value + right)   # type: ignore[operator]
        self.depth -= 1
        return value

    def term(self) -> int | list[int]:
        value = self.atom()
        while self._peek() == "*":
            self.pos += 1
            right = self.atom()
            if isinstance(value, list) and isinstance(right, list):
                raise PatternError("'*' between a list and an integer")
            if isinstance(value, list) or isinstance(right, list):
                items, times = (value, right) if isinstance(value, list) else (right, value)
                times = max(0, times)            # type: ignore[arg-type]
                self._check_length(len(items) * times)  # type: ignore[arg-type]
                value = items * times            # type: ignore[operator]
            else:
                value = self._check_int(value * right)
        return value

    def atom(self) -> int | list[int]:
        char = self._peek()
        if char and char in _DIGITS:   # ASCII only: Python's literals (no '²', no '٣')
            start = self.pos
            while self._peek() and self._peek() in _DIGITS:
                self.pos += 1
            if self.pos - start > 9:
                raise PatternError(f"integers of at most 9 digits (character {start + 1})")
            digits = self.text[start:self.pos]
            if digits[0] == "0" and digits.strip("0"):   # Python refuses 08 (00 is 0)
                raise PatternError(f"an integer without leading zeros at character "
                                   f"{start + 1}, found {digits!r}")
            return int(digits)
        if char == "(":
            self.pos += 1
            value = self.expression()
            self._expect(")")
            return value
        if char == "[":
            self.pos += 1
            items: list[int] = []
            if self._peek() != "]":
                while True:
                    item = self.expression()
                    if isinstance(item, list):
                        raise PatternError("a flat list of integers (no nested lists)")
                    items.append(item)
                    self._check_length(len(items))
                    if self._peek() != ",":
                        break
                    self.pos += 1
            self._expect("]")
            return items
        got = repr(char) if char else "the end"
        raise PatternError(f"an integer, '[' or '(' at character {self.pos + 1}, found {got}")

    def _check_length(self, length: int) -> None:
        if length > self.max_length:
            raise PatternError(f"a list of at most {self.max_length} layers")

    @staticmethod
    def _check_int(value: int) -> int:
        if value > 10**9:
            raise PatternError("integers of at most 10^9")
        return value


def moe_layer_pattern(num_layers: int, moe_layer_freq: int | tuple[int, ...],
                      first_k_dense_replace: int = 0) -> tuple[int, ...]:
    """1 (MoE) or 0 (dense) per layer: Megatron's rule for ``--moe-layer-freq`` (int N: layer i
    is MoE when ``i % N == 0``; a tuple: as given), then MindSpeed-LLM's ``--first-k-dense-replace``
    (the first k layers dense). The caller has validated the values."""
    if isinstance(moe_layer_freq, int):
        base = [1 if i % moe_layer_freq == 0 else 0 for i in range(num_layers)]
    else:
        base = list(moe_layer_freq)
    return tuple(0 if i < first_k_dense_replace else int(bool(v)) for i, v in enumerate(base))


def runs(values: tuple[int, ...]) -> list[tuple[int, int]]:
    """Run-length encoding: ``[(value, count), ...]``."""
    out: list[tuple[int, int]] = []
    for v in values:
        if out and out[-1][0] == v:
            out[-1] = (v, out[-1][1] + 1)
        else:
            out.append((v, 1))
    return out


def pattern_expression(values: tuple[int, ...]) -> str:
    """The shortest run form of a pattern as a Megatron list expression: ``[0]*3+[1]*58``."""
    return "+".join(f"[{v}]*{n}" if n > 1 else f"[{v}]" for v, n in runs(values))


__all__ = ["ATTENTION_KINDS", "AttentionSpec", "LayerKind", "LayerParams", "MLPSpec",
           "PatternError", "ZERO_PARAMS", "moe_layer_pattern", "norm_params",
           "parse_layer_pattern", "pattern_expression", "runs"]


@functools.lru_cache(maxsize=256)
def _kind_param_split(kind: LayerKind) -> LayerParams:
    norms = LayerParams(0, 2 * norm_params(kind.hidden_size, kind.normalization), 0)
    return (kind.attention.param_split(kind.hidden_size, kind.normalization,
                                       kind.add_bias_linear)
            + kind.mlp.param_split(kind.hidden_size, kind.add_bias_linear) + norms)
