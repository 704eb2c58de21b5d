"""Per-rank layer profiler: the user's own transformer layer, built by megatron-core from the user's
own arguments, timed forward and backward for each candidate TP degree and micro-batch size.

* Arguments: ``parse_args(ignore_unknown_args=True)`` on the current argv; the *live* namespace is
  never validated. A deep copy, set to (TP=t, PP=1, MBS=b) and stripped of layer-split flags, is
  validated and turned into the model's config exactly as the training script will do it
  (``gpt_config_from_args`` + Megatron's default layer spec on >= core 0.18; the core transformer
  config + local/TE spec on older versions).
* TP: a real tensor-parallel group of ``t`` consecutive launch ranks (inside one node) via
  ``parallel_state.initialize_model_parallel(t)`` on the default group (NCCL / HCCL on a GPU /
  NPU, gloo on the CPU: :mod:`.group_profile`); destroyed afterwards.
* Timing (:mod:`.sampling`): warm-up, then forward + backward repeated until both medians' 95%
  confidence intervals are within 2% (at least N = --poseidon-profile-iters repetitions, at most
  40 or 5 s), outliers dropped by a MAD rule; measured once more when the backward median is
  below 0.8 x the forward's. The backward includes what Megatron's DDP adds to every parameter's
  gradient (``main_grad += grad``, fp32 buffers). On a GPU / NPU a sample is 4 micro-batches
  run back to back after an untimed lead one, timed with device events between the phases
  (:func:`_back_to_back_step`): synchronising around each phase made an H200 read 9 % slow.
  There, before a configuration is timed, untimed samples run until two consecutive ones agree
  within 5 % (:func:`settle_device`: at most 40 samples or 10 s for the process's first
  configuration, 10 or 2 s after), and the first configuration of the first TP degree is
  measured once more after the others, its later reading kept (:func:`measurement_order`,
  :func:`keep_later`): the first one timed on a cold device may carry one-time costs.
  Under CPU emulation the ranks of a host measure in turns (:class:`Turns`), so they
  never compete for its cores, and the emulated device's time is computed from the CPU time
  (:class:`EmulatedClock`: (share + factor - 1) x CPU time at TP 1) with the slowdown's sleep
  suspended: the sleep-then-wake padding made the slow type read 4.5-5x for a configured 4x on
  a loaded host (the work after a sleep runs on cold caches), and wall time took in other
  processes' load. ``share`` is how much the host's ranks slow each other's compute when they
  train together, measured first by running every rank's TP-1 layer at once
  (:mod:`.contention`). The ranks of a TP group stop sampling together (their layer is
  collective).
* Optimizer step: the layer's parameters through what Megatron's mixed-precision optimizer does
  per step (grad norm, clipping, AdamW on fp32 master copies, the copy back), per device
  (x ``share`` under emulation).
* Activation memory (:func:`layer_memory_bytes`, after the timing, on a warm layer): on GPU / NPU
  the allocator's ``memory_allocated`` after one forward minus before it (what a micro-batch keeps
  alive until its backward, the layer's output included); on CPU, emulated devices included (no
  allocator statistics), the bytes of the tensors autograd saves for backward (saved-tensor hooks;
  unique storages, parameters excluded). Under full recompute Megatron's block checkpoints each
  layer: a layer keeps only its input, and its backward re-runs the forward (added to the time).
  Parameter bytes: the layer's parameters on this rank in their own dtype.
* Layer kinds (:class:`ProfiledKind`): a model of several kinds (dense layers then MoE layers,
  DeepSeek-V3's stack) has each distinct kind profiled: the layer spec of one layer of that kind
  (the first of it) taken from Megatron's decoder block spec, built with its own layer number, so
  a launch's records hold one entry per (kind, device type, TP, micro-batch size)
  (``LayerTiming.kind``, ``Aggregate.kind``). A MoE layer is profiled as one expert-parallel rank
  runs it (``ProfiledKind.ep``; records carry the EP they were measured at, ``LayerTiming.ep``):
  at EP e its ``E / e`` local experts, fed the tokens balanced routing sends them -- the EP group's
  e x T tokens, top-k each, spread evenly over E experts, are T x k token-expert pairs per rank,
  exactly what this rank's own T tokens make routed top-k over its E / e local experts (built as
  a layer of E / e experts with no EP group, so a 256-expert layer is measurable on one device;
  where k > E / e, k local experts, since a router cannot pick more experts than it has: the same
  T x k pairs; the record's parameter bytes are then those of E / e experts, the extra ones'
  taken off). The all-to-all dispatch and
  combine are not in this time (the search prices them from the links); group-limited routing
  (``--moe-router-num-groups``) is off in the profiled layer at EP > 1. Routing: with megatron-core's
  ``moe_router_force_load_balancing`` (0.14 and later) set on the profiled layer's config, the
  router's logits are replaced by random ones, so the timed tokens are spread evenly over the
  experts (top-k of random scores) -- the balanced load a real job approaches under its
  auxiliary load-balancing loss, and not the skewed routing a freshly initialised router gives
  random inputs; on an older megatron-core without it, the router as built routes the random
  inputs (``ProfiledKind.routing`` and the run's log say which).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import io
import logging
import statistics
import sys
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Sequence

from poseidon_plugin.megatron import framework_state
from poseidon_plugin.megatron.profile.sampling import Sampled, SamplingPolicy, Settled, sample, settle

log = logging.getLogger("poseidon")

MIN_BWD_RATIO = 0.8   # a backward median below this x the forward's is measured again


@dataclass(frozen=True)
class LayerTiming:
    tp: int
    micro_batch_size: int
    forward_ms: float
    backward_ms: float
    activation_bytes: int
    param_bytes: int
    optimizer_ms: float = 0.0   # optimizer step of the layer's parameters (per device)
    samples: int = 0            # timed forward/backward repetitions kept
    converged: bool = True      # the medians' 95% CIs reached the target width
    retries: int = 0            # re-measurements (backward < 0.8 x forward)
    kind: str = ""              # the layer kind (``LayerKind.name``; "" where the model has one)
    ep: int = 1                 # the expert-parallel degree a MoE layer was profiled at


@dataclass(frozen=True)
class ProfiledKind:
    """One layer kind a rank profiles: ``name`` (``LayerKind.name``, the records' kind),
    ``layer_index`` (0-based: which layer of Megatron's decoder block spec is built, the first
    of this kind), ``moe`` (whether that layer must be a MoE layer: checked against the spec, so
    a model read differently from how Megatron builds it is an error, not a mislabelled record;
    None: not checked) and ``args`` (the Megatron arguments to build it from; None: the run's)."""

    name: str = ""
    layer_index: int = 0
    moe: bool | None = None
    args: Any = None
    ep: int = 1     # a MoE kind: profiled as one rank of this EP degree runs it

    @staticmethod
    def of_model(model: Any, eps: Sequence[int] = (1,)) -> tuple["ProfiledKind", ...]:
        """The kinds of ``model`` (``ModelSpec``), each at the first layer of it, a MoE kind
        once per EP degree of ``eps``; a uniform model's single kind is named "" (its records
        are keyed as before) and not checked (its one layer spec is what the script builds,
        whatever its MLP's class is called)."""
        kinds = model.layer_kinds
        eps = tuple(sorted(set(eps))) or (1,)
        if len(kinds) == 1:
            return tuple(ProfiledKind("", 0, None, ep=e)
                         for e in (eps if kinds[0].is_moe else (1,)))
        return tuple(ProfiledKind(k.name, model.layer_kind_of.index(i), k.is_moe, ep=e)
                     for i, k in enumerate(kinds) for e in (eps if k.is_moe else (1,)))


def local_experts(num_experts: int, top_k: int, ep: int) -> int:
    """The experts a layer profiled as one rank of EP ``ep`` is built with: ``num_experts /
    ep``, at least ``top_k`` (see the module docstring)."""
    return max(num_experts // max(1, ep), top_k)


def expert_rank_args(args: Any, ep: int) -> Any:
    """A copy of Megatron's ``args`` whose MoE layer is one rank of EP ``ep`` (its local
    experts, no EP group: ``expert_model_parallel_size`` 1); ``args`` itself at EP 1 without an
    EP flag to drop."""
    experts = int(getattr(args, "num_experts", None) or 0)
    if ep <= 1 and int(getattr(args, "expert_model_parallel_size", 1) or 1) == 1:
        return args
    a = copy.copy(args)
    a.expert_model_parallel_size = 1
    if experts and ep > 1:
        from poseidon_plugin.errors import PoseidonError

        if experts % ep:
            raise PoseidonError(f"EP {ep} does not divide the model's {experts} experts")
        a.num_experts = local_experts(experts, int(getattr(args, "moe_router_topk", 1) or 1), ep)
        for attr in ("moe_router_num_groups", "moe_router_group_topk"):
            if getattr(a, attr, None):
                setattr(a, attr, None)
    return a


FORCE_BALANCE_ATTR = "moe_router_force_load_balancing"


def balanced_routing(config: Any) -> bool:
    """Set the router's forced load balancing on a MoE layer's config where this megatron-core
    has it (see the module docstring); whether the timed tokens are routed evenly."""
    if not getattr(config, "num_moe_experts", None):
        return False
    if not hasattr(config, FORCE_BALANCE_ATTR):
        return False
    setattr(config, FORCE_BALANCE_ATTR, True)
    return True


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
    # the layer is timed on one device without a CP group, at a CP rank's seq / CP tokens (the
    # script's CP): a CP plan prices its layers from records at seq / CP (scaled from these
    # for another CP; ``costs.cp_layer_times`` adds the attention over the whole sequence and
    # the ring exchange)
    cp = int(getattr(a, "context_parallel_size", 1) or 1)
    if cp > 1 and int(a.seq_length) % cp == 0:
        a.seq_length = int(a.seq_length) // cp
    a.context_parallel_size = 1
    if hasattr(a, "hierarchical_context_parallel_sizes"):
        a.hierarchical_context_parallel_sizes = None
    a.yaml_cfg = None
    with contextlib.redirect_stdout(io.StringIO()):
        _unwrapped_validate_args()(a, {})
    return a


def layer_config_and_spec(vargs: Any, layer_index: int = 0,
                          moe: bool | None = None) -> tuple[Any, Any]:
    """(TransformerConfig, layer ModuleSpec) exactly as the training script would build them;
    of a block spec (MoE models) the spec of layer ``layer_index`` (0-based), which must be a MoE
    layer iff ``moe`` (when given)."""
    try:  # megatron-core >= 0.18: the config container path pretrain_gpt.py uses
        from megatron.training.argument_utils import gpt_config_from_args
        from megatron.training.models.gpt import default_layer_spec
    except ImportError:  # <= 0.17: core_transformer_config_from_args + gpt_builder's spec choice
        from megatron.training.arguments import core_transformer_config_from_args

        config = core_transformer_config_from_args(vargs)
        spec = (mindspeed_llm_layer_spec(vargs, layer_index) if mindspeed_llm_builds_blocks()
                else _layer_spec_le_017(vargs, config))
    else:
        cfg = gpt_config_from_args(vargs)
        spec = default_layer_spec(cfg, vp_stage=None)
        config = cfg.transformer
    layer_specs = getattr(getattr(spec, "submodules", None), "layer_specs", None) \
        if not hasattr(spec, "module") else None
    if layer_specs is None and hasattr(spec, "layer_specs"):
        layer_specs = spec.layer_specs
    if layer_specs:  # a block spec (MoE): the layer asked for
        if not 0 <= layer_index < len(layer_specs):
            from poseidon_plugin.errors import PoseidonError

            raise PoseidonError(f"the decoder block spec has {len(layer_specs)} layer(s): no "
                                f"layer {layer_index} to profile")
        spec = layer_specs[layer_index]
    if moe is not None and is_moe_spec(spec) != moe:
        from poseidon_plugin.errors import PoseidonError

        raise PoseidonError(
            f"layer {layer_index + 1} of the model as Megatron builds it is "
            f"{'a MoE' if is_moe_spec(spec) else 'a dense'} layer, but the planner reads it as "
            f"{'MoE' if moe else 'dense'} from the arguments (--moe-layer-freq / "
            "--first-k-dense-replace): the profile would be mislabelled")
    return config, spec


def mindspeed_llm_builds_blocks() -> bool:
    """Whether MindSpeed-LLM's own decoder block build is installed (its adaptor patches
    ``TransformerBlock._build_layers``): it then decides each layer's MLP itself."""
    try:
        from megatron.core.transformer.transformer_block import TransformerBlock
    except ImportError:
        return False
    build = getattr(TransformerBlock, "_build_layers", None)
    return str(getattr(build, "__module__", "")).startswith("mindspeed_llm")


def mindspeed_llm_moe_pattern(num_layers: int, num_experts: int | None,
                              first_k_dense_replace: int | None,
                              moe_layer_freq: Any) -> tuple[int, ...] | None:
    """1 (MoE) or 0 (dense) per layer as MindSpeed-LLM's block build (2.3.0, 26.1.0) makes them:
    its ``pretrain_gpt.py`` builds one layer spec for every layer (MoE with ``--num-experts``,
    whatever ``--moe-layer-freq`` says), and its ``_build_layers`` replaces a layer's MLP only
    with ``--first-k-dense-replace`` (and a ``--moe-layer-freq``): MoE iff ``i >= k`` and
    ``i % freq == 0``. None where it cannot build them (a list ``--moe-layer-freq`` with
    ``--first-k-dense-replace``: its ``%`` takes an integer)."""
    if not num_experts:
        return (0,) * num_layers
    if first_k_dense_replace and moe_layer_freq:
        if not isinstance(moe_layer_freq, int):
            return None
        return tuple(int(i >= first_k_dense_replace and i % moe_layer_freq == 0)
                     for i in range(num_layers))
    return (1,) * num_layers


def mindspeed_llm_layer_spec(vargs: Any, layer_index: int) -> Any:
    """Layer ``layer_index``'s (0-based, global) spec as MindSpeed-LLM builds it: the layer spec
    of its ``pretrain_gpt.py`` (megatron-core's TE or local GPT layer spec, with
    ``--num-experts`` and ``--moe-grouped-gemm``), the MLP replaced as its block build replaces
    it (:func:`mindspeed_llm_moe_pattern`, megatron-core's MLP spec function it calls)."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    use_te = getattr(vargs, "transformer_impl", "local") == "transformer_engine"
    maker = (specs.get_gpt_layer_with_transformer_engine_spec if use_te
             else specs.get_gpt_layer_local_spec)
    experts = getattr(vargs, "num_experts", None)
    grouped = getattr(vargs, "moe_grouped_gemm", False)
    if getattr(vargs, "spec", None):   # --spec MODULE NAME, as its pretrain_gpt.py imports it
        from megatron.core.transformer.spec_utils import import_module

        spec = copy.deepcopy(import_module(list(vargs.spec)))
    else:
        spec = copy.deepcopy(maker(experts, grouped))
    first_k = getattr(vargs, "first_k_dense_replace", None)
    freq = getattr(vargs, "moe_layer_freq", None)
    if experts and first_k and freq:
        pattern = mindspeed_llm_moe_pattern(int(vargs.num_layers), experts, first_k, freq)
        if pattern is None:
            from poseidon_plugin.errors import PoseidonError

            raise PoseidonError("MindSpeed-LLM's block build takes an integer --moe-layer-freq "
                                f"with --first-k-dense-replace, not {freq!r}")
        mlp = getattr(specs, "get_mlp_module_spec", None) or specs._get_mlp_module_spec
        spec.submodules.mlp = mlp(use_te=use_te, num_experts=experts if pattern[layer_index]
                                  else None, moe_grouped_gemm=grouped)
    return spec


def is_moe_spec(spec: Any) -> bool:
    """Whether a layer ``ModuleSpec``'s MLP is a MoE layer (Megatron's ``MoELayer`` or a
    subclass of a class of that name): the MLP entry is a ``ModuleSpec`` (its ``module``), a
    ``functools.partial`` of a class (core 0.19) or a bound class method
    (``MLP.as_mlp_submodule``)."""
    import functools

    obj = getattr(getattr(spec, "submodules", None), "mlp", None)
    for _ in range(8):   # unwrap spec / partial / bound method layers
        if isinstance(obj, functools.partial):
            obj = obj.func
        elif inspect.ismethod(obj):
            obj = obj.__self__
        elif not isinstance(obj, type) and hasattr(obj, "module"):
            obj = obj.module
        else:
            break
    if isinstance(obj, type):
        return any("MoE" in c.__name__ for c in obj.__mro__)
    return obj is not None and "MoE" in getattr(obj, "__qualname__", type(obj).__name__)


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

    from poseidon_plugin.errors import PoseidonError

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


def _layer_inputs(config: Any, vargs: Any, device: Any) -> tuple[Any, dict[str, Any], Any]:
    """(input, forward kwargs, output gradient) of one micro-batch of the profiled layer."""
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
    return x, kwargs, grad


def attach_main_grads(layer: Any) -> list[Any]:
    """fp32 ``main_grad`` buffers and the gradient hook Megatron's DDP gives every parameter
    (``main_grad += grad; grad = None``), so the timed backward does what training does (and a
    layer built with gradient-accumulation fusion finds its ``main_grad``). Returns the hooks."""
    import torch

    handles = []
    for p in layer.parameters():
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=p.device)

        def accumulate(param):
            # a fused weight-gradient kernel (TE, gradient-accumulation fusion) already added
            # into main_grad and says so; the gradient it leaves is a placeholder
            if param.grad is not None and not getattr(param, "grad_added_to_main_grad", False):
                param.main_grad.add_(param.grad)
            param.grad = None
            if hasattr(param, "grad_added_to_main_grad"):
                param.grad_added_to_main_grad = False

        if hasattr(p, "register_post_accumulate_grad_hook"):
            handles.append(p.register_post_accumulate_grad_hook(accumulate))
    return handles


def _activation_bytes(layer: Any, x: Any, kwargs: dict[str, Any], grad: Any) -> int:
    """Bytes autograd saves in one forward (an untimed pass: the hooks cost time)."""
    import torch

    counter = _SavedBytes({p.untyped_storage().data_ptr() for p in layer.parameters()})
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
        out = layer(hidden_states=x, **kwargs)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(grad)
    x.grad = None
    return counter.bytes


_WALL = time.perf_counter     # the profiler's clocks (tests inject fakes)
_CPU = time.process_time


@dataclass(frozen=True)
class EmulatedClock:
    """How a step is timed under CPU emulation: the slowdown's sleep is suspended and the
    emulated device's time is computed from this process's CPU time t_cpu and wall time t_wall,
    as :func:`.emulation.install_slowdown` makes training take it (compute, then a sleep of
    ``(factor - 1) x`` the compute's CPU time):

    * TP 1: ``(share + factor - 1) x t_cpu`` -- the compute itself (``share x t_cpu`` when the
      host's ranks run together) plus the padding; other processes' load while profiling does
      not enter;
    * TP > 1: ``share x t_wall + (factor - 1) x t_cpu`` -- waiting in the TP all-reduces is not
      compute and is not padded.

    ``share``: how much the ranks of the host slow each other's compute in training
    (:mod:`.contention`: measured by running every rank's layer at once; 1 = a free core). The
    ranks of a host are profiled in turns (one at a time, every core free) but train together;
    the padding is a sleep and needs no core, so only the compute part is scaled."""

    factor: float
    tp: int
    share: float = 1.0

    def ms(self, wall_s: float, cpu_s: float) -> float:
        cpu_s = max(0.0, min(cpu_s, wall_s)) if self.tp > 1 else max(0.0, cpu_s)
        if self.tp > 1:
            return (self.share * wall_s + (self.factor - 1.0) * cpu_s) * 1e3
        return (self.share + self.factor - 1.0) * cpu_s * 1e3


def host_share() -> float:
    """The fixed oversubscription rule: ranks on the host (``LOCAL_WORLD_SIZE``) x torch threads
    per rank over the cores this process may use, at least 1. An upper bound of the contention
    (every rank busy all the time); :mod:`.contention` measures the real one, and this rule is
    the fallback where it cannot (no TP-1 layer is profiled)."""
    import os

    import torch

    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return max(1.0, ranks * torch.get_num_threads() / max(1, cores))


def _timed_step(layer: Any, x: Any, kwargs: dict[str, Any], grad: Any, device: Any,
                clock: EmulatedClock | None = None) -> tuple[float, float]:
    """(forward ms, backward ms) of one micro-batch (``clock``: under CPU emulation)."""
    _sync(device)
    t0, c0 = _WALL(), _CPU()
    out = layer(hidden_states=x, **kwargs)
    out = out[0] if isinstance(out, tuple) else out
    _sync(device)
    t1, c1 = _WALL(), _CPU()
    out.backward(grad)
    _sync(device)
    t2, c2 = _WALL(), _CPU()
    x.grad = None
    if clock is None:
        return (t1 - t0) * 1e3, (t2 - t1) * 1e3
    return clock.ms(t1 - t0, c1 - c0), clock.ms(t2 - t1, c2 - c1)


BACK_TO_BACK = 4   # micro-batches per device-timed sample (after one untimed lead micro-batch)


def device_event_class(device: Any) -> Any:
    """The timing-event class of ``device`` (``torch.cuda.Event``, ``torch.npu.Event``); None on
    the CPU (emulated devices included)."""
    import torch

    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.Event
    if device.type == "npu":
        return getattr(getattr(torch, "npu", None), "Event", None)
    return None


def _back_to_back_step(layer: Any, x: Any, kwargs: dict[str, Any], grad: Any, device: Any,
                       event_class: Any, k: int = BACK_TO_BACK) -> tuple[float, float]:
    """(forward ms, backward ms) per micro-batch on a GPU / NPU, as training runs them: one
    untimed lead micro-batch, then ``k`` forward/backward pairs back to back with device events
    between the phases and one synchronisation at the end. Synchronising around every phase
    (as on the CPU) leaves the device idle while the host launches the phase's first kernels:
    on an H200 that read a llama3-8b layer (seq 2048) 9 % slower than back to back."""
    def run(events: list | None) -> None:
        if events is not None:
            events[0].record()
        out = layer(hidden_states=x, **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        if events is not None:
            events[1].record()
        out.backward(grad)
        if events is not None:
            events[2].record()
        x.grad = None

    _sync(device)
    run(None)
    marks = [[event_class(enable_timing=True) for _ in range(3)] for _ in range(k)]
    for events in marks:
        run(events)
    marks[-1][2].synchronize()
    fwd = sum(e[0].elapsed_time(e[1]) for e in marks) / k
    bwd = sum(e[1].elapsed_time(e[2]) for e in marks) / k
    return float(fwd), float(bwd)


def _emulated_clock(device: Any, tp: int, share: float = 1.0) -> EmulatedClock | None:
    """The clock of a CPU-emulated device (None on a real accelerator or plain CPU)."""
    factor = _emulation_factor(device)
    return None if factor is None else EmulatedClock(factor, tp, share)


def _emulation_factor(device: Any) -> float | None:
    """The emulated type's slowdown on a CPU device under emulation, else None."""
    from poseidon_plugin.megatron.emulate import emulation

    factor = emulation.slowdown_factor()
    return None if device.type != "cpu" else factor


def _padding_suspended(active: bool):
    from poseidon_plugin.megatron.emulate import emulation

    return emulation.padding_suspended() if active else contextlib.nullcontext()


def sampling_policy(iters: int) -> SamplingPolicy:
    """The profiler's sampling rule; ``iters`` (--poseidon-profile-iters) is the minimum count."""
    base = SamplingPolicy()
    return replace(base, min_reps=max(base.min_reps, iters), max_reps=max(base.max_reps, iters))


def sample_until_plausible(step: Callable[[], Sequence[float]], policy: SamplingPolicy,
                           min_bwd_ratio: float = MIN_BWD_RATIO, retries: int = 1,
                           clock: Callable[[], float] = time.monotonic,
                           agree: Callable[[bool], bool] | None = None) -> tuple[Sampled, int]:
    """:func:`.sampling.sample` of ``step`` (forward ms, backward ms), measured again (up to
    ``retries`` times) while the backward median is below ``min_bwd_ratio`` x the forward's.
    Returns (the last measurement, how many re-measurements it took). ``agree``: the ranks of a
    tensor-parallel group decide together (any rank's yes), so they run ``step`` equally often."""
    res = sample(step, policy, clock, agree)
    tries = 0
    while tries < retries:
        again = res.medians[1] < min_bwd_ratio * res.medians[0]
        if not (agree(again) if agree is not None else again):
            break
        tries += 1
        res = sample(step, policy, clock, agree)
    return res, tries


def tp_group_any(device: Any) -> Callable[[bool], bool] | None:
    """``any(flag over the tensor-parallel group)`` (None when the group is this rank alone)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    if parallel_state.get_tensor_model_parallel_world_size() <= 1:
        return None
    group = parallel_state.get_tensor_model_parallel_group()
    on = torch.device("cpu") if dist.get_backend(group) == "gloo" else device

    def any_rank(flag: bool) -> bool:
        t = torch.tensor([1.0 if flag else 0.0], device=on)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return bool(t.item() > 0.0)

    return any_rank


# The device warm-up before a GPU / NPU configuration is timed (:func:`settle_device`): untimed
# samples until two consecutive ones agree within SETTLE_BAND (forward and backward), bounded
# in count and time; the process's first configuration (cold clocks, lazily loaded kernels,
# the allocator's first growth) gets the longer bounds. Not on the CPU (emulation included):
# its fixed sampling warm-up stays.
SETTLE_BAND = 0.05
SETTLE_FIRST = (40, 10.0)     # (readings, seconds) at most: the first configuration
SETTLE_LATER = (10, 2.0)      # every later one
_settled_devices: set[str] = set()


def settle_device(step: Callable[[], Sequence[float]], device: Any,
                  agree: Callable[[bool], bool] | None = None,
                  clock: Callable[[], float] = time.monotonic) -> Settled:
    """:func:`.sampling.settle` of ``step`` (one device-timed sample) before a configuration's
    timing: :data:`SETTLE_FIRST` bounds for the first configuration this process times on
    ``device``, :data:`SETTLE_LATER` after."""
    key = str(device)
    first = key not in _settled_devices
    readings, seconds = SETTLE_FIRST if first else SETTLE_LATER
    res = settle(step, SETTLE_BAND, readings, seconds, clock, agree)
    _settled_devices.add(key)
    log.debug("device warm-up%s on %s: %d untimed sample(s), %s", " (first configuration)"
              if first else "", key, res.readings,
              "the last two within %.0f%%" % (100 * SETTLE_BAND) if res.agreed
              else "stopped by its bound")
    return res


def measurement_order(micro_batch_sizes: Sequence[int], kinds: Sequence[Any],
                      again: bool) -> list[tuple[int, Any, bool]]:
    """The (micro-batch size, kind, re-measure) steps of one TP degree, in order: every pair,
    then (``again``, more than one pair) the first pair once more, after the others -- its
    first reading may carry the device's one-time costs; the later one is kept
    (:func:`keep_later`)."""
    steps = [(int(m), k, False) for m in micro_batch_sizes for k in kinds]
    if again and len(steps) > 1:
        steps.append((steps[0][0], steps[0][1], True))
    return steps


def remeasure_first(device: Any) -> bool:
    """Whether the first configuration is measured again at the end: on a GPU / NPU (timed with
    device events), not on the CPU (emulated devices included)."""
    return _emulation_factor(device) is None and device_event_class(device) is not None


def keep_later(first: LayerTiming, again: LayerTiming) -> LayerTiming:
    """The first configuration's record from its re-measurement (timings and activation bytes
    of the later reading; kind, EP and parameter bytes as recorded first)."""
    log.info("re-measured the first configuration (tp=%d mbs=%d%s): forward %.3f -> %.3f ms, "
             "backward %.3f -> %.3f ms; the later kept", first.tp, first.micro_batch_size,
             f" {first.kind}" if first.kind else "", first.forward_ms, again.forward_ms,
             first.backward_ms, again.backward_ms)
    return replace(again, kind=first.kind, ep=first.ep, param_bytes=first.param_bytes)


def time_layer(layer: Any, config: Any, vargs: Any, device: Any, iters: int,
               warmup: int = 3, share: float = 1.0) -> tuple[Sampled, int, int]:
    """(forward/backward sampling result, re-measurements, activation bytes) of one micro-batch
    (see :mod:`.sampling`: warm-up, repetitions until the medians' 95% CIs are within 2%,
    outliers dropped; measured again when backward < 0.8 x forward)."""
    x, kwargs, grad = _layer_inputs(config, vargs, device)
    act_bytes = _activation_bytes(layer, x, kwargs, grad)
    policy = replace(sampling_policy(iters), warmup=warmup)
    clock = _emulated_clock(device, int(vargs.tensor_model_parallel_size), share)
    events = device_event_class(device) if clock is None else None
    if events is not None:
        def step() -> tuple[float, float]:
            return _back_to_back_step(layer, x, kwargs, grad, device, events)
    else:
        def step() -> tuple[float, float]:
            return _timed_step(layer, x, kwargs, grad, device, clock)
    agree = tp_group_any(device)
    if events is not None:
        settle_device(step, device, agree)
    with _padding_suspended(clock is not None):
        res, retries = sample_until_plausible(step, policy, agree=agree)
    return res, retries, act_bytes


def _megatron_adam():
    """The Adam class Megatron's optimizer uses here (TE / Apex FusedAdam, else torch AdamW)."""
    try:
        from megatron.core.optimizer import Adam  # type: ignore[attr-defined]

        return Adam
    except ImportError:
        import torch

        return torch.optim.AdamW


def megatron_step_functions() -> tuple[Any, Any] | None:
    """(``megatron.core.optimizer.clip_grads``, its ``_multi_tensor_copy_this_to_that``): the
    gradient norm, clipping and copy-back Megatron's mixed-precision optimizer runs, on the
    multi-tensor kernels it found (Transformer Engine's, Apex's, or its local fallbacks: without
    either, a ``.item()`` per tensor in the norm and a temporary per tensor in every scale and
    copy; on an H200 Megatron's step took 34.3 ms where the plain torch ops this replaced
    predicted 31.5). None on a megatron-core without them."""
    try:
        from megatron.core.optimizer import clip_grads
        from megatron.core.optimizer.optimizer import _multi_tensor_copy_this_to_that
    except ImportError:
        return None
    needed = ("multi_tensor_applier", "l2_norm_impl", "clip_grad_by_total_norm_fp32")
    if not all(hasattr(clip_grads, n) for n in needed):
        return None
    try:   # early versions copied in a plain loop, without the multi-tensor kernel
        if "overflow_buf" not in inspect.signature(_multi_tensor_copy_this_to_that).parameters:
            return None
    except (TypeError, ValueError):
        return None
    return clip_grads, _multi_tensor_copy_this_to_that


def time_optimizer_step(layer: Any, device: Any, iters: int) -> Sampled:
    """The optimizer step of this layer's parameters as Megatron's mixed-precision optimizer runs
    it: fp32 master copies, gradient norm of the fp32 main grads, clipping, AdamW, the bf16 copy
    back (one value: ms), through Megatron's own functions where it has them
    (:func:`megatron_step_functions`), else the same steps in plain torch. The grad-norm
    all-reduce is communication, not timed here."""
    import torch

    params = [p for p in layer.parameters() if p.requires_grad]
    master = [p.detach().float().clone().requires_grad_(True) for p in params]
    for m in master:
        m.grad = torch.randn_like(m) * 1e-3
    opt = _megatron_adam()(master, lr=1e-4, weight_decay=0.01)
    megatron = megatron_step_functions()

    def step() -> tuple[float]:
        _sync(device)
        t0 = time.perf_counter()
        if megatron is not None:
            _megatron_step(megatron, params, master, opt, device)
        else:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(m.grad)
                                                         for m in master]))
            scale = torch.clamp(1.0 / (norm + 1e-6), max=1.0)
            for m in master:
                m.grad.mul_(scale)
            opt.step()
            with torch.no_grad():
                for p, m in zip(params, master):
                    p.copy_(m)
        _sync(device)
        return ((time.perf_counter() - t0) * 1e3,)

    return sample(step, sampling_policy(iters))


def _megatron_step(megatron: tuple[Any, Any], params: list, master: list, opt: Any,
                   device: Any) -> None:
    """One step as Megatron's ``clip_grad_norm`` + ``step`` + ``_copy_main_params_to_model_params``
    make it (``get_grad_norm_fp32`` without its all-reduce: one rank's share)."""
    import torch

    clip_grads, copy_this_to_that = megatron
    grads = [m.grad for m in master]
    dummy = torch.zeros(1, dtype=torch.int, device=device)
    norm, _ = clip_grads.multi_tensor_applier(clip_grads.l2_norm_impl, dummy, [grads], False)
    total = norm ** 2.0
    if getattr(clip_grads, "multi_tensor_scale_tensor_impl", None) is not None:
        total = total.pow(0.5)
    else:
        total = float(total.item()) ** 0.5
    clip_grads.clip_grad_by_total_norm_fp32(master, 1.0, total)
    opt.step()
    copy_this_to_that(this=[m.data for m in master], that=[p.data for p in params],
                      overflow_buf=dummy)


@dataclass(frozen=True)
class Turns:
    """Ranks that share a host's CPU cores profile in turns (CPU emulation): turn ``i`` is the TP
    group of local ranks ``[i*tp, (i+1)*tp)``; every other rank waits at a barrier meanwhile, so no
    two measurements compete for the cores (nor does the emulation's padding feed on the
    contention). ``local_world_size`` ranks per host; hosts take their turns in parallel."""

    local_rank: int
    local_world_size: int

    def of(self, tp: int) -> tuple[int, int]:
        """(this rank's turn, number of turns) for TP degree ``tp``."""
        return self.local_rank // tp, max(1, self.local_world_size // tp)


def _in_turns(turns: Turns | None, tp: int, name: str, checkpoint: Any,
              body: Callable[[], Any]) -> Any:
    """``body()`` on this rank's turn (every rank passes every turn's barrier), or at once."""
    if turns is None or checkpoint is None:
        return body()
    mine, count = turns.of(tp)
    result = None
    for i in range(count):
        checkpoint(f"{name}-turn{i}")
        if i == mine:
            result = body()
    checkpoint(f"{name}-turns-done")
    return result


def profile_config(layer: Any, config: Any, vargs: Any, device: Any, iters: int, tp: int,
                   mbs: int, share: float = 1.0) -> LayerTiming:
    """Forward, backward and optimizer step of one built layer (this rank's measurement).
    ``share``: the host's measured contention under CPU emulation (:class:`EmulatedClock`; the
    optimizer step, plain compute, is scaled by it too)."""
    hooks = attach_main_grads(layer)
    param_bytes = sum(p.numel() * p.element_size() for p in layer.parameters())
    res, retries, _ = time_layer(layer, config, vargs, device, iters, share=share)
    opt = time_optimizer_step(layer, device, iters)
    opt_share = share if _emulation_factor(device) is not None else 1.0
    for h in hooks:
        h.remove()
    act = layer_memory_bytes(layer, config, vargs, device)
    if res.medians[1] < MIN_BWD_RATIO * res.medians[0]:
        log.debug("tp=%d mbs=%d: backward %.3f ms < %.1f x forward %.3f ms after %d "
                  "re-measurement(s); kept", tp, mbs, res.medians[1], MIN_BWD_RATIO,
                  res.medians[0], retries)
    f_ms, b_ms = res.medians[0], res.medians[1]
    if getattr(vargs, "recompute_granularity", None) == "full":
        b_ms += f_ms   # the block re-runs the layer's forward before its backward
    return LayerTiming(tp, mbs, f_ms, b_ms, act, int(param_bytes),
                       optimizer_ms=opt.medians[0] * opt_share, samples=res.samples,
                       converged=res.converged and opt.converged, retries=retries)


def _allocated(device: Any):
    """The allocator's live-bytes counter of ``device`` (None on CPU: no allocator statistics)."""
    import torch

    if device.type == "cuda" and torch.cuda.is_available():
        return lambda: int(torch.cuda.memory_allocated(device))
    if device.type == "npu":
        return lambda: int(torch.npu.memory_allocated(device))  # type: ignore[attr-defined]
    return None


def layer_memory_bytes(layer: Any, config: Any, vargs: Any, device: Any) -> int:
    """Bytes one micro-batch keeps for backward (see the module docstring): the allocator's delta
    across one forward on GPU / NPU, the saved tensors' bytes on CPU; the input alone under full
    recompute."""
    import torch

    x, kwargs, grad = _layer_inputs(config, vargs, device)
    if getattr(vargs, "recompute_granularity", None) == "full":
        return int(x.numel() * x.element_size())
    counter = _SavedBytes({p.untyped_storage().data_ptr() for p in layer.parameters()})
    probe = _allocated(device)
    _sync(device)
    before = probe() if probe else 0
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
        out = layer(hidden_states=x, **kwargs)
    out = out[0] if isinstance(out, tuple) else out
    _sync(device)
    kept = probe() - before if probe else counter.bytes
    out.backward(grad)
    for p in layer.parameters():
        p.grad = None
        if hasattr(p, "main_grad"):
            p.main_grad = None
    return max(int(kept), 0)


def profile_rank(args: Any, tps: Sequence[int], micro_batch_sizes: Sequence[int], *, world_size: int,
                 rank: int, device: Any, iters: int, seed: int = 1234,
                 checkpoint: Any = None, turns: Turns | None = None,
                 contention: Callable[[Callable[[], tuple[float, float]], float], float]
                 | None = None,
                 kinds: Sequence[ProfiledKind] | None = None,
                 progress: Callable[[int, int, str], None] | None = None) -> list[LayerTiming]:
    """Profile one decoder layer of each kind for every (tp, mbs) on this rank. Collective per
    TP degree. ``progress(done, total, what)`` is called before each configuration.

    ``kinds``: the layer kinds to profile (:class:`ProfiledKind`; default: the block's first
    layer, kind ""), each built from the block spec's layer of that kind, in this order for
    every (tp, mbs); a MoE kind routes its tokens evenly where megatron-core can
    (:func:`balanced_routing`).

    ``checkpoint(name)`` (a deadline barrier) is called before each collective step, so a rank that
    hangs is named by the others instead of surfacing as an anonymous collective timeout.
    ``turns``: the ranks of a host measure one TP group at a time (see :class:`Turns`).
    ``contention(step, alone_s)`` (CPU emulation; collective: every rank calls it once): given
    this rank's timed forward + backward of a TP-1 layer and its mean wall time alone on the
    host (measured here, in ``turns``), runs :func:`.contention.measure_contention` with the
    others and returns this host's share, the ``share`` of every emulated time measured here
    (:class:`EmulatedClock`). Without a TP-1 candidate the fixed rule :func:`host_share`.

    Whatever the profiled layers leave on the framework's modules and classes (megatron-core's
    aux-loss scale and MoE metrics tracker, the RNG tracker, ...) is put back as it was before
    (:func:`.framework_state.untouched`): the training starts as a fresh process would.
    """
    with framework_state.untouched("profiling"):
        return _profile_rank(args, tps, micro_batch_sizes, world_size=world_size, rank=rank,
                             device=device, iters=iters, seed=seed, checkpoint=checkpoint,
                             turns=turns, contention=contention, kinds=kinds,
                             progress=progress)


@contextlib.contextmanager
def _built_layer(args: Any, tp: int, mbs: int, kind: ProfiledKind | None = None, *,
                 world_size: int, rank: int, device: Any, routed: dict,
                 default_kind: ProfiledKind) -> Iterator[tuple[Any, Any, Any]]:
    """The (layer, config, validated args) of (tp, mbs) and ``kind``, with Megatron's global
    args and micro-batch calculator set to that configuration while the block runs (the
    framework's patched code reads them: :mod:`.framework_state`); whether a MoE kind's
    tokens could be routed evenly goes into ``routed``."""
    from megatron.core.transformer.spec_utils import build_module

    kind = default_kind if kind is None else kind
    vargs = profiling_args(expert_rank_args(kind.args if kind.args is not None else args,
                                            kind.ep), tp, mbs, world_size, rank)
    with framework_state.profiling(vargs, max(1, world_size // tp)):
        config, spec = layer_config_and_spec(vargs, kind.layer_index, kind.moe)
        if is_moe_spec(spec):
            source = kind.args if kind.args is not None else args
            routed[(kind.name, kind.ep, int(config.num_moe_experts),
                    int(getattr(source, "num_experts", 0) or config.num_moe_experts),
                    int(config.moe_router_topk))] = balanced_routing(config)
        layer = build_module(spec, config=config, layer_number=kind.layer_index + 1)
        layer = layer.to(device=device, dtype=config.params_dtype)
        layer.train()
        yield layer, config, vargs


def _profile_rank(args: Any, tps: Sequence[int], micro_batch_sizes: Sequence[int], *,
                  world_size: int, rank: int, device: Any, iters: int, seed: int,
                  checkpoint: Any, turns: Turns | None, contention: Any,
                  kinds: Sequence[ProfiledKind] | None,
                  progress: Callable[[int, int, str], None] | None) -> list[LayerTiming]:
    """:func:`profile_rank`'s work (the framework's module data put back by it)."""
    import torch
    from megatron.core import parallel_state, tensor_parallel

    kinds = tuple(kinds) if kinds else (ProfiledKind(),)
    routed: dict[str, bool] = {}
    built = functools.partial(_built_layer, args, world_size=world_size, rank=rank, device=device,
                              routed=routed, default_kind=kinds[0])

    share = 1.0
    if contention is not None and _emulation_factor(device) is not None:
        share = _host_contention(built, contention, tps, micro_batch_sizes, seed, checkpoint,
                                 turns)
    out: list[LayerTiming] = []
    steps = {tp: measurement_order(micro_batch_sizes, kinds, tp == tps[0] and remeasure_first(device))
             for tp in tps}
    done, total = 0, sum(len(v) for v in steps.values())
    for tp in tps:
        if checkpoint is not None:
            checkpoint(f"profiling-tp{tp}")
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        try:
            tensor_parallel.model_parallel_cuda_manual_seed(seed)
            first_of_tp = len(out)
            for mbs, kind, again in steps[tp]:
                step = (f"profiling-tp{tp}-mbs{mbs}" + (f"-{kind.name}" if kind.name else "")
                        + (f"-ep{kind.ep}" if kind.ep > 1 else "") + ("-again" if again else ""))
                if progress is not None:
                    progress(done, total, _step_text(tp, mbs, kind, again))
                done += 1
                if checkpoint is not None and tp > 1:
                    checkpoint(step)
                with built(tp, mbs, kind) as (layer, config, vargs):
                    timing = _in_turns(turns, tp, step, checkpoint,
                                       lambda lay=layer, c=config, va=vargs, m=mbs: profile_config(
                                           lay, c, va, device, iters, tp, m, share))
                    timing = replace(timing, kind=kind.name, ep=kind.ep,
                                     param_bytes=_ep_rank_param_bytes(
                                         layer, timing.param_bytes, args, kind))
                    if again:
                        out[first_of_tp] = keep_later(out[first_of_tp], timing)
                    else:
                        out.append(timing)
                    del layer
        finally:
            tensor_parallel.get_cuda_rng_tracker().reset()
            framework_state.clear_model_parallel_leftovers()
            if device.type == "cuda" and torch.cuda.is_available():
                torch.cuda.empty_cache()
    for (name, ep, local, experts, top_k), balanced in sorted(routed.items()):
        if rank == 0:
            rank_of = ("every expert (EP 1)" if ep <= 1 else
                       f"as one rank of EP {ep} runs it: {local} local expert(s) of {experts}, "
                       f"top-{top_k} of this rank's tokens over them (balanced routing's "
                       "share; all-to-all not timed)")
            log.info("profiled MoE layer%s: %s, tokens routed %s",
                     f" ({name})" if name else "", rank_of,
                     "evenly (the router's forced load balancing: random logits)" if balanced
                     else "by the router as built on random inputs (this megatron-core has no "
                     "forced load balancing)")
    return out


def _step_text(tp: int, mbs: int, kind: ProfiledKind, again: bool) -> str:
    """One configuration in words: ``tp 1, micro-batch 2, moe layer, EP 4 (again)``."""
    return (f"tp {tp}, micro-batch {mbs}" + (f", {kind.name} layer" if kind.name else "")
            + (f", EP {kind.ep}" if kind.ep > 1 else "")
            + (" (the first one again: its first reading carries one-time costs)" if again
               else ""))


def _ep_rank_param_bytes(layer: Any, param_bytes: int, args: Any, kind: ProfiledKind) -> int:
    """The parameter bytes of one EP rank's MoE layer: those of the built layer, less the
    experts built beyond E / EP (where top-k exceeds E / EP, :func:`local_experts` builds k),
    so the record holds what a rank of that EP keeps (E / EP experts)."""
    if kind.ep <= 1:
        return param_bytes
    source = kind.args if kind.args is not None else args
    experts = int(getattr(source, "num_experts", 0) or 0)
    mlp = getattr(layer, "mlp", None)
    module = getattr(mlp, "experts", None)
    built = int(getattr(mlp, "num_local_experts", 0) or 0)
    want = experts // kind.ep
    if module is None or not built or built <= want:
        return param_bytes
    expert_bytes = sum(p.numel() * p.element_size() for p in module.parameters()) / built
    return int(round(param_bytes - (built - want) * expert_bytes))


def _host_contention(built: Callable[[int, int], Any],
                     contention: Callable[[Callable[[], tuple[float, float]], float], float],
                     tps: Sequence[int], micro_batch_sizes: Sequence[int], seed: int,
                     checkpoint: Any, turns: Turns | None) -> float:
    """The host's share: a TP-1 layer of the first micro-batch size timed alone (the host's
    ranks in ``turns``), then ``contention`` (every rank at once); padding suspended (the probe
    sleeps the padding itself). The fixed rule :func:`host_share` when TP 1 is not a
    candidate."""
    from megatron.core import parallel_state, tensor_parallel

    if 1 not in tps:
        return host_share()
    if checkpoint is not None:
        checkpoint("contention")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        with built(1, micro_batch_sizes[0]) as (layer, config, vargs):
            return _contention_share(layer, config, vargs, contention, checkpoint, turns)
    finally:
        tensor_parallel.get_cuda_rng_tracker().reset()
        framework_state.clear_model_parallel_leftovers()


def _contention_share(layer: Any, config: Any, vargs: Any,
                      contention: Callable[[Callable[[], tuple[float, float]], float], float],
                      checkpoint: Any, turns: Turns | None) -> float:
    """:func:`_host_contention` on a built TP-1 layer."""
    import torch

    from poseidon_plugin.megatron.emulate.contention import measure_alone, timed_compute

    hooks = attach_main_grads(layer)
    x, kwargs, grad = _layer_inputs(config, vargs, torch.device("cpu"))

    def run() -> None:
        out = layer(hidden_states=x, **kwargs)
        (out[0] if isinstance(out, tuple) else out).backward(grad)
        x.grad = None

    def step() -> tuple[float, float]:
        return timed_compute(run, _WALL, _CPU)

    with _padding_suspended(True):
        alone = _in_turns(turns, 1, "contention-alone", checkpoint, lambda: measure_alone(step))
        share = contention(step, alone)
    for h in hooks:
        h.remove()
    return share


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
    optimizer_ms: float = 0.0
    unconverged: int = 0   # ranks whose medians did not reach the target CI width
    kind: str = ""         # the layer kind (``LayerTiming.kind``)
    ep: int = 1            # the EP degree it was profiled at (``LayerTiming.ep``)


def aggregate(per_rank: dict[int, list[LayerTiming]], type_of: dict[int, str],
              straggler_factor: float = 1.5) -> tuple[list[Aggregate], list[str]]:
    """Median per (device type, layer kind, EP, TP, micro-batch size); names ranks much slower
    than their type's median for that kind (stragglers)."""
    groups: dict[tuple[str, str, int, int, int], list[tuple[int, LayerTiming]]] = {}
    for rank in sorted(per_rank):
        for t in per_rank[rank]:
            groups.setdefault((type_of[rank], t.kind, t.ep, t.tp, t.micro_batch_size),
                              []).append((rank, t))
    aggs: list[Aggregate] = []
    stragglers: list[str] = []
    for (dtype, kind, ep, tp, mbs), items in sorted(groups.items()):
        fwd = statistics.median(t.forward_ms for _, t in items)
        bwd = statistics.median(t.backward_ms for _, t in items)
        aggs.append(Aggregate(dtype, tp, mbs, fwd, bwd, max(t.activation_bytes for _, t in items),
                              max(t.param_bytes for _, t in items), len(items),
                              statistics.median(t.optimizer_ms for _, t in items),
                              sum(not t.converged for _, t in items), kind, ep))
        if len(items) >= 2:
            for rank, t in items:
                total, med = t.forward_ms + t.backward_ms, fwd + bwd
                if total > straggler_factor * med:
                    what = (f"{kind} layer, " if kind else "") + (f"ep={ep}, " if ep > 1 else "")
                    stragglers.append(f"rank {rank} ({dtype}, {what}tp={tp}, mbs={mbs}): "
                                      f"{total:.2f} ms "
                                      f"per layer vs the type's median {med:.2f} ms "
                                      f"({total / med:.1f}x)")
    return aggs, stragglers
