"""Per-rank layer profiler: the user's own transformer layer, built by megatron-core from the user's
own arguments, timed forward and backward for each candidate TP degree and micro-batch size.

* Arguments: ``parse_args(ignore_unknown_args=True)`` on the current argv; the *live* namespace is
  never validated. A deep copy, set to (TP=t, PP=1, MBS=b) and stripped of layer-split flags, is
  validated and turned into the model's config exactly as the training script will do it
  (``gpt_config_from_args`` + Megatron's default layer spec on >= core 0.18; the core transformer
  config + local/TE spec on older versions).
* TP: a real tensor-parallel group of ``t`` consecutive launch ranks (inside one node) via
  ``parallel_state.initialize_model_parallel(t)`` on the probe group; destroyed afterwards.
* Timing: warm-up, then the median of N forward and N backward passes; device synchronisation on
  GPU/NPU, wall clock on CPU (the emulation pads these with its slowdown).
* Activation memory: bytes of the tensors autograd saves for backward (saved-tensor hooks; unique
  storages, parameters excluded): what a micro-batch keeps alive until its backward, measured the
  same way on GPU, NPU and CPU (transient workspaces are not counted).
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Sequence

log = logging.getLogger("poseidon")


@dataclass(frozen=True)
class LayerTiming:
    tp: int
    micro_batch_size: int
    forward_ms: float
    backward_ms: float
    activation_bytes: int
    param_bytes: int


# ----------------------------------------------------------------------------------------------
# arguments
# ----------------------------------------------------------------------------------------------


def parse_megatron_args(script: str, argv: Sequence[str]) -> Any:
    """Megatron's own parser on ``[script] + argv``, unknown flags ignored, nothing validated."""
    from megatron.training.arguments import parse_args

    saved = sys.argv
    sys.argv = [script, *argv]
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            return parse_args(ignore_unknown_args=True)
    finally:
        sys.argv = saved


def _unwrapped_validate_args():
    """Megatron's validate_args, without MindSpeed's feature wrappers when they are installed."""
    import megatron.training.arguments as margs

    fn = margs.validate_args
    try:  # MindSpeed keeps the original under its patch manager
        from mindspeed.patch_utils import MindSpeedPatchesManager  # type: ignore

        info = MindSpeedPatchesManager.patches_info.get("megatron.training.arguments.validate_args")
        if info is not None and getattr(info, "orig_func", None) is not None:
            fn = info.orig_func
    except Exception:  # noqa: BLE001 - MindSpeed absent or a different version
        pass
    return fn


_SPLIT_ATTRS = ("pipeline_model_parallel_layout", "decoder_first_pipeline_num_layers",
                "decoder_last_pipeline_num_layers", "num_layers_per_virtual_pipeline_stage",
                "num_virtual_stages_per_pipeline_rank", "virtual_pipeline_model_parallel_size",
                "num_layer_list")


