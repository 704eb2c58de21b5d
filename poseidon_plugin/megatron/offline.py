"""``poseidon profile``: the launch's layer profiler as an offline command.

One device type per run: the model's decoder layer, built by megatron-core from Megatron flags
made from the model spec and the training setup, is timed (:func:`.profiler.profile_rank`) on
this machine's device for each micro-batch size, and written as measured records into a
profile DB (merged into the file when it exists), which ``poseidon plan --profiles`` reads.

* Device: ``auto`` takes CUDA, then an Ascend NPU, else the CPU. On the CPU megatron-core runs
  under the emulation's CUDA shims (``emulation.install_cpu_shims``) with the local
  (unfused-attention) layer spec, so ``--attention unfused`` is required there; on GPU / NPU
  ``flash`` uses Transformer Engine's layer spec, ``unfused`` Megatron's local one.
* TP: one process measures TP 1 only. TP > 1 records come from a ``--poseidon-auto`` launch
  (its profiler runs real TP groups) or are estimated (calibrated) by ``poseidon plan``.
* Process group: a one-rank group (gloo on CPU, NCCL / HCCL otherwise) on a temporary file
  store, destroyed afterwards.
"""

from __future__ import annotations

import logging
import os
import tempfile
import warnings
from dataclasses import dataclass
from typing import Any, Sequence

from ..errors import PoseidonError
from ..training import TrainingSetup, megatron_flags

log = logging.getLogger("poseidon")


@dataclass(frozen=True)
class ProfileRequest:
    """What one ``poseidon profile`` run measures."""

    model: Any                       # ModelSpec
    seq_length: int
    device_type: str
    micro_batch_sizes: tuple[int, ...] = (1,)
    tps: tuple[int, ...] = (1,)
    setup: TrainingSetup = TrainingSetup()
    device: str = "auto"             # auto | cpu | cuda | npu
    iters: int = 5
    seed: int = 1234


def model_flags(model, seq_length: int, micro_batch_size: int) -> list[str]:
    """Megatron flags that build ``model``'s layer (one layer: only its shape matters)."""
    flags = ["--num-layers", "1", "--hidden-size", str(model.hidden_size),
             "--ffn-hidden-size", str(model.ffn_hidden_size),
             "--num-attention-heads", str(model.num_attention_heads),
             "--kv-channels", str(model.head_dim),
             "--seq-length", str(seq_length), "--max-position-embeddings", str(seq_length),
             "--vocab-size", str(model.vocab_size), "--make-vocab-size-divisible-by", "1",
             "--tokenizer-type", "NullTokenizer", "--mock-data",
             "--micro-batch-size", str(micro_batch_size),
             "--global-batch-size", str(micro_batch_size),
             "--normalization", model.normalization,
             "--position-embedding-type", model.position_embedding_type,
             "--attention-dropout", "0.1", "--hidden-dropout", "0.1",
             "--train-iters", "1", "--lr", "1e-4"]
    if model.num_query_groups != model.num_attention_heads:
        flags += ["--group-query-attention", "--num-query-groups", str(model.num_query_groups)]
    if model.swiglu:
        flags.append("--swiglu")
    if not model.add_bias_linear:
        flags.append("--disable-bias-linear")
    if model.untie_embeddings:
        flags.append("--untie-embeddings-and-output-weights")
    if model.is_moe:
        flags += ["--num-experts", str(model.num_experts), "--moe-router-topk",
                  str(model.moe_top_k)]
        if model.moe_ffn_hidden_size:
            flags += ["--moe-ffn-hidden-size", str(model.moe_ffn_hidden_size)]
    return flags


def _pick_device(requested: str) -> str:
    import torch

    if requested in ("cpu", "cuda", "npu"):
        if requested == "cuda" and not torch.cuda.is_available():
            raise PoseidonError("--device cuda: no CUDA device is visible to torch")
        return requested
    if torch.cuda.is_available():
        return "cuda"
    try:
        import torch_npu  # type: ignore  # noqa: F401

        if torch.npu.is_available():  # type: ignore[attr-defined]
            return "npu"
    except ImportError:
        pass
    return "cpu"


