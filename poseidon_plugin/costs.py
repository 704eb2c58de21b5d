"""Stage costs from profiles and placement: the numbers the search and the plan use.

Per stage s of a plan (type k, TP t, l layers, micro-batch b, sequence S, DP d):

* forward F_s = l * f(k, t, b) (+ embedding forward on stage 0, + output layer forward on the
  last stage, and the model's MTP layers after it: ``CostModel.with_mtp``); backward likewise. f comes from ``profiles.lookup_profile`` (measured record of the
  profile DB; else the analytic estimate, at the rate of the type's closest measured records
  where the DB measured the type at another configuration: ``scaled`` in the provenance). For
  interleaved-1f1b a device's l layers are split into V chunks by ``chunk_layers`` (chunk c
  holds l // V + (1 if c < l % V else 0) layers, Megatron layout order), the embedding on
  chunk 0 of stage 0 and the output layer on chunk V-1 of the last stage.
* a model of several layer kinds (dense and MoE, ``model.layer_kinds``), with
  ``CostModel(layer_kinds="per-kind")``: the per-layer terms are summed over the layers each
  chunk holds (``stage_layer_ranges``: Megatron's chunk-major layout order; the kinds' counts
  from ``model.kind_counts_in``), each kind at its own ``LayerCosts`` (``kind_layer_costs``:
  looked up with the kind's uniform model ``model.kind_model(i)``, so per-kind records and
  estimates are found by its signature): forward / backward per chunk, gradient bytes, the
  optimizer step (each kind at its own ms per gradient byte; the embedding / output layer at the
  first kind's), memory (``memory.stage_memory(kind_counts=...)``). The embedding and output
  layer are the first kind's model's (the same layers). ``"per-kind"`` is the default (the
  search prices the same sums: docs/search.md); ``layer_kinds="envelope"``: every layer at each
  part's maximum over the kinds. A uniform model costs the same either way (bit for bit).
* activation send s -> s+1 = ``comm.send_ms`` of b * S * h * 2 bytes (bf16) over the
  placement's slowest replica link s -> s+1, plus the cluster's per-message latency; the
  gradient back (``send_backward_ms``) the same over the links s+1 -> s, timed on its own
  (``simulator_arrays`` passes both; the interleaved wrap-around link uses ``wrap_send_ms``
  both ways).
* megatron's per-op and per-p2p-call costs (``callcosts.py``: measured by ``poseidon profile``
  / the launch's profiler, in the profile DB): ``engine_calls(b)``, charged by the simulator's
  ``EngineDAG`` on 1f1b and interleaved-1f1b (none recorded: 0, the timing of older DBs).
* DP all-reduce A_s = ``comm.allreduce_ms``, a ring over d ranks of the stage's gradient bytes:
  2(d-1)/d * bytes / bw + 2(d-1) * latency, gradient bytes = the stage's parameters on one device
  x the training setup's ``grad_bytes`` (megatron-core 0.19 accumulates and all-reduces a bf16
  model's gradients in fp32 unless ``--grad-reduce-in-bf16``: 4 bytes by default). bw = the
  ring's slowest link (``placement.ring_gbps``). With the distributed optimizer
  (``comm.dp_sync_ms``) A_s is the gradients' ring reduce-scatter plus the updated parameters'
  ring all-gather: (d-1)/d * (gradient bytes + parameter bytes) / bw + 2(d-1) * latency, the
  parameter bytes in the setup's weight dtype (bf16: half the fp32 gradients').
  ``--overlap-grad-reduce`` / ``--overlap-param-gather``: megatron-core 0.19 buckets the
  gradients only on pipeline rank 0's first model chunk (``get_model``: no bucketing for
  chunks > 0 or pp_rank > 0), so only stage 0 of a non-interleaved plan overlaps: its sync in
  ``comm.ddp_buckets`` buckets during the last micro-batch's backward (its all-gather during
  the first forward), ``comm.exposed_ms`` of it remains; every other stage's sync starts after
  its last backward, which the simulator already overlaps with the stages still running.
  An interleaved stage 0 is counted unoverlapped (its other chunks' syncs start earlier, at
  their own last backward: not modelled, so the figure errs long).
* optimizer step O_s = the stage's gradient bytes x the type's measured optimizer ms per
  gradient byte (the decoder record's ``optimizer_ms`` over its gradient bytes: Adam, the grad norm
  and the copy back scale with the parameters a device holds), / d with the distributed
  optimizer (a rank updates its 1/d shard). Where no record measured it: estimated from the
  device type's ``memory_bandwidth_gbps`` (``TrainingSetup.optimizer_step_bytes`` per
  parameter at ``MEMORY_EFFICIENCY`` of the peak), else 0; ``optimizer_source`` says which.
* per-iteration overhead X = the profile DB's ``IterationOverhead`` record of (model, sequence,
  setup, the cluster's device types) (``overhead.py``: calibrated by a live run; 0 when none):
  what an iteration takes beyond the simulated pipeline (the embedding and grad-norm
  all-reduces, Megatron's per-iteration work, replicas and stages waiting for each other), the
  same for every stage.
* post-pipeline work: the simulator's R_s is A_s + O_s + X, so the iteration time is
  max over stages of (the stage's last backward + its DP all-reduce + its optimizer step) + X.
  This folds Megatron's order (finalize: DP all-reduce; then the optimizer: grad norm, update)
  into each stage; the grad-norm all-reduce that lines the stages up before the update is part
  of X where a live run calibrated it.
* memory: ``memory.stage_memory`` of the stage under the training setup (``training.py``), with
  a measured decoder record's activation and parameter bytes when the DB has one, plus the
  device type's runtime reserve, against the device type's capacity.
* provenance: each stage carries the ``LayerProfile`` of every layer kind it runs (decoder,
  and embedding / output on the first / last stage): ``measured``, ``calibrated`` or
  ``estimated``, with its key (a scaled decoder estimate: ``calibrated`` with the measured keys
  it was scaled from, ``scaled`` in the plan).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

import numpy as np

from . import memory as memory_mod
from .callcosts import EngineCalls, engine_calls
from .comm import (allreduce_ms, alltoall_ms, ddp_buckets, dp_sync_ms, expert_alltoall_bytes,
                   expert_optimizer_ms, expert_sync_ms, reduce_scatter_ms, send_ms)
from .errors import PoseidonError
from .placement import Pool, StagePlacement, place_stages, ring_gbps, send_link_gbps, type_pools
from .profiles import (LayerProfile, ProfileKey, lookup_overhead, lookup_profile,
                       measured_decoders, tp_link_gbps)
from .tp_traffic import allgather_dispatch_values
from .training import TrainingSetup

BYTES_PER_ACTIVATION = 2   # bf16


@dataclass(frozen=True)
class LayerCosts:
    """Per-(type, tp, micro-batch) costs: one decoder layer and the first/last-stage extras."""

    forward_ms: float
    backward_ms: float
    grad_bytes: float
    embedding_forward_ms: float
    embedding_backward_ms: float
    embedding_grad_bytes: float
    output_forward_ms: float
    output_backward_ms: float
    output_grad_bytes: float
    profiles: tuple[LayerProfile, ...] = ()   # (decoder, embedding, output): provenance
    optimizer_ms_per_grad_byte: float = 0.0
    # where the optimizer step came from: ("measured" | "calibrated" (another measured record
    # of the type, per gradient byte) | "estimated" | "none", what it used)
    optimizer_source: tuple[str, str] = ("none", "")
    # expert parallelism (EP > 1, a MoE layer): the routed experts' gradient bytes on one
    # device (reduced over the expert-DP group of dp / ep ranks; not in grad_bytes, which is
    # then the attention's, router's and shared experts' part, reduced over DP); 0 otherwise
    expert_grad_bytes: float = 0.0
    alltoall_ms: float = 0.0       # the EP part of one token dispatch or combine (in forward_ms
                                   # 2x, backward_ms 2x; 4x under full recompute: the forward's
                                   # re-run): an all-to-all, or with the allgather dispatcher half
                                   # its TP x EP exchange (``CostModel.expert_dispatch_ms``)
    # the model's MTP layers (``CostModel.with_mtp``): their forward / backward per micro-batch
    # and gradient bytes, already in output_forward_ms / output_backward_ms / output_grad_bytes
    # (the last stage runs them after the output layer); 0 without MTP
    mtp_forward_ms: float = 0.0
    mtp_backward_ms: float = 0.0
    mtp_grad_bytes: float = 0.0


@dataclass(frozen=True)
class StageCosts:
    forward_ms: float
    backward_ms: float
    chunk_forward_ms: tuple[float, ...]
    chunk_backward_ms: tuple[float, ...]
    send_forward_ms: float
    send_backward_ms: float
    allreduce_ms: float
    memory_bytes: int
    memory_capacity_bytes: int
    memory: memory_mod.StageMemory | None = None        # the peak's parts
    provenance: tuple[LayerProfile, ...] = ()           # the layer kinds this stage runs
    optimizer_ms: float = 0.0
    overhead_ms: float = 0.0        # the per-iteration overhead X (every stage alike)
    optimizer_source: tuple[str, str] = ("none", "")   # LayerCosts.optimizer_source
    expert_allreduce_ms: float = 0.0   # the experts' gradient sync over expert-DP (in allreduce_ms)

    @property
    def post_pipeline_ms(self) -> float:
        """What the stage does after its last backward: DP all-reduce, then optimizer step,
        then the per-iteration overhead."""
        return self.allreduce_ms + self.optimizer_ms + self.overhead_ms


@dataclass(frozen=True)
class _StageWork:
    """What one stage computes (``CostModel._stage_work``): per model chunk forward / backward
    ms (lists: the caller adds nothing more), gradient bytes reduced over DP and over
    expert-DP, the optimizer step, and what it rests on."""

    fc: list
    bc: list
    grad_bytes: float
    expert_grad_bytes: float
    optimizer_ms: float
    optimizer_source: tuple[str, str]
    counts: tuple[int, ...] | None      # layers of each kind (per-kind costs), else None
    decoders: tuple[LayerProfile, ...]  # the decoder records of the kinds it holds
    extras: LayerCosts                  # whose embedding / output figures it used


def chunk_layers(layers: int, virtual_stages: int) -> tuple[int, ...]:
    """Decoder layers of each of a device's ``virtual_stages`` model chunks, chunk order.

    Chunk c holds ``layers // V + (1 if c < layers % V else 0)``: the counts sum to ``layers``,
    differ by at most one, and the larger chunks come first (Megatron's layout order). The one
    definition of the split: the plan's layout (``Plan.layout_segments``), the per-chunk costs
    here, and the search's Cython twin (``_search.pyx``) all follow it.
    """
    return tuple(layers // virtual_stages + (1 if c < layers % virtual_stages else 0)
                 for c in range(virtual_stages))


def optimizer_per_grad_byte(decoder, grad_per_param_byte: float) -> float:
    """Measured optimizer ms per gradient byte of a decoder record (0 when not measured)."""
    opt = float(getattr(decoder, "optimizer_ms", 0.0) or 0.0)
    grad = decoder.param_bytes * grad_per_param_byte
    return opt / grad if opt > 0.0 and grad > 0 else 0.0


MEMORY_EFFICIENCY = 0.8   # fraction of the memory's peak bandwidth a streaming kernel reaches


def estimated_optimizer_per_grad_byte(setup: TrainingSetup, memory_bandwidth_gbps: float
                                      ) -> float:
    """Optimizer ms per gradient byte from the device memory's bandwidth: the step is a
    streaming pass over the parameters' state (``TrainingSetup.optimizer_step_bytes`` per
    parameter) at ``MEMORY_EFFICIENCY`` of the peak. Gbit/s -> bytes per ms: x 1e9 / 8 / 1e3."""
    bytes_per_ms = MEMORY_EFFICIENCY * memory_bandwidth_gbps * 1.25e5
    return setup.optimizer_step_bytes / setup.grad_bytes / bytes_per_ms


def optimizer_costs(decoder, device_type, setup: TrainingSetup
                    ) -> tuple[float, tuple[str, str]]:
    """(optimizer ms per gradient byte, (source, what it used)) for a stage option: the decoder
    record's measured step, else the estimate from the type's ``memory_bandwidth_gbps``, else
    0 (source ``none``)."""
    g = setup.grad_bytes / setup.weight_bytes
    measured = optimizer_per_grad_byte(decoder, g)
    if measured > 0.0:
        return measured, ("measured", f"{decoder.key.describe()}: "
                                      f"{decoder.optimizer_ms:.3f} ms per layer")
    bw = getattr(device_type, "memory_bandwidth_gbps", None)
    if bw:
        return (estimated_optimizer_per_grad_byte(setup, bw),
                ("estimated", f"{device_type.name}: {setup.optimizer_step_bytes} bytes per "
                              f"parameter at {MEMORY_EFFICIENCY:g} x {bw:g} Gbit/s"))
    return 0.0, ("none", f"{device_type.name}: 0 ms (not measured; no "
                         "memory_bandwidth_gbps in the cluster file)")


def expert_param_bytes(model, record, tp: int, ep: int, weight_bytes: float
                       ) -> tuple[float, float]:
    """(non-expert, routed-expert) parameter bytes of one MoE layer on one device at expert
    parallelism ``ep``: the record's ``param_bytes`` less its analytic expert part at the
    record's EP (``key.ep``), and the analytic expert part / (TP x EP)."""
    split = model.layer_param_split()
    rec_ep = getattr(record.key, "ep", 1)
    rec_expert = split.expert / (tp * rec_ep) * weight_bytes
    return (max(float(record.param_bytes) - rec_expert, 0.0),
            split.expert / (tp * ep) * weight_bytes)


