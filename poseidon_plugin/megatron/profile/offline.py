"""``poseidon profile``: the launch's layer profiler as an offline command.

One device type per run: the model's decoder layer, built by megatron-core from Megatron flags
made from the model spec and the training setup, is timed (:func:`.profiler.profile_rank`) on
this machine's devices for each TP degree and micro-batch size, and written as measured records
into a profile DB (merged into the file when it exists), which ``poseidon plan --profiles`` reads.
A model of several layer kinds (dense layers, then MoE ones) has each kind profiled, from the
flags of a one-layer model of that kind (:func:`layer_kinds`), and recorded under that kind's
signature (``ModelSpec.kind_model(i).signature()``), as the launch records them; a MoE layer's
tokens are routed evenly where megatron-core can (:mod:`.profiler`). ``--ep E``: a MoE layer is
profiled as one rank of EP E runs it (E / EP local experts; :mod:`.profiler`), recorded at that
EP, so a 256-expert layer is measurable on one device.

* Device: ``auto`` takes CUDA, then an Ascend NPU, else the CPU. On the CPU megatron-core runs
  under the emulation's CUDA shims (``emulation.install_cpu_shims``) with the local
  (unfused-attention) layer spec, so ``--attention unfused`` is required there; on GPU / NPU
  ``flash`` uses Transformer Engine's layer spec, ``unfused`` Megatron's local one.
* TP: one process measures TP 1. Under torchrun (``WORLD_SIZE`` > 1) every TP degree ``t`` runs
  on real TP groups of ``t`` consecutive ranks inside a node, as the launch profiles them
  (:func:`.group_profile.profile_and_gather`): the degrees must divide the processes per node
  (:func:`.profile_tps.check_tps`). Rank 0 aggregates (median over the ranks) and writes the DB.
* Process group: one process: a one-rank group on a temporary file store. Under torchrun: the
  launch's bootstrap (rendezvous store, deadline barriers: a rank that fails or never answers
  is named within ``--timeout`` seconds), then, for the timing, the default group on gloo (CPU),
  NCCL (GPU) or HCCL (NPU) (:func:`.bootstrap.device_backend`, as the launch), which
  megatron-core splits into TP groups; the gather on the gloo probe group; destroyed afterwards.
  On the CPU the ranks of a host get an equal share of its cores and measure TP 1 groups in
  turns.
* Megatron-core's per-op overheads (every process; the type's record their median) and, under
  torchrun, its per-call p2p costs of one rank pair per link kind the processes offer
  (``_engine_costs``), stored beside the layer records (``callcosts.py``).
"""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass
from typing import Any, Sequence

from poseidon_plugin.errors import PoseidonError
from poseidon_plugin.training import TrainingSetup, megatron_flags
from poseidon_plugin.megatron.profile.profile_output import framework_notes
from poseidon_plugin.megatron.profile.profile_tps import Processes, check_tps

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
    timeout_s: float = 300.0         # every barrier / collective under torchrun
    eps: tuple[int, ...] = (1,)      # EP degrees a MoE layer is profiled at (one EP rank's share)


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
        # one layer at Megatron's default --moe-layer-freq 1: the MoE kind of a mixed model
        flags += ["--num-experts", str(model.num_experts), "--moe-router-topk",
                  str(model.moe_top_k),   # the dispatcher the plan prices and pins
                  "--moe-token-dispatcher-type", model.moe_token_dispatcher_type]
        if model.moe_ffn_hidden_size:
            flags += ["--moe-ffn-hidden-size", str(model.moe_ffn_hidden_size)]
        if model.moe_shared_expert_intermediate_size:
            flags += ["--moe-shared-expert-intermediate-size",
                      str(model.moe_shared_expert_intermediate_size)]
            if model.moe_shared_expert_gate:
                flags.append("--moe-shared-expert-gate")
    if model.qk_layernorm:
        flags.append("--qk-layernorm")
    if model.multi_latent_attention:
        i = flags.index("--kv-channels")
        del flags[i:i + 2]   # MLA's heads are its own head dims
        flags.append("--multi-latent-attention")
        for field in ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
                      "v_head_dim"):
            if getattr(model, field) is not None:
                flags += ["--" + field.replace("_", "-"), str(getattr(model, field))]
    return flags


def _pick_device(requested: str) -> str:
    import torch

    if requested in ("cpu", "cuda", "npu"):
        if requested == "cuda" and not torch.cuda.is_available():
            raise PoseidonError("--device cuda: no CUDA device is visible to torch")
        if requested == "npu" and not _npu_available():
            raise PoseidonError("--device npu: no Ascend NPU is visible to torch (torch_npu "
                                "missing or no device)")
        return requested
    if torch.cuda.is_available():
        return "cuda"
    return "npu" if _npu_available() else "cpu"