def backend_flags(kind: str, setup: TrainingSetup) -> list[str]:
    """The layer implementation and collectives for the device and the attention asked for."""
    from .compat import CPU_EMULATION_FLAGS

    if kind == "cpu":
        if setup.attention != "unfused":
            raise PoseidonError("poseidon profile on the CPU runs Megatron's local layer spec, "
                                "whose attention is unfused: pass --attention unfused")
        if setup.params_dtype == "fp16":
            raise PoseidonError("poseidon profile on the CPU: --params-dtype fp16 is not "
                                "supported there; use bf16 or fp32")
        return list(CPU_EMULATION_FLAGS)
    if setup.attention == "flash":
        try:
            import transformer_engine  # type: ignore  # noqa: F401
        except ImportError:
            raise PoseidonError("--attention flash needs Transformer Engine (its fused "
                                "attention); install it or profile with --attention unfused "
                                "(Megatron's local spec)") from None
        return ["--transformer-impl", "transformer_engine", "--attention-backend", "flash"]
    return ["--transformer-impl", "local", "--attention-backend", "unfused"]


def _init_group(kind: str, store_dir: str) -> None:
    import torch.distributed as dist

    backend = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}[kind]
    dist.init_process_group(backend, init_method=f"file://{os.path.join(store_dir, 'store')}",
                            rank=0, world_size=1)


def profile_layers(req: ProfileRequest) -> list:
    """Measured ``LayerProfile`` records of ``req`` (TP 1, each micro-batch size)."""
    if any(t != 1 for t in req.tps):
        raise PoseidonError("poseidon profile measures TP 1 only (one process); TP > 1 records "
                            "come from a --poseidon-auto launch or are calibrated by poseidon "
                            "plan")
    import torch
    import torch.distributed as dist

    from . import emulation, profile_gather, profiler
    from .compat import patch_dataset_helpers

    kind = _pick_device(req.device)
    flags = backend_flags(kind, req.setup)
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    if kind == "cpu":
        emulation.install_cpu_shims(local_rank=0, device_count=1, device_name=req.device_type,
                                    memory_bytes=16 << 30)
        device = torch.device("cpu")
        name = f"cpu ({req.device_type})"
    elif kind == "cuda":
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
        name = torch.cuda.get_device_properties(0).name
    else:
        torch.npu.set_device(0)  # type: ignore[attr-defined]
        device = torch.device("npu", 0)
        name = torch.npu.get_device_name(0)  # type: ignore[attr-defined]
    patch_dataset_helpers()
    argv = (model_flags(req.model, req.seq_length, req.micro_batch_sizes[0])
            + megatron_flags(req.setup) + flags + ["--seed", str(req.seed)])
    args = profiler.parse_megatron_args("poseidon-profile", argv)
    with tempfile.TemporaryDirectory(prefix="poseidon-profile-") as tmp, \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")   # megatron-core's "Apex / TE not installed" notes
        _init_group(kind, tmp)
        try:
            timings = profiler.profile_rank(args, [1], req.micro_batch_sizes, world_size=1,
                                            rank=0, device=device, iters=req.iters,
                                            seed=req.seed)
        finally:
            dist.destroy_process_group()
    aggs, _ = profiler.aggregate({0: timings}, {0: req.device_type})
    return profile_gather.measured_records(aggs, req.seq_length, req.model.signature(),
                                           req.setup,
                                           profile_gather.measurement_env(name, kind))


def write_profiles(records: Sequence, out: str) -> tuple[int, int]:
    """Merge ``records`` into the DB at ``out`` (created if absent); (stored, total records)."""
    from ..profiles import ProfileDB

    db = ProfileDB(out)
    stored = sum(bool(db.put(r)) for r in records)
    db.save(out)
    return stored, len(db)


def merge_files(inputs: Sequence[str], out: str) -> int:
    """Merge profile DB files (the DB's merge rule, in the order given) into ``out`` (whose own
    records, when it exists, come first: merge-on-write)."""
    from ..profiles import ProfileDB

    db = ProfileDB(out)
    for path in inputs:
        db.merge(ProfileDB.load(path))
    db.save(out)
    return len(db)


__all__ = ["ProfileRequest", "profile_layers", "write_profiles", "merge_files", "model_flags"]