def optimizer_step_ms(grad_bytes: float, ms_per_grad_byte: float, dp: int,
                      sharded: bool) -> float:
    """The optimizer step of a stage's device: its gradient bytes x the measured ms per
    gradient byte; with the distributed optimizer each of the d DP ranks updates 1/d of them
    (grad norm, Adam and the copy back run on the rank's shard)."""
    return grad_bytes * ms_per_grad_byte / dp if sharded else grad_bytes * ms_per_grad_byte


LAYER_KIND_MODES = ("envelope", "per-kind")


def _measured_override(dec, model=None, tp: int = 1, ep: int = 1,
                       weight_bytes: float = 2.0) -> tuple[int | None, float | None]:
    """(activation bytes, parameter bytes) of a measured decoder record, else (None, None): as
    ``CostModel.stage_memory`` takes them (a time-only record, activation bytes 0: none).
    Expert parallelism (``ep`` > 1, ``model`` with experts): the parameter bytes at the plan's
    EP (``expert_param_bytes``: the record's non-expert part plus the experts / (TP x EP))."""
    if dec.source == "measured" and dec.activation_bytes > 0:
        if ep > 1 and model is not None and getattr(model, "num_experts", 0) \
                and dec.param_bytes and getattr(dec.key, "ep", 1) != ep:
            dense_w, expert_w = expert_param_bytes(model, dec, tp, ep, weight_bytes)
            return dec.activation_bytes, dense_w + expert_w
        return dec.activation_bytes, dec.param_bytes or None
    return None, None