def _npu_available() -> bool:
    """torch_npu imported (lazily: only where torch has no CUDA) and an NPU visible."""
    from poseidon_plugin.megatron.launch.bootstrap import npu_module

    return npu_module() is not None


def backend_flags(kind: str, setup: TrainingSetup) -> list[str]:
    """The layer implementation and collectives for the device and the attention asked for."""
    from poseidon_plugin.megatron.launch.compat import CPU_EMULATION_FLAGS

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


def kernel_flags(kind: str) -> list[str]:
    """On CUDA: the flags that turn off Megatron's default fused kernels whose modules (Apex,
    Transformer Engine) are not installed here, as a launch does (logged)."""
    from poseidon_plugin.megatron.launch.compat import missing_kernel_flags, missing_kernels_text

    if kind != "cuda":
        return []
    missing = missing_kernel_flags([])
    if missing:
        log.warning("not installed here: %s; profiling with %s", missing_kernels_text(missing),
                    " ".join(flag for _, _, flag in missing))
    return [flag for _, _, flag in missing]


def _init_alone(kind: str, store_dir: str) -> None:
    """One process: a one-rank default group on the device's backend, on a file store."""
    import torch.distributed as dist

    from poseidon_plugin.megatron.launch.bootstrap import device_backend

    dist.init_process_group(device_backend(kind),
                            init_method=f"file://{os.path.join(store_dir, 'store')}",
                            rank=0, world_size=1)


def _setup_device(kind: str, req: ProfileRequest, procs: Processes) -> tuple[Any, str]:
    """(torch device, its name) of this process's local device (the CPU shims on the CPU)."""
    import torch

    from poseidon_plugin.megatron.emulate import emulation

    local = procs.local_rank
    if kind == "cpu":
        emulation.install_cpu_shims(local_rank=local, device_count=procs.local_world_size,
                                    device_name=req.device_type, memory_bytes=16 << 30)
        if procs.world_size > 1:   # the host's ranks share its cores, as a CPU launch trains
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // procs.local_world_size))
        return torch.device("cpu"), f"cpu ({req.device_type})"
    if kind == "cuda":
        torch.cuda.set_device(local)
        return torch.device("cuda", local), torch.cuda.get_device_properties(local).name
    torch.npu.set_device(local)  # type: ignore[attr-defined]
    return torch.device("npu", local), torch.npu.get_device_name(local)  # type: ignore


def profile_layers(req: ProfileRequest, procs: Processes | None = None,
                   calls_out: list | None = None, progress: Any = None) -> list | None:
    """Measured ``LayerProfile`` records of ``req`` (each TP degree and micro-batch size), on
    rank 0; None on the other ranks of a torchrun launch. ``calls_out``: rank 0 appends the
    device type's ``callcosts.OpOverhead`` record (megatron-core's per-op overheads) and, under
    torchrun, the ``callcosts.P2PCall`` records of each link kind the processes offer
    (``_engine_costs``). ``progress(done, total, what)``: before each configuration, on rank 0
    (``profile_output.ProgressLines``). Megatron's notes while it runs: ``framework_notes``."""
    procs = procs or Processes.from_environ()
    tps = check_tps(req.tps, procs, req.model)
    check_eps(req)
    if any(t > 1 for t in tps) and any(k.is_moe for k in req.model.layer_kinds):
        raise PoseidonError("a MoE layer at TP > 1 trains only with sequence parallelism "
                            "(megatron-core refuses it without), which poseidon profile does "
                            "not set up: profile the MoE model at --tp 1")
    kind = _pick_device(req.device)
    _check_mla(req, kind)
    with framework_notes(kind if procs.rank == 0 else "cpu"):   # rank 0 reports them
        gathered, name = _profile(req, procs, tps, kind, calls_out, progress)
    if procs.rank != 0:
        return None
    from poseidon_plugin.megatron.profile import profile_gather, profiler

    aggs, stragglers = profiler.aggregate(dict(enumerate(gathered)),
                                          {r: req.device_type for r in range(len(gathered))})
    for line in stragglers:
        log.warning("straggler: %s", line)
    return profile_gather.measured_records(aggs, req.seq_length,
                                           profile_gather.kind_signatures(req.model), req.setup,
                                           profile_gather.measurement_env(name, kind))


