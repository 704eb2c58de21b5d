"""megatron-core's own layers as the reference for the memory model (the worker side).

    python -m poseidon_plugin.fidelity.mcore_memory --tp T --ep E [--sp] [--layer I | --mtp]
        -- <megatron args...>

Runs ``T x E`` gloo ranks on the CPU (forked from this process, CPU shims as under
``--poseidon-emulate``). Every rank parses the Megatron arguments with Megatron's parser, sets
TP / EP / sequence parallelism, runs Megatron's ``validate_args`` on them, initialises
megatron-core's model-parallel groups, builds decoder layer ``I`` (0-based) from the layer spec
the training script would pick (the profiler's ``layer_config_and_spec``) and runs one
micro-batch forward under ``torch.autograd.graph.saved_tensors_hooks``, counting the bytes
autograd keeps for backward (unique storages, parameters excluded) and the layer's parameter
bytes. Tensors of shape ``[..., s, s]`` (the unfused attention's scores, softmax output and
dropout mask: megatron-core's local ``DotProductAttention``; flash attention keeps none) and the
unfused RoPE's cos / sin tables (``[s, 1, 1, d]``; the GPU's fused RoPE keeps none) are counted
apart. What the GPU build runs as fused kernels and the CPU build cannot is run as stand-ins
that keep what those kernels keep (the norms, the core attention, the dropout mask: see
``_fuse_norms``, ``_flash_class``, ``_gpu_dropout``); everything else is megatron-core's.

``--mtp``: megatron-core's first ``MultiTokenPredictionLayer`` instead (the block spec
``get_gpt_mtp_block_spec`` builds from the decoder's layer spec, ``--mtp-num-layers`` among the
arguments), its forward given the hidden states, the token and position ids and a
``LanguageModelEmbedding`` as the model's embedding (megatron-core 0.12's layer takes the
embedded, shifted tokens instead, as its block hands them over: the worker rolls and embeds
them the same way under the same hooks): what it keeps is the shifted tokens'
embedding, its norms, the ``eh_proj`` projection and its decoder layer; the shared output layer
and the loss run after it in ``GPTModel`` and are not in it.

One JSON line per rank, rank 0 last: ``MEMPROBE {...}``. The driver (``memory_check``) reads
them and holds ``memory.py`` to them. Torch is imported here only (a fidelity harness).
"""

from __future__ import annotations

import argparse
import copy
import contextlib
import inspect
import io
import json
import os
import socket
import sys
from typing import Any


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Counter:
    """Bytes of the unique storages autograd saves, parameters excluded; ``[.., s, s]``
    tensors apart."""

    def __init__(self, exclude: set[int], seq: int) -> None:
        self.exclude, self.seq = exclude, seq
        self.seen: set[int] = set()
        self.kept = self.scores = self.rope = 0

    def pack(self, t):
        try:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
        except Exception:  # noqa: BLE001 - sparse / meta: ignore
            return t
        if ptr in self.exclude or ptr in self.seen or ptr == 0:
            return t
        self.seen.add(ptr)
        if t.dim() >= 2 and tuple(t.shape[-2:]) == (self.seq, self.seq):
            self.scores += storage.nbytes()
        elif t.dim() == 4 and t.shape[0] == self.seq and tuple(t.shape[1:3]) == (1, 1):
            self.rope += storage.nbytes()     # the unfused RoPE's cos / sin tables
        else:
            self.kept += storage.nbytes()
            if os.environ.get("POSEIDON_MEMPROBE_DUMP"):
                print("KEPT", tuple(t.shape), t.dtype, storage.nbytes(),
                      type(t.grad_fn).__name__ if t.grad_fn is not None else None,
                      file=sys.stderr)
        return t

    @staticmethod
    def unpack(t):
        return t