def stage_layer_ranges(layers, virtual_stages: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Per stage, per model chunk, the decoder layers ``[start, stop)`` it holds: Megatron's
    layout order (chunk-major: virtual stage c * N + s), each stage's layers split by
    ``chunk_layers``."""
    n, v = len(layers), virtual_stages
    splits = [chunk_layers(l, v) for l in layers]
    out = [[None] * v for _ in range(n)]
    start = 0
    for c in range(v):
        for s in range(n):
            out[s][c] = (start, start + splits[s][c])
            start += splits[s][c]
    return tuple(tuple(r) for r in out)


def check_cp_sequence(seq_length: int, cp: int) -> None:
    """Megatron splits each sequence into 2 x CP chunks (rank r holds chunks r and 2CP-1-r,
    balancing the causal attention): the sequence length must divide by 2 x CP."""
    if cp > 1 and seq_length % (2 * cp):
        raise PoseidonError(f"context parallelism {cp}: the sequence length {seq_length} must "
                            f"be divisible by 2 x CP = {2 * cp}")


def kv_width(model) -> int:
    """Values per token of one layer's K and V together (all heads, before TP): GQA / MHA
    2 x query groups x head dim; MLA the up-projected K (heads x (qk + rope dims)) and V
    (heads x v dim), which is what Megatron's CP ring exchanges for MLA."""
    if getattr(model, "multi_latent_attention", False):
        return model.num_attention_heads * (model.qk_head_dim + model.qk_pos_emb_head_dim
                                            + model.v_head_dim)
    return 2 * model.num_query_groups * model.head_dim


def cp_attention_factor(model, *, micro_batch_size: int, seq_per_rank: int, cp: int) -> float:
    """Forward FLOPs of one layer on a CP rank over its FLOPs at seq / cp alone: the linear
    parts see seq / cp tokens either way; the causal attention core of the rank's queries over
    the whole sequence is cp times the core at seq / cp (the balanced chunks give every rank
    1 / cp of the s^2 / 2 pairs; alone it has (s / cp)^2 / 2)."""
    f = model.layer_forward_flops(micro_batch_size, seq_per_rank)
    core = model.attention.core_forward_flops(micro_batch_size, seq_per_rank)
    return (f + (cp - 1) * core) / f if f > 0 else 1.0


def cp_layer_times(model, forward_ms: float, backward_ms: float, *, micro_batch_size: int,
                   seq_per_rank: int, cp: int, tp: int, link_gbps: float, latency_ms: float
                   ) -> tuple[float, float]:
    """(forward, backward) ms of one decoder layer on a CP rank from its record at seq / cp.

    Compute: the record's times x ``cp_attention_factor`` (forward and backward alike).
    Ring exchange (Megatron's ring attention, ``cp_comm_type`` p2p): cp - 1 steps per forward,
    each sending the rank's K and V chunk (2 bytes x b x seq / cp x ``kv_width`` / tp) to the
    next CP rank while the attention of the block received before runs; the backward's steps
    send K/V and dK/dV (twice the bytes). A step's attention is 1 / cp of the rank's attention
    core, i.e. the core's share of the record (q = core / layer FLOPs at seq / cp) x the
    record's time, so each step exposes max(0, send - q x time):
    forward += (cp - 1) max(0, send - q F), backward += (cp - 1) max(0, 2 send - q B)."""
    if cp <= 1:
        return forward_ms, backward_ms
    factor = cp_attention_factor(model, micro_batch_size=micro_batch_size,
                                 seq_per_rank=seq_per_rank, cp=cp)
    f = model.layer_forward_flops(micro_batch_size, seq_per_rank)
    q = model.attention.core_forward_flops(micro_batch_size, seq_per_rank) / f if f > 0 else 0.0
    kv = float(BYTES_PER_ACTIVATION * micro_batch_size * seq_per_rank * kv_width(model)) / tp
    step_f = send_ms(kv, link_gbps, latency_ms)
    step_b = send_ms(2.0 * kv, link_gbps, latency_ms)
    exposed_f = (cp - 1) * max(0.0, step_f - q * forward_ms)
    exposed_b = (cp - 1) * max(0.0, step_b - q * backward_ms)
    return forward_ms * factor + exposed_f, backward_ms * factor + exposed_b


class CostModel:
    """Costs of one (cluster, model, profile DB, sequence length); memoised lookups."""

    def __init__(self, cluster, model, profiles=None, *, seq_length: int,
                 training: TrainingSetup | None = None, layer_kinds: str = "per-kind") -> None:
        if layer_kinds not in LAYER_KIND_MODES:
            raise ValueError(f"layer_kinds must be one of {LAYER_KIND_MODES}, got {layer_kinds!r}")
        # "per-kind": a mixed model's stage costs are the sums over the layers each stage holds
        # (``stage_costs``, ``stage_memory(kind_counts=...)``, what the search prices);
        # "envelope": every layer at each part's maximum over the kinds (an upper bound)
        self.layer_kinds = layer_kinds
        self.per_kind = (layer_kinds == "per-kind"
                         and len(getattr(model, "layer_kinds", ())) > 1)
        self.cluster = cluster
        self.model = model
        self.profiles = profiles
        self.seq_length = seq_length
        # context parallelism (``at_cp``): 1 here; a CP-scoped copy holds seq_length / cp
        # tokens per rank and keeps the training's sequence length here
        self.cp = 1
        self.full_seq_length = seq_length
        self._base = self
        self._cp_models: dict[int, "CostModel"] = {}
        self.training = training or TrainingSetup()
        # the distributed optimizer: DP sync = gradients' reduce-scatter + parameters'
        # all-gather (param bytes = gradient bytes x this), optimizer step on a 1/d shard
        self.sharded_optimizer = bool(self.training.distributed_optimizer)
        self.param_per_grad_byte = self.training.weight_bytes / self.training.grad_bytes
        self.type_names: tuple[str, ...] = cluster.type_names
        self.pools: tuple[Pool, ...] = type_pools(cluster)
        self.capacity_bytes = tuple(cluster.device_types[n].memory_bytes for n in self.type_names)
        self.reserve_bytes = tuple(cluster.device_types[n].reserve_bytes for n in self.type_names)
        self.latency_ms = float(cluster.links.latency_ms)
        self.cross_gbps = float(cluster.links.cross_type_gbps)
        self.intra_gbps = tuple(float(cluster.device_types[n].intra_node_gbps)
                                for n in self.type_names)
        self.inter_gbps = tuple(float(cluster.links.inter_node_gbps[n]) for n in self.type_names)
        self._layer_cache: dict[tuple[int, int, int], LayerCosts] = {}
        self._kind_cache: dict[tuple[int, int, int], tuple[LayerCosts, ...]] = {}
        self._mem_cache: dict[tuple, tuple[int, int]] = {}
        self._sig = model.signature() if callable(getattr(model, "signature", None)) else model.name
        self.overhead = (lookup_overhead(profiles, cluster, model, seq_length, self.training)
                         if callable(getattr(model, "signature", None)) else None)
        self.iteration_overhead_ms = self.overhead.overhead_ms if self.overhead else 0.0
        self._calls_cache: dict[int, EngineCalls] = {}

    def engine_calls(self, micro_batch_size: int) -> EngineCalls:
        """Megatron's per-op and per-call costs for plans of this micro-batch size (their
        activation message), from the profile DB (``callcosts.engine_calls``; none: zeros)."""
        hit = self._calls_cache.get(micro_batch_size)
        if hit is None:
            hit = self._calls_cache[micro_batch_size] = engine_calls(
                self.profiles, self.type_names, self.activation_bytes(micro_batch_size))
        return hit

    # ------------------------------------------------------------------ context parallelism
    def at_cp(self, cp: int) -> "CostModel":
        """The cost model of this one under context parallelism ``cp`` (``self`` for cp = 1 and
        for a model already at ``cp``): each CP rank holds seq / cp tokens, so profiles are
        looked up, activations and sends sized at seq / cp; a decoder layer's time is the
        record's at seq / cp scaled for the attention of the rank's queries over the whole
        sequence, plus the ring exchange of K/V the attention does not hide
        (``cp_layer_times``). The caller passes the stage's DP x CP group as ``dp`` (gradient
        reduce, distributed-optimizer shard and placement are over DP x CP in Megatron).
        Memoised on the unscoped model; the per-iteration overhead is the unscoped model's."""
        base = self._base
        if cp == self.cp:
            return self
        if cp == 1:
            return base
        hit = base._cp_models.get(cp)
        if hit is None:
            check_cp_sequence(base.seq_length, cp)
            hit = copy.copy(base)
            hit.cp = cp
            hit.seq_length = base.seq_length // cp
            hit._layer_cache, hit._kind_cache, hit._mem_cache = {}, {}, {}
            hit._cp_models = {}
            base._cp_models[cp] = hit
        return hit

    def cp_link_gbps(self, type_index: int, tp: int) -> float:
        """The CP ring's link on this type: intra-node when a TP x CP group fits every node of
        the type (the search offers only such options), else the type's inter-node link."""
        nodes = self.cluster.nodes_of_type(self.type_names[type_index])
        if all(n.num_devices % (tp * self.cp) == 0 for n in nodes):
            return self.intra_gbps[type_index]
        return self.inter_gbps[type_index]

    # ------------------------------------------------------------------ profiles
    def layer_costs(self, type_index: int, tp: int, micro_batch_size: int, ep: int = 1
                    ) -> LayerCosts:
        """One decoder layer of the model (a mixed model: its per-layer envelope) and the
        embedding / output layer on (type, TP, micro-batch, expert-parallel degree)."""
        key = (type_index, tp, micro_batch_size, ep)
        hit = self._layer_cache.get(key)
        if hit is not None:
            return hit
        lc = self._layer_costs_of(type_index, tp, micro_batch_size, self.model, self._sig, ep)
        if getattr(self.model, "mtp_num_layers", 0):
            # a uniform model's MTP layer is its one kind (a mixed model's envelope bounds it)
            lc = self.with_mtp(lc, lc, type_index, tp, micro_batch_size, ep)
        self._layer_cache[key] = lc
        return lc

    def kind_layer_costs(self, type_index: int, tp: int, micro_batch_size: int, ep: int = 1
                         ) -> tuple[LayerCosts, ...]:
        """Per layer kind (``model.layer_kinds`` order) its ``LayerCosts``, looked up with the
        kind's uniform model (``model.kind_model(i)``: measured per-kind records and estimates
        are found by its signature). A uniform model: ``(layer_costs(...),)``. The embedding and
        output figures of every entry are the first kind's model's (the same layers)."""
        key = (type_index, tp, micro_batch_size, ep)
        hit = self._kind_cache.get(key)
        if hit is not None:
            return hit
        if len(getattr(self.model, "layer_kinds", ())) <= 1:
            out = (self.layer_costs(type_index, tp, micro_batch_size, ep),)
        else:
            models = [memory_mod._kind_model(self.model, i)
                      for i in range(len(self.model.layer_kinds))]
            out = tuple(self._layer_costs_of(type_index, tp, micro_batch_size, m, m.signature(),
                                             ep)
                        for m in models)
            if getattr(self.model, "mtp_num_layers", 0):
                mtp = out[self.model.mtp_layer_kind]
                out = tuple(self.with_mtp(lc, mtp, type_index, tp, micro_batch_size, ep)
                            for lc in out)
        self._kind_cache[key] = out
        return out

    def _layer_costs_of(self, type_index: int, tp: int, micro_batch_size: int, model,
                        sig: str, ep: int = 1) -> LayerCosts:
        name = self.type_names[type_index]

        def prof(kind: str):
            return lookup_profile(self.profiles, self.cluster, model,
                                  ProfileKey(name, kind, tp, micro_batch_size, self.seq_length,
                                             sig, **self.training.profile_fields))

        moe_ep = ep if getattr(model, "num_experts", 0) and ep > 1 else 1
        dec = None
        if moe_ep > 1 and hasattr(self.profiles, "get"):
            # a record measured as one rank of this EP degree wins; else the EP-1 record (one
            # EP rank computes the same token-expert pairs under balanced routing)
            same = self.profiles.get(ProfileKey(name, "decoder", tp, micro_batch_size,
                                                self.seq_length, sig,
                                                **self.training.profile_fields, ep=moe_ep))
            if same is not None and same.source == "measured":
                dec = same
        if dec is None:
            dec = prof("decoder")
        emb, out = prof("embedding"), prof("output")
        # param_bytes are in the setup's dtype; the DP all-reduce moves grad_bytes per parameter
        g = self.training.grad_bytes / self.training.weight_bytes
        og, og_source = optimizer_costs(dec, self.cluster.device_types[name], self.training)
        if og_source[0] != "measured":
            og, og_source = self._optimizer_from_another_record(name, g, (og, og_source), sig)
        fwd, bwd = dec.forward_ms, dec.backward_ms
        if self.cp > 1:
            fwd, bwd = cp_layer_times(model, fwd, bwd, micro_batch_size=micro_batch_size,
                                      seq_per_rank=self.seq_length, cp=self.cp, tp=tp,
                                      link_gbps=self.cp_link_gbps(type_index, tp),
                                      latency_ms=self.latency_ms)
        if moe_ep == 1:
            return LayerCosts(fwd, bwd, dec.param_bytes * g,
                              emb.forward_ms, emb.backward_ms, emb.param_bytes * g,
                              out.forward_ms, out.backward_ms, out.param_bytes * g,
                              (dec, emb, out), og, og_source)
        dense_w, expert_w = expert_param_bytes(model, dec, tp, moe_ep,
                                               self.training.weight_bytes)
        a2a = self.expert_dispatch_ms(type_index, tp, moe_ep, micro_batch_size, model)
        # dispatch + combine each way; a full recompute re-runs the forward's two as well
        rerun = 2.0 * a2a if self.training.recompute == "full" else 0.0
        return LayerCosts(fwd + 2.0 * a2a, bwd + 2.0 * a2a + rerun, dense_w * g,
                          emb.forward_ms, emb.backward_ms, emb.param_bytes * g,
                          out.forward_ms, out.backward_ms, out.param_bytes * g, (dec, emb, out),
                          og, og_source, expert_grad_bytes=expert_w * g, alltoall_ms=a2a)

    def with_mtp(self, lc: LayerCosts, mtp_kind: LayerCosts, type_index: int, tp: int,
                 micro_batch_size: int, ep: int) -> LayerCosts:
        """``lc`` with the model's MTP layers in its output-layer figures (the last stage runs
        them after the output layer, megatron-core's ``MultiTokenPredictionBlock``).

        Per MTP layer, forward: the embedding of the shifted tokens (``lc``'s embedding), the
        2h -> h projection ``eh_proj`` (column-parallel: 2*b*s*2h*h / tp FLOPs at the type's
        rate; with sequence parallelism its 2h-wide input all-gathered and its output gathered
        over TP: ring all-gathers of 2*b*s*h and b*s*h values), one decoder layer of the MTP
        kind (``mtp_kind``'s forward, EP all-to-alls included) and the shared output layer
        with its loss (``lc``'s output). Backward: each part's backward, the projection twice
        its compute plus the same collectives, and under full recompute its forward again (the
        decoder's recompute is in its own backward). Gradient bytes: the MTP parameters on one
        device (``mtp_param_split().per_device(tp, ep)``); the routed experts' among them are
        reduced over DP here (Megatron: over expert-DP): a slight over-estimate at EP > 1."""
        model = self.model
        count = model.mtp_num_layers
        name = self.type_names[type_index]
        b, s, h = micro_batch_size, self.seq_length, model.hidden_size
        proj = 2.0 * b * s * 2 * h * h / tp / (self.cluster.device_types[name].effective_tflops
                                               * 1e12) * 1e3
        gbps = tp_link_gbps(self.cluster, name, tp)
        values = float(self.training.weight_bytes * b * s * h)
        comm = (reduce_scatter_ms(2.0 * values, tp, gbps, self.latency_ms)
                + reduce_scatter_ms(values, tp, gbps, self.latency_ms))
        rerun = proj + comm if self.training.recompute == "full" else 0.0
        fwd = count * (lc.embedding_forward_ms + proj + comm + mtp_kind.forward_ms
                       + lc.output_forward_ms)
        bwd = count * (lc.embedding_backward_ms + 2.0 * proj + comm + rerun
                       + mtp_kind.backward_ms + lc.output_backward_ms)
        moe_ep = ep if getattr(model, "num_experts", 0) else 1
        grad = model.mtp_param_split().per_device(tp, moe_ep) * self.training.grad_bytes
        return replace(lc, output_forward_ms=lc.output_forward_ms + fwd,
                       output_backward_ms=lc.output_backward_ms + bwd,
                       output_grad_bytes=lc.output_grad_bytes + grad,
                       mtp_forward_ms=fwd, mtp_backward_ms=bwd, mtp_grad_bytes=grad)

    def ep_link_gbps(self, type_index: int, tp: int, ep: int) -> float:
        """The link of an EP group on ``type_index``: its TP x EP devices (EP ranks are
        consecutive DP ranks, TP-strided) fit a node of the type when TP x EP divides every
        node's device count of the type: the intra-node link; else the inter-node one (a
        placement whose group straddles nodes anyway is not modelled)."""
        name = self.type_names[type_index]
        sizes = [n.num_devices for n in self.cluster.nodes_of_type(name)]
        if sizes and all(s % (tp * ep) == 0 for s in sizes):
            return self.intra_gbps[type_index]
        return self.inter_gbps[type_index]

    def expert_dispatch_ms(self, type_index: int, tp: int, ep: int, micro_batch_size: int,
                           model=None) -> float:
        """The EP part of one MoE layer's token dispatch or of its combine on one rank, ms (the
        layer's record holds its EP-1 figures; a direction pays this twice).

        ``alltoall`` (and the dispatchers priced as it): one token all-to-all
        (``expert_alltoall_ms``). ``allgather``: the tokens are exchanged over the TP x EP group
        in place of the record's TP group (``tp_traffic``): half of (the exchange of
        ``ep*b*s*(h + E/2)`` values over ``tp*ep`` ranks on ``ep_link_gbps`` less the record's
        exchange of ``b*s*(h + E/2)`` over ``tp`` on the TP link)."""
        model = self.model if model is None else model
        if ep <= 1 or not getattr(model, "num_experts", 0):
            return 0.0
        if getattr(self.model, "moe_token_dispatcher_type", "alltoall") != "allgather":
            return self.expert_alltoall_ms(type_index, tp, ep, micro_batch_size, model)
        w = self.training.weight_bytes

        def values(group_ep: int) -> float:
            return allgather_dispatch_values(model.hidden_size, model.num_experts,
                                             micro_batch_size, self.seq_length, group_ep)

        group = allreduce_ms(w * values(ep), tp * ep, self.ep_link_gbps(type_index, tp, ep),
                             self.latency_ms)
        name = self.type_names[type_index]
        record = allreduce_ms(w * values(1), tp, tp_link_gbps(self.cluster, name, tp),
                              self.latency_ms)
        return max(0.0, group - record) / 2.0

    def expert_alltoall_ms(self, type_index: int, tp: int, ep: int, micro_batch_size: int,
                           model=None) -> float:
        """One token all-to-all (dispatch or combine) of a MoE layer on one rank
        (``comm.expert_alltoall_bytes`` over ``ep_link_gbps``, one latency per call)."""
        model = self.model if model is None else model
        if ep <= 1 or not getattr(model, "num_experts", 0):
            return 0.0
        nbytes = expert_alltoall_bytes(micro_batch_size, self.seq_length, model.hidden_size,
                                       model.moe_top_k, tp, ep, BYTES_PER_ACTIVATION)
        return alltoall_ms(nbytes, self.ep_link_gbps(type_index, tp, ep), self.latency_ms)

    def _optimizer_from_another_record(self, name: str, g: float, fallback, sig: str):
        """The optimizer step per gradient byte of another measured decoder record of this type
        and model (another TP degree, micro-batch size or sequence length: the step streams the
        parameters' state, so its time per gradient byte does not depend on them); ``fallback``
        without one. Without it a TP degree nobody profiled would get no optimizer time while a
        profiled one pays its measured step."""
        if self.profiles is None or not hasattr(self.profiles, "profiles"):
            return fallback
        timed = [p for p in measured_decoders(self.profiles, sig, self.training)
                 if p.key.device_type == name and (p.optimizer_ms or 0.0) > 0.0]
        if not timed:
            return fallback
        best = min(timed, key=lambda p: (p.key.tp, p.key.micro_batch_size))
        return optimizer_per_grad_byte(best, g), (
            "calibrated", f"{best.key.describe()}: {best.optimizer_ms:.3f} ms per layer, "
                          "per gradient byte")

    def activation_bytes(self, micro_batch_size: int) -> float:
        return float(BYTES_PER_ACTIVATION * micro_batch_size * self.seq_length
                     * self.model.hidden_size)

    # ------------------------------------------------------------------ memory
    def stage_memory(self, *, layers: int, stage: int, num_stages: int, tp: int, dp: int,
                     micro_batch_size: int, num_microbatches: int, schedule: str,
                     virtual_stages: int, type_index: int | None = None,
                     kind_counts: tuple[int, ...] | None = None, ep: int = 1
                     ) -> memory_mod.StageMemory:
        """The stage's memory under the training setup; with ``type_index``, the type's measured
        decoder record (activation and parameter bytes) when there is one, and its reserve.
        ``kind_counts`` (layers of each kind the device holds): with ``layer_kinds="per-kind"``
        and a mixed model, each kind at its own figures (its measured record per kind)."""
        act = par = None
        reserve = 0
        if self.per_kind and kind_counts is not None:
            overrides = None
            if type_index is not None:
                w = self.training.weight_bytes
                overrides = tuple(
                    _measured_override(lc.profiles[0], memory_mod._kind_model(self.model, i)
                                       if ep > 1 else None, tp, ep, w)
                    for i, lc in enumerate(self.kind_layer_costs(type_index, tp,
                                                                 micro_batch_size, ep)))
                reserve = self.reserve_bytes[type_index]
            return memory_mod.stage_memory(
                self.model, layers=layers, stage=stage, num_stages=num_stages, tp=tp, dp=dp,
                micro_batch_size=micro_batch_size, seq_length=self.seq_length,
                num_microbatches=num_microbatches, schedule=schedule,
                virtual_stages=virtual_stages, setup=self.training, reserve_bytes=reserve,
                kind_counts=tuple(kind_counts), kind_overrides=overrides, ep=ep,
                sequence_parallel=self.sequence_parallel(tp))
        if type_index is not None:
            dec = self.layer_costs(type_index, tp, micro_batch_size, ep).profiles[0]
            # 0 activation bytes: a time-only record
            act, par = _measured_override(dec, self.model, tp, ep, self.training.weight_bytes)
            reserve = self.reserve_bytes[type_index]
        return memory_mod.stage_memory(
            self.model, layers=layers, stage=stage, num_stages=num_stages, tp=tp, dp=dp,
            micro_batch_size=micro_batch_size, seq_length=self.seq_length,
            num_microbatches=num_microbatches, schedule=schedule,
            virtual_stages=virtual_stages, setup=self.training,
            layer_activation_bytes_override=act, layer_param_bytes_override=par,
            reserve_bytes=reserve, ep=ep, sequence_parallel=self.sequence_parallel(tp))

    def sequence_parallel(self, tp: int) -> bool:
        """Whether the plan trains with ``--sequence-parallel`` at TP ``tp``: a model with
        experts at TP > 1 (``Plan._expert_args``; megatron-core requires it), so its memory
        is priced with the norms' and dropouts' activations sharded over TP."""
        return tp > 1 and bool(getattr(self.model, "num_experts", 0))

    def stage_memory_bytes(self, *, layers: int, stage: int, num_stages: int, tp: int, dp: int,
                           micro_batch_size: int, num_microbatches: int, schedule: str,
                           virtual_stages: int, type_index: int | None = None,
                           kind_counts: tuple[int, ...] | None = None, ep: int = 1) -> int:
        return self.stage_memory(
            layers=layers, stage=stage, num_stages=num_stages, tp=tp, dp=dp,
            micro_batch_size=micro_batch_size, num_microbatches=num_microbatches,
            schedule=schedule, virtual_stages=virtual_stages, type_index=type_index,
            kind_counts=kind_counts, ep=ep).total_bytes

    def max_layers(self, *, capacity_bytes: int, stage: int, num_stages: int, tp: int, dp: int,
                   micro_batch_size: int, num_microbatches: int, schedule: str,
                   virtual_stages: int, limit: int, type_index: int | None = None,
                   ep: int = 1) -> int:
        """Largest l <= limit whose stage memory fits (0 if none); memory is monotone in l.

        Memoised on what ``memory.stage_memory`` depends on: (first, last, in-flight count) of the
        stage position, tp, dp, micro-batch, schedule, V, capacity. The memo holds the largest
        fitting l up to the model's layer count, so every ``limit`` shares it (monotonicity:
        the answer for ``limit`` is min(that, limit)).
        """
        return self.max_layers_by_stage(
            capacity_bytes=capacity_bytes, stages=(stage,), num_stages=num_stages, tp=tp, dp=dp,
            micro_batch_size=micro_batch_size, num_microbatches=num_microbatches,
            schedule=schedule, virtual_stages=virtual_stages, limit=limit,
            type_index=type_index, ep=ep)[0]

    def max_layers_by_stage(self, *, capacity_bytes: int, stages, num_stages: int, tp: int,
                            dp: int, micro_batch_size: int, num_microbatches: int,
                            schedule: str, virtual_stages: int, limit: int,
                            type_index: int | None = None, ep: int = 1) -> list[int]:
        """``max_layers`` of each stage in ``stages``, the memo looked up in one loop (the
        search asks for every (option, stage) of every configuration)."""
        if limit < 1:
            return [0] * len(stages)
        out = []
        for stage in stages:
            inflight = memory_mod.microbatches_in_flight(schedule, stage, num_stages,
                                                         num_microbatches, virtual_stages)
            key = (capacity_bytes, stage == 0, stage == num_stages - 1, num_stages == 1,
                   inflight, tp, dp, micro_batch_size, schedule, virtual_stages, type_index, ep)
            hit = self._mem_cache.get(key)
            # (largest fitting l up to the searched limit, that limit): exact for every limit up
            # to the searched one, and for any limit when memory stopped it below that limit
            if hit is not None and (limit <= hit[1] or hit[0] < hit[1]):
                out.append(min(hit[0], limit))
            else:
                out.append(self._max_layers_miss(
                    key, capacity_bytes=capacity_bytes, stage=stage, num_stages=num_stages,
                    tp=tp, dp=dp, micro_batch_size=micro_batch_size,
                    num_microbatches=num_microbatches, schedule=schedule,
                    virtual_stages=virtual_stages, limit=limit, type_index=type_index, ep=ep))
        return out

    def max_layers_from(self, start: int, *, capacity_bytes: int, stage: int, num_stages: int,
                        tp: int, dp: int, micro_batch_size: int, num_microbatches: int,
                        schedule: str, limit: int, type_index: int | None = None,
                        ep: int = 1) -> int:
        """Largest l <= limit (and <= L - start) such that a stage holding decoder layers
        ``[start, start + l)`` fits ``capacity_bytes`` (0 if none), one model chunk (V = 1: a
        stage's layers are then one range, its start the layers of the stages before it).

        With ``layer_kinds="per-kind"`` and a mixed model the memory counts each kind held
        (a MoE layer is larger than a dense one); otherwise it is ``max_layers`` (the layers'
        envelope, independent of ``start``). Memory grows with l (every kind adds bytes), so
        the answer is a binary search; memoised per (stage position, tp, dp, micro-batch,
        schedule, capacity, type, start)."""
        L = self.model.num_layers
        if not 0 <= start <= L:
            raise ValueError(f"start {start} outside 0..{L}")
        limit = min(limit, L - start)
        if not self.per_kind:
            return self.max_layers(capacity_bytes=capacity_bytes, stage=stage,
                                   num_stages=num_stages, tp=tp, dp=dp,
                                   micro_batch_size=micro_batch_size,
                                   num_microbatches=num_microbatches, schedule=schedule,
                                   virtual_stages=1, limit=limit, type_index=type_index,
                                   ep=ep)
        if limit < 1:
            return 0
        row = self.max_layers_row(capacity_bytes=capacity_bytes, stage=stage,
                                  num_stages=num_stages, tp=tp, dp=dp,
                                  micro_batch_size=micro_batch_size,
                                  num_microbatches=num_microbatches, schedule=schedule,
                                  type_index=type_index, ep=ep)
        return min(row[start], limit)

    def max_layers_row(self, *, capacity_bytes: int, stage: int, num_stages: int, tp: int,
                       dp: int, micro_batch_size: int, num_microbatches: int, schedule: str,
                       type_index: int | None = None, ep: int = 1) -> tuple[int, ...]:
        """``max_layers_from`` of every first layer a = 0..L (no limit but L - a), a model of
        several layer kinds: memoised on what the memory depends on (stage position, tp, dp,
        micro-batch, schedule, capacity, type); within it, whether a stage fits is memoised
        on its kinds' counts (the memory depends on nothing else), so a row costs few memory
        evaluations (DeepSeek-V3: at most 4 x 59 count pairs)."""
        L = self.model.num_layers
        inflight = memory_mod.microbatches_in_flight(schedule, stage, num_stages,
                                                     num_microbatches, 1)
        key = ("row", capacity_bytes, stage == 0, stage == num_stages - 1, num_stages == 1,
               inflight, tp, dp, micro_batch_size, schedule, type_index, ep)
        hit = self._mem_cache.get(key)
        if hit is not None:
            return hit
        kw = dict(stage=stage, num_stages=num_stages, tp=tp, dp=dp,
                  micro_batch_size=micro_batch_size, num_microbatches=num_microbatches,
                  schedule=schedule, virtual_stages=1, type_index=type_index, ep=ep)
        seen: dict[tuple[int, ...], bool] = {}

        def fits(a: int, l: int) -> bool:
            counts = self.model.kind_counts_in(a, a + l)
            got = seen.get(counts)
            if got is None:
                got = seen[counts] = self.stage_memory_bytes(
                    layers=l, kind_counts=counts, **kw) <= capacity_bytes
            return got

        row = []
        prev = 0
        for a in range(L + 1):
            # [a, a + prev - 1) is inside [a - 1, a - 1 + prev), which fits: start there
            lo = max(prev - 1, 0)           # fits(a, lo) (or lo = 0)
            hi = L - a
            if lo < hi and fits(a, lo + 1):
                lo += 1
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    if fits(a, mid):
                        lo = mid
                    else:
                        hi = mid - 1
            row.append(lo)
            prev = lo
        hit = self._mem_cache[key] = tuple(row)
        return hit

    def _max_layers_miss(self, key, *, capacity_bytes: int, stage: int, num_stages: int, tp: int,
                         dp: int, micro_batch_size: int, num_microbatches: int, schedule: str,
                         virtual_stages: int, limit: int, type_index: int | None,
                         ep: int = 1) -> int:
        """``max_layers`` computed (a memo miss): stored under ``key``."""
        requested, limit = limit, max(limit, self.model.num_layers)

        seen: dict[int, int] = {}

        def mem(l: int) -> int:
            if l not in seen:
                seen[l] = self.stage_memory_bytes(
                    layers=l, stage=stage, num_stages=num_stages, tp=tp, dp=dp,
                    micro_batch_size=micro_batch_size, num_microbatches=num_microbatches,
                    schedule=schedule, virtual_stages=virtual_stages, type_index=type_index,
                    ep=ep)
            return seen[l]

        if limit < 1 or mem(1) > capacity_bytes:
            result = 0
        elif limit == 1:
            result = 1
        else:
            # memory is affine in l up to byte rounding: a guess from the slope, then checked
            m1 = mem(1)
            slope = max(mem(2) - m1, 1)
            guess = 1 + (capacity_bytes - m1) // slope
            if guess >= limit and mem(limit) <= capacity_bytes:
                result = limit
            else:
                lo, hi = 1, limit          # mem(lo) fits; mem(hi) does not, or hi = limit
                guess = min(max(guess, 1), limit - 1)
                if mem(guess) <= capacity_bytes:
                    lo = guess
                    hi = guess + 1 if mem(guess + 1) > capacity_bytes else hi
                else:
                    hi = guess
                if hi == limit and mem(limit) <= capacity_bytes:
                    lo = limit
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    if mem(mid) <= capacity_bytes:
                        lo = mid
                    else:
                        hi = mid
                result = lo
        self._mem_cache[key] = (result, limit)
        return min(result, requested)

    # ------------------------------------------------------------------ a concrete plan
    def stage_costs(self, *, stage_types, stage_tps, layers, dp: int, micro_batch_size: int,
                    num_microbatches: int, schedule: str, virtual_stages: int, ep: int = 1
                    ) -> tuple[tuple[StageCosts, ...], tuple[StagePlacement, ...],
                               tuple[tuple[int, int], ...]]:
        """Costs, placement and unused slots of one fully specified pipeline: per stage its
        compute (``_stage_work``), DP / expert-DP sync (``_stage_sync``), memory and sends
        (``_stage_sends``)."""
        n, v = len(layers), virtual_stages
        placements, unused = place_stages(self.pools, stage_types, stage_tps, dp)
        sends, sends_back = self._stage_sends(placements, micro_batch_size, v)
        ranges = stage_layer_ranges(layers, v) if self.per_kind else None
        out = []
        for s in range(n):
            k, t, l = stage_types[s], stage_tps[s], layers[s]
            w = self._stage_work(s, n, k, t, l, None if ranges is None else ranges[s], dp=dp,
                                 micro_batch_size=micro_batch_size, ep=ep, virtual_stages=v)
            ar, ear = self._stage_sync(s, v, w, dp, ep, placements[s])
            mem = self.stage_memory(layers=l, stage=s, num_stages=n, tp=t, dp=dp,
                                    micro_batch_size=micro_batch_size,
                                    num_microbatches=num_microbatches, schedule=schedule,
                                    virtual_stages=v, type_index=k, kind_counts=w.counts, ep=ep)
            kinds = w.decoders + ((w.extras.profiles[1],) if s == 0 else ()) \
                + ((w.extras.profiles[2],) if s == n - 1 else ())
            out.append(StageCosts(
                forward_ms=float(sum(w.fc)), backward_ms=float(sum(w.bc)),
                chunk_forward_ms=tuple(w.fc), chunk_backward_ms=tuple(w.bc),
                send_forward_ms=sends[s] if s < n - 1 else 0.0,
                send_backward_ms=sends_back[s] if s < n - 1 else 0.0,
                allreduce_ms=ar, memory_bytes=mem.total_bytes,
                memory_capacity_bytes=self.capacity_bytes[k], memory=mem, provenance=kinds,
                optimizer_ms=w.optimizer_ms, overhead_ms=self.iteration_overhead_ms,
                optimizer_source=w.optimizer_source, expert_allreduce_ms=ear))
        return tuple(out), placements, unused

    def _stage_sends(self, placements, micro_batch_size: int, virtual_stages: int
                     ) -> tuple[list[float], list[float]]:
        """(activation send s -> s+1, its gradient back s+1 -> s) per stage boundary, each over
        its own slowest link; interleaved: the wrap-around send appended to the forward list."""
        act = self.activation_bytes(micro_batch_size)
        sends, sends_back = [], []
        for s in range(len(placements) - 1):
            sends.append(send_ms(act, send_link_gbps(self.cluster, placements[s],
                                                     placements[s + 1]), self.latency_ms))
            sends_back.append(send_ms(act, send_link_gbps(self.cluster, placements[s + 1],
                                                          placements[s]), self.latency_ms))
        if virtual_stages > 1:
            sends.append(send_ms(act, send_link_gbps(self.cluster, placements[-1],
                                                     placements[0]), self.latency_ms))
        return sends, sends_back

    def _stage_work(self, s: int, n: int, k: int, t: int, l: int, ranges, *, dp: int,
                    micro_batch_size: int, ep: int, virtual_stages: int) -> "_StageWork":
        """What stage ``s`` of ``n`` computes: per model chunk forward / backward (its decoder
        layers, the embedding on stage 0's first chunk, the output layer and MTP on the last
        stage's last chunk), its gradient bytes (DP and expert-DP) and optimizer step.
        ``ranges``: the chunks' layer ranges (per-kind costs), None: ``l`` layers of the
        model's envelope split by ``chunk_layers``."""
        v = virtual_stages
        if ranges is None:
            lc = self.layer_costs(k, t, micro_batch_size, ep)
            chunks = chunk_layers(l, v)
            fc = [c * lc.forward_ms for c in chunks]
            bc = [c * lc.backward_ms for c in chunks]
            grad = l * lc.grad_bytes
            egrad = l * lc.expert_grad_bytes
            eopt = (expert_optimizer_ms(egrad, lc.optimizer_ms_per_grad_byte, dp, ep,
                                        self.sharded_optimizer) if egrad else 0.0)
            grad, _ = self._first_last_extras(s, n, lc, fc, bc, grad)
            opt = optimizer_step_ms(grad, lc.optimizer_ms_per_grad_byte, dp,
                                    self.sharded_optimizer) + eopt
            return _StageWork(fc, bc, grad, egrad, opt, lc.optimizer_source, None,
                              (lc.profiles[0],), lc)
        # the layers each chunk holds, each kind at its own per-layer costs; the embedding /
        # output layer and their optimizer rate: the first kind's model's
        kcs = self.kind_layer_costs(k, t, micro_batch_size, ep)
        lc = kcs[0]
        chunk_counts = [self.model.kind_counts_in(a, b) for a, b in ranges]
        counts = tuple(sum(cc[i] for cc in chunk_counts) for i in range(len(kcs)))
        fc = [sum(c * kc.forward_ms for c, kc in zip(cc, kcs)) for cc in chunk_counts]
        bc = [sum(c * kc.backward_ms for c, kc in zip(cc, kcs)) for cc in chunk_counts]
        decoder_grads = [c * kc.grad_bytes for c, kc in zip(counts, kcs)]
        grad = sum(decoder_grads)
        # as the search's Cython twin: per kind its step, then its experts' step
        opt = egrad = 0.0
        for c, gk, kc in zip(counts, decoder_grads, kcs):
            opt += optimizer_step_ms(gk, kc.optimizer_ms_per_grad_byte, dp,
                                     self.sharded_optimizer)
            if kc.expert_grad_bytes:
                ek = c * kc.expert_grad_bytes
                egrad += ek
                opt += expert_optimizer_ms(ek, kc.optimizer_ms_per_grad_byte, dp, ep,
                                           self.sharded_optimizer)
        held = [kc for c, kc in zip(counts, kcs) if c]
        grad, extra = self._first_last_extras(s, n, lc, fc, bc, grad)
        if extra:
            opt += optimizer_step_ms(extra, lc.optimizer_ms_per_grad_byte, dp,
                                     self.sharded_optimizer)
        return _StageWork(fc, bc, grad, egrad, opt, (held or kcs)[0].optimizer_source, counts,
                          tuple(kc.profiles[0] for c, kc in zip(counts, kcs) if c), lc)

    @staticmethod
    def _first_last_extras(s: int, n: int, lc: LayerCosts, fc: list, bc: list, grad: float
                           ) -> tuple[float, float]:
        """The embedding on stage 0's first chunk and the output layer (with MTP) on the last
        stage's last chunk, added to ``fc`` / ``bc`` in place: (``grad`` plus their gradient
        bytes, their gradient bytes), summed in the search's order."""
        extra = 0.0
        if s == 0:
            fc[0] += lc.embedding_forward_ms
            bc[0] += lc.embedding_backward_ms
            grad += lc.embedding_grad_bytes
            extra += lc.embedding_grad_bytes
        if s == n - 1:
            fc[-1] += lc.output_forward_ms
            bc[-1] += lc.output_backward_ms
            grad += lc.output_grad_bytes
            extra += lc.output_grad_bytes
        return grad, extra

    def _stage_sync(self, s: int, v: int, w: "_StageWork", dp: int, ep: int, placement
                    ) -> tuple[float, float]:
        """(the stage's gradient sync, of it the experts' over expert-DP) per iteration."""
        ar = 0.0
        grad = w.grad_bytes
        if dp > 1:
            # Megatron buckets only pipeline rank 0's first chunk: there the sync
            # overlaps the last micro-batch's backward (and the all-gather the next
            # forward); elsewhere it starts after the stage's last backward, as modelled
            gw = pw = 0.0
            buckets = 1
            if s == 0 and v == 1:
                if self.training.overlap_grad_reduce:
                    gw = w.bc[0]
                if self.training.overlap_param_gather:
                    pw = w.fc[0]
                if gw or pw:
                    buckets = ddp_buckets(grad / self.training.grad_bytes, dp,
                                          self.training.ddp_bucket_size)
            ar = dp_sync_ms(grad, grad * self.param_per_grad_byte, dp,
                            ring_gbps(self.cluster, placement), self.latency_ms,
                            self.sharded_optimizer, buckets, gw, pw)
        ear = 0.0
        egrad = w.expert_grad_bytes
        if egrad and dp // ep > 1:
            ear = expert_sync_ms(egrad, egrad * self.param_per_grad_byte, dp, ep,
                                 ring_gbps(self.cluster, placement), self.latency_ms,
                                 self.sharded_optimizer)
        return ar + ear, ear

    def wrap_send_ms(self, placements, micro_batch_size: int) -> float:
        return send_ms(self.activation_bytes(micro_batch_size),
                       send_link_gbps(self.cluster, placements[-1], placements[0]),
                       self.latency_ms)


def simulator_arrays(stages, virtual_stages: int, wrap_send_ms: float = 0.0):
    """(F, B, Pf, Pb, R) in the simulator's layout (per-chunk arrays of shape (V, N) if V > 1)
    of ``StageCosts`` (or a plan's ``StagePlan``s); R[s] is the stage's post-pipeline work (DP
    all-reduce + optimizer step + per-iteration overhead). ``Pb[s]`` is the stage's own
    ``send_backward_ms`` (the gradient s+1 -> s); the wrap-around link (interleaved) is
    ``wrap_send_ms`` both ways."""
    v = virtual_stages
    if v > 1:
        F = np.array([[st.chunk_forward_ms[c] for st in stages] for c in range(v)])
        B = np.array([[st.chunk_backward_ms[c] for st in stages] for c in range(v)])
        Pf = np.array([st.send_forward_ms for st in stages[:-1]] + [wrap_send_ms])
        Pb = np.array([st.send_backward_ms for st in stages[:-1]] + [wrap_send_ms])
    else:
        F = np.array([st.forward_ms for st in stages])
        B = np.array([st.backward_ms for st in stages])
        Pf = np.array([st.send_forward_ms for st in stages[:-1]])
        Pb = np.array([st.send_backward_ms for st in stages[:-1]])
    R = np.array([st.post_pipeline_ms for st in stages])
    return F, B, Pf, Pb, R
