"""Model specification: presets, YAML and Megatron-args construction; parameter and FLOP counts.

INTERFACE STUB — the contract other modules code against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int          # = heads without GQA
    vocab_size: int
    seq_length: int                # default sequence length (a plan may override)
    num_experts: int = 0           # 0 -> dense MLP
    moe_top_k: int = 0
    swiglu: bool = True
    untie_embeddings: bool = True  # LLaMA: separate output layer
    normalization: str = "RMSNorm"  # or "LayerNorm"
    kv_channels: int | None = None  # default hidden / heads

    # --- parameter counts (whole, unsharded) ---
    def layer_params(self) -> int: ...          # one decoder layer (attention + MLP/experts + norms)
    def embedding_params(self) -> int: ...      # word embeddings (h * V)
    def output_params(self) -> int: ...         # output layer + final norm (0 for the layer if tied)
    def total_params(self) -> int: ...
    # --- FLOPs, forward, one micro-batch of b sequences of length s (multiply-add = 2 FLOPs) ---
    def layer_forward_flops(self, micro_batch_size: int, seq_length: int) -> float: ...
    def output_forward_flops(self, micro_batch_size: int, seq_length: int) -> float: ...
    def model_flops_per_iteration(self, global_batch_size: int, seq_length: int) -> float:
        """Forward + backward (3x forward) FLOPs of one iteration, no recompute (for MFU)."""
        ...


PRESETS: dict[str, ModelSpec] = {}  # llama3-8b, llama2-13b, llama-30b, mixtral-8x7b, llama3-70b


def get_model(name_or_path: str) -> ModelSpec:
    """A preset name or a YAML file path; SpecError on unknown name / bad file."""
    ...


def model_from_megatron_args(args: Any) -> ModelSpec: ...