def _args_at(args: Any, tp: int, ep: int, sp: bool, world: int, rank: int,
             framework: bool = False) -> Any:
    """A validated copy of Megatron's ``args`` at TP ``tp``, EP ``ep``, PP 1, CP 1;
    ``framework``: validated by the installed ``validate_args`` with its wrappers (MindSpeed-LLM's
    adds the arguments its own modules read, as a launch's validation does), else by
    Megatron's own."""
    from poseidon_plugin.megatron.profile import profiler

    a = copy.deepcopy(args)
    a.tensor_model_parallel_size = tp
    a.expert_model_parallel_size = ep
    a.pipeline_model_parallel_size = 1
    a.context_parallel_size = 1
    for attr in profiler._SPLIT_ATTRS:
        if hasattr(a, attr):
            setattr(a, attr, None)
    a.sequence_parallel = sp and tp > 1
    a.world_size, a.rank = world, rank
    a.global_batch_size = a.micro_batch_size * (world // tp)
    a.rampup_batch_size = None
    a.yaml_cfg = None
    import megatron.training.arguments as margs

    validate = margs.validate_args if framework else profiler._unwrapped_validate_args()
    with contextlib.redirect_stdout(io.StringIO()):
        validate(a, {})
    return a


def _rank(rank: int, world: int, port: int, opts: Any, argv: list[str], out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    import torch
    import torch.distributed as dist

    from poseidon_plugin.megatron.emulate import emulation
    from poseidon_plugin.megatron.profile import profiler

    torch.set_num_threads(1)
    emulation.install_cpu_shims(local_rank=rank, device_count=world, device_name="memprobe",
                                memory_bytes=1 << 34)
    if opts.mindspeed_llm:   # its patches applied before anything is parsed or built, as in a launch
        from poseidon_plugin.megatron.launch import argv as argvmod

        argvmod.import_mindspeed_llm("pretrain_gpt.py", argv)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state, tensor_parallel

    args = profiler.parse_megatron_args("pretrain_gpt.py", argv)
    report: dict[str, Any] = {"rank": rank}
    try:
        vargs = _args_at(args, opts.tp, opts.ep, opts.sp, world, rank, opts.mindspeed_llm)
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=opts.tp,
                                                 expert_model_parallel_size=opts.ep)
        tensor_parallel.model_parallel_cuda_manual_seed(1234 + rank)
        from poseidon_plugin.megatron import framework_state

        with framework_state.profiling(vargs, world // opts.tp):   # the globals a build reads
            report.update(_measure_mtp(vargs) if opts.mtp else _measure_layer(vargs, opts.layer))
    except Exception as e:  # noqa: BLE001 - reported: the driver says which piece did not build
        if os.environ.get("POSEIDON_MEMPROBE_DUMP"):
            import traceback

            traceback.print_exc()
        report["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    with contextlib.suppress(Exception):
        dist.barrier()
    dist.destroy_process_group()


def _norms_take_sequence_parallel() -> None:
    """megatron-core's torch norm (``WrappedTorchNorm``, the local spec) refuses sequence
    parallelism (its weights would need the SP gradient all-reduce, which training does and a
    forward does not); its forward is the same either way: built here from a config copy with
    SP off."""
    from megatron.core.transformer import torch_norm

    cls = torch_norm.WrappedTorchNorm
    if getattr(cls, "_memprobe", False):
        return
    new = cls.__new__

    def patched(klass, config, *args, **kwargs):
        if getattr(config, "sequence_parallel", False):
            config = copy.copy(config)
            config.sequence_parallel = False
        return new(klass, config, *args, **kwargs)

    cls.__new__ = patched
    cls._memprobe = True


def _fused_norm_class():
    """A norm that keeps for backward what the GPU's fused norm kernels keep (Transformer
    Engine's, apex's, torch's CUDA ``rms_norm``): its input and the fp32 1/rms (and mean). The
    CPU's torch norm keeps fp32 copies instead (an artefact of the CPU build)."""
    import torch

    class FusedNorm(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, bias, eps, rms):
            xf = x.float()
            mean = None if rms else xf.mean(-1, keepdim=True)
            centred = xf if rms else xf - mean
            rstd = torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + eps)
            out = (centred * rstd).to(x.dtype) * weight
            if bias is not None:
                out = out + bias
            ctx.save_for_backward(x, rstd, *(() if rms else (mean,)))
            return out

        @staticmethod
        def backward(ctx, grad):  # pragma: no cover - the probe runs forward only
            raise NotImplementedError

    return FusedNorm


def _fuse_norms(layer: Any) -> int:
    """Every torch norm of ``layer`` runs as :func:`_fused_norm_class`; how many. The RMSNorm
    MindSpeed-LLM builds (megatron-core's legacy ``RMSNorm``, its ``forward`` patched by
    MindSpeed-LLM: ``torch_npu.npu_rms_norm`` under ``--use-fused-rmsnorm``, which keeps what
    the stand-in keeps; the fp32 fallback runs only without that flag) and MindSpeed's own are
    norms too."""
    import torch

    fused = _fused_norm_class()
    count = 0
    for module in layer.modules():
        rms = isinstance(module, getattr(torch.nn, "RMSNorm", ())) or (
            type(module).__name__ == "RMSNorm" and hasattr(module, "weight")
            and hasattr(module, "eps")
            and type(module).__module__.startswith(("mindspeed", "megatron.legacy")))
        if not (rms or isinstance(module, torch.nn.LayerNorm)):
            continue
        eps = module.eps if module.eps is not None else 1e-6

        def forward(x, m=module, e=eps, r=rms):
            return fused.apply(x, m.weight, getattr(m, "bias", None), e, r)

        module.forward = forward
        count += 1
    return count


def _flash_class():
    """The core attention as flash attention keeps it (Transformer Engine's fused attention,
    which megatron-core uses on a GPU and cannot build on a CPU): Q, K and V made contiguous
    (as TE does; not expanded for GQA), the output (the same storage the output projection
    keeps) and the fp32 log-sum-exp; no s x s matrix. The values are torch's."""
    import torch

    class Flash(torch.autograd.Function):
        @staticmethod
        def forward(ctx, query, key, value):
            q, k, v = (t.contiguous() for t in (query, key, value))        # [s, b, a, d]
            with torch.no_grad():
                out = torch.nn.functional.scaled_dot_product_attention(
                    *(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True,
                    enable_gqa=k.shape[2] != q.shape[2])
            s, b, a = q.shape[0], q.shape[1], q.shape[2]
            out = out.permute(2, 0, 1, 3).reshape(s, b, -1).contiguous()
            lse = torch.empty(b, a, s, dtype=torch.float32)
            ctx.save_for_backward(q, k, v, out, lse)
            return out

        @staticmethod
        def backward(ctx, grad):  # pragma: no cover - the probe runs forward only
            raise NotImplementedError

    return Flash


def _install_flash(attention: Any) -> bool:
    core = getattr(attention, "core_attention", None)
    if core is None:
        return False
    flash = _flash_class()

    def forward(query, key, value, *args, **kwargs):
        return flash.apply(query, key, value)

    core.forward = forward
    return True


def _gpu_dropout() -> None:
    """``torch.nn.functional.dropout`` keeping a 1-byte mask, as the GPU's ``native_dropout``
    does (the CPU's keeps a mask of the input's dtype)."""
    import torch
    import torch.nn.functional as F

    if getattr(F.dropout, "_memprobe", False):
        return

    class Dropout(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, p):
            mask = torch.rand(x.shape) >= p
            ctx.save_for_backward(mask)
            return x * mask.to(x.dtype) / (1.0 - p)

        @staticmethod
        def backward(ctx, grad):  # pragma: no cover - the probe runs forward only
            raise NotImplementedError

    plain = F.dropout

    def dropout(input, p=0.5, training=True, inplace=False):
        if not training or p == 0.0:
            return input
        if p == 1.0:
            return plain(input, p, training, inplace)
        return Dropout.apply(input, p)

    dropout._memprobe = True
    F.dropout = dropout


def _core_attention_takes_mla_head_dims() -> None:
    """megatron-core's local ``DotProductAttention`` refuses MLA's ``k_channels`` /
    ``v_channels`` (MLA runs on Transformer Engine's attention); the core is replaced by the
    flash stand-in anyway (``_install_flash``), so they are dropped at its construction."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    if getattr(DotProductAttention, "_memprobe", False):
        return
    init = DotProductAttention.__init__

    def patched(self, *args, k_channels=None, v_channels=None, **kwargs):
        init(self, *args, **kwargs)

    DotProductAttention.__init__ = patched
    DotProductAttention._memprobe = True


def _uneven_collectives() -> None:
    """``all_gather`` / ``reduce_scatter`` of tensor lists whose sizes differ between ranks (the
    all-to-all dispatcher's TP gather of each rank's routed tokens at TP > 1), which NCCL does
    and gloo refuses: as equal-size gloo collectives on zero-padded copies."""
    import torch
    import torch.distributed as dist

    if getattr(dist.all_gather, "_memprobe", False):
        return
    gather, scatter = dist.all_gather, dist.reduce_scatter

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        if len({tuple(t.shape) for t in tensor_list}) <= 1:
            return gather(tensor_list, tensor, group=group, async_op=async_op)
        rows = max(t.shape[0] for t in tensor_list)
        padded = torch.zeros((rows, *tensor.shape[1:]), dtype=tensor.dtype)
        padded[:tensor.shape[0]] = tensor
        out = [torch.empty_like(padded) for _ in tensor_list]
        gather(out, padded, group=group)
        for dst, src in zip(tensor_list, out):
            dst.copy_(src[:dst.shape[0]])
        return None

    def reduce_scatter(output, input_list, op=dist.ReduceOp.SUM, group=None, async_op=False):
        me = dist.get_rank(group)
        for i, chunk in enumerate(input_list):
            total = chunk.contiguous().clone()
            dist.all_reduce(total, op=op, group=group)
            if i == me:
                output.copy_(total)
        return None

    all_gather._memprobe = True
    dist.all_gather, dist.reduce_scatter = all_gather, reduce_scatter


def _inputs(config: Any, vargs: Any):
    from poseidon_plugin.megatron.profile import profiler
    import torch

    x, kwargs, grad = profiler._layer_inputs(config, vargs, torch.device("cpu"))
    return x, kwargs, grad


def _install_stand_ins(vargs: Any) -> None:
    """What every cell runs as the GPU build would (see the module docstring)."""
    _norms_take_sequence_parallel()
    _gpu_dropout()
    _uneven_collectives()
    if getattr(vargs, "multi_latent_attention", False):
        _core_attention_takes_mla_head_dims()


def _config_and_spec(vargs: Any, index: int) -> tuple[Any, Any, bool]:
    """(config, layer spec, MoE?) as the training script builds them; MoE routing balanced."""
    from poseidon_plugin.megatron.profile import profiler

    config, spec = profiler.layer_config_and_spec(vargs, index)
    moe = profiler.is_moe_spec(spec)
    if moe:
        profiler.balanced_routing(config)
    return config, spec, moe


def _count_forward(layer: Any, attention: Any, config: Any, vargs: Any, forward: Any,
                   also_exclude: tuple = ()) -> dict[str, Any]:
    """``layer`` with its norms and core attention as the GPU runs them, one micro-batch
    ``forward(x, kwargs)`` under the saved-tensor hooks: the bytes kept (parameters, and the
    storages of ``also_exclude``, not counted), its parameters and modules."""
    import torch

    stand_ins = {"fused_norms": _fuse_norms(layer), "flash_core": _install_flash(attention)}
    x, kwargs, grad = _inputs(config, vargs)
    params = list(layer.parameters())
    counter = _Counter({p.untyped_storage().data_ptr() for p in [*params, *also_exclude]},
                       int(vargs.seq_length))
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
        out = forward(x, kwargs)
    del out, grad
    return {"kept_bytes": counter.kept, "scores_bytes": counter.scores,
            "rope_bytes": counter.rope,
            "param_bytes": sum(p.numel() * p.element_size() for p in params),
            "modules": sorted({type(m).__name__ for m in layer.modules()}),
            "norms": sorted({f"{type(m).__module__}.{type(m).__name__}" for m in layer.modules()
                             if "Norm" in type(m).__name__}), **stand_ins}


def _measure_layer(vargs: Any, index: int) -> dict[str, Any]:
    from megatron.core.transformer.spec_utils import build_module

    _install_stand_ins(vargs)
    config, spec, moe = _config_and_spec(vargs, index)
    layer = build_module(spec, config=config, layer_number=index + 1)
    layer = layer.to(dtype=config.params_dtype)
    layer.train()
    report = _count_forward(layer, getattr(layer, "self_attention", None), config, vargs,
                            lambda x, kwargs: layer(hidden_states=x, **kwargs))
    expert_bytes = 0
    experts = getattr(getattr(layer, "mlp", None), "experts", None)
    if experts is not None:
        expert_bytes = sum(p.numel() * p.element_size() for p in experts.parameters())
    return {**report, "moe": moe, "expert_param_bytes": expert_bytes,
            "dispatcher": getattr(config, "moe_token_dispatcher_type", None) if moe else None}


def _measure_mtp(vargs: Any) -> dict[str, Any]:
    """The first MTP layer's kept bytes and parameters (``--mtp``; see the module docstring)."""
    import torch
    from megatron.core.models.common.embeddings.language_model_embedding import (
        LanguageModelEmbedding)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlock

    _install_stand_ins(vargs)
    config, spec, moe = _config_and_spec(vargs, 0)
    block = MultiTokenPredictionBlock(
        config=config, spec=get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False))
    layer = block.layers[0].to(dtype=config.params_dtype)
    layer.train()
    seq, mbs = int(vargs.seq_length), int(vargs.micro_batch_size)
    step = int(vargs.make_vocab_size_divisible_by) * int(vargs.tensor_model_parallel_size)
    vocab = -(-int(vargs.vocab_size) // step) * step    # Megatron's padding of the vocabulary
    embedding = LanguageModelEmbedding(
        config=config, vocab_size=vocab, max_sequence_length=seq,
        position_embedding_type=vargs.position_embedding_type).to(dtype=config.params_dtype)
    embedding.train()
    ids = torch.randint(0, vocab, (mbs, seq))
    positions = torch.arange(seq).unsqueeze(0).expand(mbs, seq)
    inner = getattr(layer, "mtp_model_layer", None) or getattr(layer, "transformer_layer", None)
    if "decoder_input" in inspect.signature(layer.forward).parameters:
        # megatron-core 0.12: the block rolls the ids and embeds them, the layer takes the
        # embedded input (``decoder_input``); both run inside the block's forward, so the
        # embedding's kept tensors are the MTP's as in 0.19, where the layer embeds itself
        from megatron.core.transformer.multi_token_prediction import roll_tensor

        def forward(x, kwargs):
            rolled, _ = roll_tensor(ids.clone(), shifts=-1, dims=-1)
            return layer(decoder_input=embedding(input_ids=rolled, position_ids=positions),
                         hidden_states=x, **kwargs)
    else:
        def forward(x, kwargs):
            return layer(input_ids=ids, position_ids=positions, hidden_states=x,
                         embedding=embedding, **kwargs)
    piece = layer
    moved = getattr(block, "final_layernorms", None)
    if moved is not None and getattr(layer, "final_layernorm", None) is None:
        # MindSpeed-LLM moves the layer's final norm into the block (``final_layernorms``,
        # applied to the layer's output before the shared head): the same piece of the model,
        # counted where megatron-core counts it
        norm = moved[0].to(dtype=config.params_dtype)
        piece = torch.nn.ModuleList([layer, norm])
        unnormed = forward

        def forward(x, kwargs):
            out = unnormed(x, kwargs)
            return norm(out[0] if isinstance(out, tuple) else out)
    report = _count_forward(piece, getattr(inner, "self_attention", None), config, vargs,
                            forward, also_exclude=tuple(embedding.parameters()))
    return {**report, "moe": moe, "final_norm_in_block": piece is not layer}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="mcore_memory")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--sp", action="store_true")
    parser.add_argument("--layer", type=int, default=0)
    parser.add_argument("--mtp", action="store_true")
    parser.add_argument("--mindspeed-llm", action="store_true")
    if "--" not in argv:
        print("poseidon: error: mcore_memory: put the Megatron arguments after --", file=sys.stderr)
        return 2
    cut = argv.index("--")
    opts = parser.parse_args(argv[:cut])
    mega = argv[cut + 1:]
    world = opts.tp * opts.ep
    import tempfile

    import torch.multiprocessing as mp

    port = _free_port()
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.get_context("fork")
        procs = [ctx.Process(target=_rank, args=(r, world, port, opts, mega, out_dir))
                 for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        for r in range(world):
            path = os.path.join(out_dir, f"rank{r}.json")
            if not os.path.exists(path):
                print("MEMPROBE " + json.dumps({"rank": r, "error": "rank died"}), flush=True)
                continue
            with open(path) as f:
                print("MEMPROBE " + f.read(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