def _check_mla(req: ProfileRequest, kind: str) -> None:
    """A one-line PoseidonError for an MLA layer on megatron-core's local layer spec."""
    flags = backend_flags(kind, req.setup) + kernel_flags(kind)
    if req.model.multi_latent_attention and "transformer_engine" not in flags:
        # megatron-core's local DotProductAttention takes no k_channels (MLA's head size):
        # MLASelfAttention builds only on Transformer Engine's attention
        raise PoseidonError(f"model {req.model.name}: an MLA layer (multi_latent_attention) "
                            "needs Transformer Engine's attention, which megatron-core's "
                            f"local layer spec ({'the CPU' if kind == 'cpu' else '--attention unfused'}) "
                            "does not have: profile it on a GPU with Transformer Engine and "
                            "--attention flash")


def _profile(req: ProfileRequest, procs: Processes, tps: Sequence[int], kind: str,
             calls_out: list | None, progress: Any) -> tuple[list, str]:
    """(every rank's timings, the device's name) of ``req`` on device ``kind``."""
    import torch.distributed as dist

    from poseidon_plugin.megatron.profile import profiler
    from poseidon_plugin.megatron.launch.compat import patch_dataset_helpers
    from poseidon_plugin.megatron.imports import require_megatron

    flags = backend_flags(kind, req.setup) + kernel_flags(kind)
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    device, name = _setup_device(kind, req, procs)
    require_megatron("poseidon profile")   # after the CPU shims: one line if it is missing
    patch_dataset_helpers()
    kinds = layer_kinds(req, flags)
    args = kinds[0].args
    if procs.world_size > 1:
        return _profile_group(req, tps, args, kind, device, procs, kinds, calls_out,
                              progress), name
    with tempfile.TemporaryDirectory(prefix="poseidon-profile-") as tmp:
        _init_alone(kind, tmp)
        try:
            gathered = [profiler.profile_rank(
                args, tps, req.micro_batch_sizes, world_size=1, rank=0, device=device,
                iters=req.iters, seed=req.seed, kinds=kinds,
                **({"progress": progress} if progress is not None else {}))]
            if calls_out is not None:
                calls_out.extend(_op_overheads_alone(req, device))
        finally:
            dist.destroy_process_group()
    return gathered, name


def check_eps(req: ProfileRequest) -> None:
    """A one-line PoseidonError for an EP degree ``poseidon profile`` cannot measure: one that
    does not divide the model's experts, EP > 1 on a model without MoE layers, or where profile
    records cannot carry an EP degree."""
    from poseidon_plugin.megatron.profile.profile_gather import keys_carry_ep

    eps = [e for e in req.eps if e > 1]
    if not eps:
        return
    experts = int(req.model.num_experts or 0)
    if not experts:
        raise PoseidonError(f"--ep {' '.join(map(str, eps))}: the model has no MoE layers")
    odd = [e for e in eps if experts % e]
    if odd:
        raise PoseidonError(f"--ep {odd[0]} does not divide the model's {experts} experts")
    if not keys_carry_ep():
        raise PoseidonError("--ep > 1: this version's profile records cannot say their EP")


def layer_kinds(req: ProfileRequest, backend: Sequence[str]) -> tuple:
    """The ``profiler.ProfiledKind`` of each distinct layer kind of ``req.model``, each with the
    parsed Megatron arguments of a one-layer model of that kind (``ModelSpec.kind_model``:
    dense flags for the dense kind, MoE flags at ``--moe-layer-freq 1`` for the MoE kind);
    ``backend``: the device's layer-implementation flags."""
    from poseidon_plugin.megatron.profile import profiler

    model = req.model
    out = []
    for i, kind in enumerate(model.layer_kinds):
        one = model.kind_model(i) if model.is_mixed else model
        argv = (model_flags(one, req.seq_length, req.micro_batch_sizes[0])
                + megatron_flags(req.setup) + list(backend) + ["--seed", str(req.seed)])
        parsed = profiler.parse_megatron_args("poseidon-profile", argv)
        for ep in (tuple(sorted(set(req.eps))) or (1,)) if kind.is_moe else (1,):
            out.append(profiler.ProfiledKind(kind.name if model.is_mixed else "", 0,
                                             kind.is_moe if model.is_mixed else None,
                                             parsed, ep=ep))
    return tuple(out)