def profiling_args(args: Any, tp: int, micro_batch_size: int, world_size: int, rank: int) -> Any:
    """A validated deep copy of ``args`` for a one-stage, TP=tp, MBS=micro_batch_size layer."""
    a = copy.deepcopy(args)
    a.tensor_model_parallel_size = tp
    a.pipeline_model_parallel_size = 1
    for attr in _SPLIT_ATTRS:
        if hasattr(a, attr):
            setattr(a, attr, None)
    for attr in ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split",
                 "use_tp_pp_dp_mapping", "use_checkpoint_args"):
        if hasattr(a, attr):
            setattr(a, attr, False)
    a.micro_batch_size = micro_batch_size
    a.global_batch_size = micro_batch_size * max(1, world_size // tp)
    a.rampup_batch_size = None
    a.world_size = world_size
    a.rank = rank
    a.sequence_parallel = bool(getattr(a, "sequence_parallel", False)) and tp > 1
    a.yaml_cfg = None
    with contextlib.redirect_stdout(io.StringIO()):
        _unwrapped_validate_args()(a, {})
    return a


def layer_config_and_spec(vargs: Any) -> tuple[Any, Any]:
    """(TransformerConfig, layer ModuleSpec) exactly as the training script would build them."""
    try:  # megatron-core >= 0.18: the config container path pretrain_gpt.py uses
        from megatron.training.argument_utils import gpt_config_from_args
        from megatron.training.models.gpt import default_layer_spec
    except ImportError:  # <= 0.17: core_transformer_config_from_args + gpt_builder's spec choice
        from megatron.training.arguments import core_transformer_config_from_args

        config = core_transformer_config_from_args(vargs)
        spec = _layer_spec_le_017(vargs, config)
    else:
        cfg = gpt_config_from_args(vargs)
        spec = default_layer_spec(cfg, vp_stage=None)
        config = cfg.transformer
    layer_specs = getattr(getattr(spec, "submodules", None), "layer_specs", None) \
        if not hasattr(spec, "module") else None
    if layer_specs is None and hasattr(spec, "layer_specs"):
        layer_specs = spec.layer_specs
    if layer_specs:  # a block spec (MoE): profile its first layer
        spec = layer_specs[0]
    return config, spec


def _layer_spec_le_017(vargs: Any, config: Any) -> Any:
    """The decoder spec ``pretrain_gpt.py`` (core 0.12-0.14) / ``gpt_builders.gpt_builder``
    (0.15-0.17) picks: the MoE block spec with the normalization, else the TE or local layer spec
    with MoE, qk-layernorm, MLA, the normalization (local) -- each passed only where the
    installed megatron-core's function takes it."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    use_te = getattr(vargs, "transformer_impl", "local") == "transformer_engine"
    if getattr(vargs, "num_experts", None):
        return _call_with_known(specs.get_gpt_decoder_block_spec, config,
                                use_transformer_engine=use_te,
                                normalization=getattr(vargs, "normalization", None),
                                qk_l2_norm=getattr(vargs, "qk_l2_norm", False), vp_stage=None)
    maker = (specs.get_gpt_layer_with_transformer_engine_spec if use_te
             else specs.get_gpt_layer_local_spec)
    kwargs: dict[str, Any] = dict(
        num_experts=getattr(vargs, "num_experts", None),
        moe_grouped_gemm=getattr(vargs, "moe_grouped_gemm", False),
        qk_layernorm=getattr(vargs, "qk_layernorm", False),
        multi_latent_attention=getattr(vargs, "multi_latent_attention", False),
        moe_use_legacy_grouped_gemm=getattr(vargs, "moe_use_legacy_grouped_gemm", False),
        qk_l2_norm=getattr(vargs, "qk_l2_norm", False),
        use_kitchen=getattr(config, "use_kitchen", False))
    if not use_te:
        kwargs["normalization"] = getattr(vargs, "normalization", None)
    return _call_with_known(maker, **kwargs)


def _call_with_known(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` without the keywords this version of ``fn`` does not take; one
    that is set (truthy) but not taken means the layer would not be the user's: an error."""
    import inspect

    from ..errors import PoseidonError

    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return fn(*args, **kwargs)  # e.g. a MindSpeed wrapper: it forwards what it gets
    unknown = {k: v for k, v in kwargs.items() if k not in params}
    lost = sorted(k for k, v in unknown.items() if v)
    if lost:
        raise PoseidonError(f"this megatron-core's {fn.__name__} takes no {', '.join(lost)}: the "
                            "profiled layer would not be the one the script trains")
    return fn(*args, **{k: v for k, v in kwargs.items() if k in params})


# ----------------------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------------------


class _SavedBytes:
    """Counts bytes autograd saves for backward (unique storages, parameters excluded)."""

    def __init__(self, exclude_ptrs: set[int]) -> None:
        self.exclude = exclude_ptrs
        self.seen: set[int] = set()
        self.bytes = 0

    def pack(self, t):
        try:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in self.exclude and ptr not in self.seen:
                self.seen.add(ptr)
                self.bytes += storage.nbytes()
        except Exception:  # noqa: BLE001 - e.g. sparse / meta tensors: ignore
            pass
        return t

    @staticmethod
    def unpack(t):
        return t


def _sync(device) -> None:
    import torch

    if device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.synchronize()
    elif device.type == "npu":
        torch.npu.synchronize()  # type: ignore[attr-defined]


def time_layer(layer: Any, config: Any, vargs: Any, device: Any, iters: int,
               warmup: int = 2) -> tuple[float, float, int]:
    """(forward_ms, backward_ms, activation_bytes) of one micro-batch, medians over ``iters``."""
    import torch

    seq = int(vargs.seq_length)
    mbs = int(vargs.micro_batch_size)
    tp = int(vargs.tensor_model_parallel_size)
    seq_local = seq // tp if config.sequence_parallel else seq
    dtype = config.params_dtype
    x = torch.randn(seq_local, mbs, config.hidden_size, dtype=dtype, device=device, requires_grad=True)
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=device), diagonal=1)[None, None]
    kwargs: dict[str, Any] = {"attention_mask": mask}
    if getattr(vargs, "position_embedding_type", "") == "rope" and \
            not getattr(config, "multi_latent_attention", False):  # MLA applies its own rotary
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

        rope = RotaryEmbedding(kv_channels=config.kv_channels, rotary_percent=vargs.rotary_percent,
                               rotary_interleaved=getattr(vargs, "rotary_interleaved", False),
                               rotary_base=getattr(vargs, "rotary_base", 10000),
                               use_cpu_initialization=True)
        kwargs["rotary_pos_emb"] = rope(seq).to(device)
    grad = torch.randn(seq_local, mbs, config.hidden_size, dtype=dtype, device=device)
    exclude = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    fwd: list[float] = []
    bwd: list[float] = []
    act_bytes = 0
    for i in range(warmup + iters):
        counter = _SavedBytes(exclude)
        _sync(device)
        t0 = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
            out = layer(hidden_states=x, **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        _sync(device)
        t1 = time.perf_counter()
        out.backward(grad)
        _sync(device)
        t2 = time.perf_counter()
        x.grad = None
        for p in layer.parameters():
            p.grad = None
            if hasattr(p, "main_grad"):
                p.main_grad = None
        if i >= warmup:
            fwd.append((t1 - t0) * 1e3)
            bwd.append((t2 - t1) * 1e3)
            act_bytes = max(act_bytes, counter.bytes)
    return statistics.median(fwd), statistics.median(bwd), act_bytes


def profile_rank(args: Any, tps: Sequence[int], micro_batch_sizes: Sequence[int], *, world_size: int,
                 rank: int, device: Any, iters: int, seed: int = 1234,
                 checkpoint: Any = None) -> list[LayerTiming]:
    """Profile one decoder layer for every (tp, mbs) on this rank. Collective per TP degree.

    ``checkpoint(name)`` (a deadline barrier) is called before each collective step, so a rank that
    hangs is named by the others instead of surfacing as an anonymous collective timeout.
    """
    import torch
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.transformer.spec_utils import build_module

    out: list[LayerTiming] = []
    for tp in tps:
        if checkpoint is not None:
            checkpoint(f"profiling-tp{tp}")
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        try:
            tensor_parallel.model_parallel_cuda_manual_seed(seed)
            for mbs in micro_batch_sizes:
                if checkpoint is not None and tp > 1:
                    checkpoint(f"profiling-tp{tp}-mbs{mbs}")
                vargs = profiling_args(args, tp, mbs, world_size, rank)
                config, spec = layer_config_and_spec(vargs)
                layer = build_module(spec, config=config, layer_number=1)
                layer = layer.to(device=device, dtype=config.params_dtype)
                layer.train()
                param_bytes = sum(p.numel() for p in layer.parameters()) * 2  # bf16 bytes
                f_ms, b_ms, act = time_layer(layer, config, vargs, device, iters)
                out.append(LayerTiming(tp, mbs, f_ms, b_ms, act, int(param_bytes)))
                del layer
        finally:
            tensor_parallel.get_cuda_rng_tracker().reset()
            parallel_state.destroy_model_parallel()
            if device.type == "cuda" and torch.cuda.is_available():
                torch.cuda.empty_cache()
    return out


# ----------------------------------------------------------------------------------------------
# aggregation (rank 0)
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Aggregate:
    device_type: str
    tp: int
    micro_batch_size: int
    forward_ms: float
    backward_ms: float
    activation_bytes: int
    param_bytes: int
    ranks: int


def aggregate(per_rank: dict[int, list[LayerTiming]], type_of: dict[int, str],
              straggler_factor: float = 1.5) -> tuple[list[Aggregate], list[str]]:
    """Median per device type; names ranks much slower than their type's median (stragglers)."""
    groups: dict[tuple[str, int, int], list[tuple[int, LayerTiming]]] = {}
    for rank in sorted(per_rank):
        for t in per_rank[rank]:
            groups.setdefault((type_of[rank], t.tp, t.micro_batch_size), []).append((rank, t))
    aggs: list[Aggregate] = []
    stragglers: list[str] = []
    for (dtype, tp, mbs), items in sorted(groups.items()):
        fwd = statistics.median(t.forward_ms for _, t in items)
        bwd = statistics.median(t.backward_ms for _, t in items)
        aggs.append(Aggregate(dtype, tp, mbs, fwd, bwd, max(t.activation_bytes for _, t in items),
                              max(t.param_bytes for _, t in items), len(items)))
        if len(items) >= 2:
            for rank, t in items:
                total, med = t.forward_ms + t.backward_ms, fwd + bwd
                if total > straggler_factor * med:
                    stragglers.append(f"rank {rank} ({dtype}, tp={tp}, mbs={mbs}): {total:.2f} ms "
                                      f"per layer vs the type's median {med:.2f} ms "
                                      f"({total / med:.1f}x)")
    return aggs, stragglers