def _profile_group(req: ProfileRequest, tps: Sequence[int], args: Any, kind: str, device: Any,
                   procs: Processes, kinds: Sequence = (), calls_out: list | None = None,
                   progress: Any = None) -> list:
    """Every rank's timings (the launch's bootstrap and TP-group profiling, see the module
    docstring), gathered on every rank; with ``calls_out``, then ``_engine_costs``."""
    import torch.distributed as dist

    from poseidon_plugin.megatron.launch import bootstrap
    from poseidon_plugin.megatron.profile import group_profile, profiler

    env = bootstrap.LaunchEnv.from_environ(needed_by="poseidon profile on several processes")
    boot = bootstrap.Bootstrap(env, req.timeout_s).start()
    try:
        turns = profiler.Turns(procs.local_rank, procs.local_world_size) if kind == "cpu" else None
        # TP all-reduces on NCCL / HCCL, as training runs them (gloo on the CPU)
        gathered = group_profile.profile_and_gather(boot, args, tps, req.micro_batch_sizes,
                                                    device=device, iters=req.iters,
                                                    seed=req.seed,
                                                    backend=bootstrap.device_backend(kind),
                                                    turns=turns, kinds=kinds or None,
                                                    progress=progress)
        if calls_out is not None:
            calls_out.extend(_engine_costs(req, boot, kind, device, procs))
        return gathered
    finally:
        boot.finish_probe()
        if dist.is_initialized():
            dist.destroy_process_group()


def _op_overheads_alone(req: ProfileRequest, device: Any) -> list:
    """One process: this device's megatron-core op overheads as an ``OpOverhead`` record."""
    from poseidon_plugin.callcosts import OpOverhead
    from poseidon_plugin.megatron.profile.op_overhead import measure_op_overheads

    ov = measure_op_overheads(device)
    return [OpOverhead(req.device_type, ov["forward_ms"], ov["backward_ms"])]


def _engine_costs(req: ProfileRequest, boot: Any, kind: str, device: Any,
                  procs: Processes) -> list:
    """Every rank's megatron-core op overheads (the device type's record: their median) and the
    per-call p2p costs of one rank pair per link kind the torchrun group offers (intra-node
    where a node runs two processes, inter-node where there are two nodes:
    ``callcost_profile.link_pairs`` on the ranks' hosts), at each micro-batch size's activation
    message (b x seq x hidden bf16 bytes), on the device's backend as training sends them (gloo
    on the CPU): ``callcost_profile.measure_engine_costs``. Rank 0 gets the ``OpOverhead`` and
    ``P2PCall`` records, the others []."""
    from poseidon_plugin.megatron.launch import bootstrap, discovery
    from poseidon_plugin.megatron.profile.callcost_profile import (activation_messages, engine_cost_records, link_pairs,
                                   measure_engine_costs)

    where = bootstrap.run_guarded(boot, "hosts", lambda: boot.all_gather_object(
        (bootstrap.hostname(), procs.local_rank), "hosts"))
    topo = discovery.group_nodes([discovery.DeviceInfo(r, lr, host, req.device_type, 0, kind)
                                  for r, (host, lr) in enumerate(where)])
    messages = activation_messages(req.model.hidden_size, [req.seq_length],
                                   req.micro_batch_sizes)
    gathered = measure_engine_costs(boot, link_pairs(topo), messages, device=device,
                                    backend=bootstrap.device_backend(kind))
    if procs.rank != 0:
        return []
    ops, calls = engine_cost_records(gathered, {r: req.device_type for r in range(len(where))})
    return [*ops, *calls]


def write_profiles(records: Sequence, out: str, calls: Sequence = ()) -> tuple[int, int]:
    """Merge ``records`` (and the ``callcosts.P2PCall`` / ``callcosts.OpOverhead`` records
    ``calls``) into the DB at ``out`` (created if absent); (stored layer records, total layer
    records)."""
    from poseidon_plugin.callcosts import OpOverhead
    from poseidon_plugin.profiles import ProfileDB

    db = ProfileDB(out)
    for c in calls:
        if isinstance(c, OpOverhead):
            db.put_op_overhead(c)
        else:
            db.put_p2p_call(c)
    stored = sum(bool(db.put(r)) for r in records)
    db.save(out)
    return stored, len(db)


def merge_files(inputs: Sequence[str], out: str) -> int:
    """Merge profile DB files (the DB's merge rule, in the order given) into ``out`` (whose own
    records, when it exists, come first: merge-on-write)."""
    from poseidon_plugin.profiles import ProfileDB

    db = ProfileDB(out)
    for path in inputs:
        db.merge(ProfileDB.load(path))
    db.save(out)
    return len(db)


__all__ = ["ProfileRequest", "profile_layers", "write_profiles",
           "merge_files", "model_flags"]
