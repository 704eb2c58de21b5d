"""Outer configurations and their root bounds.

An outer configuration fixes what the branch and bound does not choose: schedule, interleaving
depth V, micro-batch size b, DP degree d (M = G / (d b) micro-batches), pipeline depth N and the
stage options (device type, TP degree) a stage may use (one TP for every stage, or per stage).
``enumerate_configs`` lists them; ``root_bound`` bounds every plan of one from below (the search
visits configurations by it and skips those whose bound passes the incumbent);
``bound_structure`` gives the per-stage schedule constants the stage-level bound needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import NamedTuple

import numpy as np

from ..comm import send_ms
from ..costs import CostModel, chunk_layers
from ..errors import PoseidonError
from ..simulator.schedules import SCHEDULES, op_orders, validate_schedule
from . import _roots, _search
from .options import SearchOptions, tp_candidates
from .rules import Shape, excluded_line


@dataclass(frozen=True)
class OuterConfig:
    schedule: str
    virtual_stages: int
    micro_batch_size: int
    dp: int
    num_microbatches: int
    num_stages: int
    tp: int                       # 0 = per-stage TP
    options: tuple[tuple[int, int], ...]   # (type index, tp) a stage may use
    cp: int = 1                   # context parallelism: each rank holds seq / cp tokens
    ep: int = 1                   # expert-parallel degree (1: every expert on every device)
    # a model of several layer kinds, interleaved (V > 1): the layers of each model chunk over
    # all stages (``chunk_totals``); () otherwise
    chunk_totals: tuple[int, ...] = ()

    @property
    def key(self) -> tuple:
        """Deterministic order between configurations (the tie-break of equal plans); CP
        and EP only where one is > 1 (then both: the key stays comparable), so a CP-1, EP-1
        configuration's key is as before."""
        return (SCHEDULES.index(self.schedule), self.virtual_stages,
                self.micro_batch_size, self.dp, self.tp, self.num_stages) \
            + ((self.cp, self.ep) if self.cp > 1 or self.ep > 1 else ()) \
            + self.chunk_totals

    @property
    def dp_cp(self) -> int:
        """TP groups per stage, DP x CP: the devices a stage takes are dp_cp x its TP, and
        Megatron reduces gradients (and shards the distributed optimizer) over DP x CP."""
        return self.dp * self.cp

    @property
    def usable_types(self) -> int:
        return len({k for k, _ in self.options})

    def type_sequences_restricted(self, type_order: str, type_sequence_limit: int) -> bool:
        """Whether this configuration's type sequences are only contiguous blocks under
        ``type_order`` (and that is a real restriction: >= 2 usable types, N >= 2)."""
        if self.num_stages < 2 or self.usable_types < 2:
            return False
        if type_order == "auto":
            return self.usable_types ** self.num_stages > type_sequence_limit
        return type_order == "blocks"


# --------------------------------------------------------------------------- enumeration

def cp_candidates(cluster, seq_length: int, allowed=None) -> tuple[int, ...]:
    """CP degrees a search tries: ``allowed`` (None: 1 only), those dividing the sequence into
    2 x CP chunks and no larger than the largest node (a TP x CP group stays in one node)."""
    if allowed is None:
        return (1,)
    most = max(n.num_devices for n in cluster.nodes)
    return tuple(c for c in sorted(set(allowed))
                 if c == 1 or (seq_length % (2 * c) == 0 and c <= most))


def _cp_option_groups(cluster, cm_types, groups, cp: int):
    """``_option_groups`` at context parallelism ``cp`` > 1: uniform-TP groups only, each
    option (k, t) kept where t x cp divides every node of type k (the CP ring stays inside a
    node, and Megatron's consecutive TP groups of a CP group never straddle two)."""
    sizes = [[n.num_devices for n in cluster.nodes_of_type(name)] for name in cm_types]
    out = []
    for t, opts in groups:
        keep = tuple((k, tt) for k, tt in opts if all(s % (tt * cp) == 0 for s in sizes[k]))
        if keep:
            out.append((t, keep))
    return out


def _divisors(x: int) -> list[int]:
    return [d for d in range(1, x + 1) if x % d == 0]


def ep_candidates(model, dp: int, allowed=None) -> tuple[int, ...]:
    """Expert-parallel degrees a configuration may use, ``dp`` its DP x CP degree (Megatron's
    rules with expert-TP = TP: a stage's TP x CP x DP devices form the expert grid
    ETP x EP x expert-DP, megatron-core 0.19's ``initialize_model_parallel`` setting expert-DP
    = world / (ETP x EP x PP) = DP x CP / EP, so EP divides DP x CP, and EP divides the routed
    experts): (1,) for a model without experts; only those in ``allowed`` when given."""
    experts = int(getattr(model, "num_experts", 0) or 0)
    if experts <= 0:
        return (1,)
    return tuple(e for e in _divisors(dp)
                 if experts % e == 0 and (allowed is None or e in allowed))


def chunk_totals_of(layers, virtual_stages: int) -> tuple[int, ...]:
    """The layers of each model chunk over all stages of a split (``costs.chunk_layers``)."""
    splits = [chunk_layers(l, virtual_stages) for l in layers]
    return tuple(sum(sp[c] for sp in splits) for c in range(virtual_stages))


@lru_cache(maxsize=256)
def chunk_total_vectors(num_layers: int, num_stages: int, virtual_stages: int
                        ) -> tuple[tuple[int, ...], ...]:
    """Every (S_0, ..., S_{V-1}) a pipeline of N stages, each holding >= V layers split by
    ``costs.chunk_layers``, can give its model chunks: S_c = sum_s l_s // V + #{s: l_s % V > c}.
    With r_j stages of l_s % V = j (r_0 + ... + r_{V-1} = N) and Q = sum_s l_s // V >= N,
    S_c = Q + r_{c+1} + ... + r_{V-1}, and L = V Q + sum_j j r_j fixes Q. A model of several
    layer kinds searches one configuration per vector: its chunk-major layout places chunk c
    of stage x after every layer of chunks < c (``docs/search.md``)."""
    L, n, v = num_layers, num_stages, virtual_stages
    out = set()

    def rec(j: int, left: int, rs: list[int]) -> None:
        if j == v - 1:
            rs = rs + [left]
            rest = L - sum(i * r for i, r in enumerate(rs))
            if rest >= v * n and rest % v == 0:
                q = rest // v
                out.add(tuple(q + sum(rs[c + 1:]) for c in range(v)))
            return
        for r in range(left + 1):
            rec(j + 1, left - r, rs + [r])

    rec(0, n, [])
    return tuple(sorted(out, reverse=True))


def _option_groups(tps: list[tuple[int, ...]], tp_mode: str) -> list[tuple[int, tuple]]:
    """(tp, stage options) per TP group: one group per TP degree (uniform TP, tp > 0) or one
    group with every (type, tp) pair (per-stage TP, tp = 0)."""
    if tp_mode == "uniform":
        all_t = sorted({t for ts in tps for t in ts})
        return [(t, tuple((k, t) for k in range(len(tps)) if t in tps[k])) for t in all_t]
    return [(0, tuple((k, t) for k in range(len(tps)) for t in tps[k]))]


def enumerate_configs(cm: CostModel, options: SearchOptions) -> list[OuterConfig]:
    """Every outer configuration of the search space ``options`` describes on ``cm``'s
    cluster: G = d b M, N up to what the devices (d x smallest TP per stage) and the layers
    (V per stage) allow, interleaving only where megatron-core accepts (N, M, V), none the
    framework's rules (``options.rules``) refuse."""
    return enumerate_with_exclusions(cm, options)[0]


def enumerate_with_exclusions(cm: CostModel, options: SearchOptions
                              ) -> tuple[list[OuterConfig], list[str]]:
    """``enumerate_configs`` and one line per class of configurations ``options.rules``
    excluded from it (``interleaved-1f1b pp=2 excluded: Megatron requires pp > 2 with
    --no-overlap-p2p-communication``), in the order first met."""
    cluster, model = cm.cluster, cm.model
    rules = options.rules
    L = model.num_layers
    tps = [tp_candidates(cluster, model, name, options.tp_degrees) for name in cm.type_names]
    lines = rules.tp_lines([t for ts in tps for t in ts])
    tps = [tuple(t for t in ts if rules.tp_allowed(t)) for ts in tps]
    ndev = [p.size for p in cm.pools]
    G = options.global_batch_size
    out: list[OuterConfig] = []
    cps = cp_candidates(cluster, options.seq_length, options.context_parallel)
    uniform_groups = _option_groups(tps, "uniform")
    for sched in options.schedules:
        vs = range(2, options.max_virtual_stages + 1) if sched == "interleaved-1f1b" else (1,)
        for v in vs:
            for b in options.micro_batch_sizes:
                for d in _divisors(G):
                    if G % (d * b):
                        continue
                    m = G // (d * b)
                    groups = []
                    for c in cps:
                        groups += ([(1, t, opts) for t, opts in
                                    _option_groups(tps, options.tp_mode)] if c == 1 else
                                   [(c, t, opts) for t, opts in _cp_option_groups(
                                       cluster, cm.type_names, uniform_groups, c)])
                    # expert parallelism: every EP degree valid for this DP x CP
                    # (``ep_candidates``: Megatron's expert-DP is DP x CP / EP)
                    groups = [(c, e, t, opts) for c, t, opts in groups if opts
                              for e in ep_candidates(model, d * c, options.expert_parallel)]
                    for c, e, t, opts in groups:
                        cap = 0
                        for k in range(len(tps)):
                            tk = [tt for (kk, tt) in opts if kk == k]
                            if tk:
                                cap += ndev[k] // (d * c * min(tk))
                        for n in range(1, min(cap, L // v) + 1):
                            if v > 1:
                                try:
                                    validate_schedule(sched, n, m, v)
                                except PoseidonError:
                                    continue
                            cfg = OuterConfig(sched, v, b, d, m, n, t, opts, c, e)
                            if rules:
                                hit = rules.violation(Shape.of_config(cfg))
                                if hit is not None:
                                    line = excluded_line(*hit)
                                    if line not in lines:
                                        lines.append(line)
                                    continue
                            if v > 1 and cm.per_kind:
                                out += [replace(cfg, chunk_totals=ct)
                                        for ct in chunk_total_vectors(L, n, v)]
                            else:
                                out.append(cfg)
    return out, lines


# --------------------------------------------------------------------------- option costs

@dataclass(frozen=True)
class OptionCosts:
    """Per stage option of a configuration (same order as ``OuterConfig.options``): one
    layer's forward/backward ms and gradient bytes, and the embedding / output-layer extras."""

    f: tuple[float, ...]
    b: tuple[float, ...]
    ef: tuple[float, ...]
    eb: tuple[float, ...]
    of: tuple[float, ...]
    ob: tuple[float, ...]
    gl: tuple[float, ...]
    ge: tuple[float, ...]
    go: tuple[float, ...]
    og: tuple[float, ...] = ()   # optimizer ms per gradient byte (empty: none)
    # a model of several layer kinds (``CostModel.per_kind``): per option, per kind, one
    # layer's (forward, backward, gradient bytes, optimizer ms per gradient byte); f, b and gl
    # are then each option's minimum over the kinds (per-layer lower bounds for the bounds),
    # the embedding / output figures and og the first kind's (as ``CostModel.stage_costs``)
    kinds: tuple[tuple[tuple[float, float, float, float], ...], ...] = ()
    # expert parallelism (EP > 1): one layer's routed-expert gradient bytes per option (xg), and
    # per option, per kind (kxg, a model of several kinds); () when no option has any
    xg: tuple[float, ...] = ()
    kxg: tuple[tuple[float, ...], ...] = ()

    @classmethod
    def of_config(cls, cm: CostModel, cfg: OuterConfig) -> "OptionCosts":
        """The option costs of ``cfg``: they depend only on its options, micro-batch size, CP
        and EP, so configurations sharing those share one value (memoised on ``cm``)."""
        memo = cm.__dict__.setdefault("_option_costs_memo", {})
        key = (cfg.options, cfg.micro_batch_size, cfg.cp, cfg.ep)
        hit = memo.get(key)
        if hit is None:
            hit = memo[key] = cls._of_config(cm, cfg)
        return hit

    @classmethod
    def _of_config(cls, cm: CostModel, cfg: OuterConfig) -> "OptionCosts":
        cm = cm.at_cp(cfg.cp)
        ep = cfg.ep
        if cm.per_kind:
            kcs = [cm.kind_layer_costs(k, t, cfg.micro_batch_size, ep) for (k, t) in cfg.options]
            kxg = tuple(tuple(lc.expert_grad_bytes for lc in kc) for kc in kcs)
            lcs = [kc[0] for kc in kcs]
            kinds = tuple(tuple((lc.forward_ms, lc.backward_ms, lc.grad_bytes,
                                 lc.optimizer_ms_per_grad_byte) for lc in kc) for kc in kcs)
            return cls(f=tuple(min(x[0] for x in kk) for kk in kinds),
                       b=tuple(min(x[1] for x in kk) for kk in kinds),
                       ef=tuple(lc.embedding_forward_ms for lc in lcs),
                       eb=tuple(lc.embedding_backward_ms for lc in lcs),
                       of=tuple(lc.output_forward_ms for lc in lcs),
                       ob=tuple(lc.output_backward_ms for lc in lcs),
                       gl=tuple(min(x[2] for x in kk) for kk in kinds),
                       ge=tuple(lc.embedding_grad_bytes for lc in lcs),
                       go=tuple(lc.output_grad_bytes for lc in lcs),
                       og=tuple(lc.optimizer_ms_per_grad_byte for lc in lcs), kinds=kinds,
                       kxg=kxg if any(any(x) for x in kxg) else ())
        lcs = [cm.layer_costs(k, t, cfg.micro_batch_size, ep) for (k, t) in cfg.options]
        xg = tuple(lc.expert_grad_bytes for lc in lcs)
        return cls(f=tuple(lc.forward_ms for lc in lcs), b=tuple(lc.backward_ms for lc in lcs),
                   ef=tuple(lc.embedding_forward_ms for lc in lcs),
                   eb=tuple(lc.embedding_backward_ms for lc in lcs),
                   of=tuple(lc.output_forward_ms for lc in lcs),
                   ob=tuple(lc.output_backward_ms for lc in lcs),
                   gl=tuple(lc.grad_bytes for lc in lcs),
                   ge=tuple(lc.embedding_grad_bytes for lc in lcs),
                   go=tuple(lc.output_grad_bytes for lc in lcs),
                   og=tuple(lc.optimizer_ms_per_grad_byte for lc in lcs),
                   xg=xg if any(xg) else ())

    @property
    def min_layer_fb(self) -> float:
        """The cheapest f + b of one layer over the options."""
        return min(f + b for f, b in zip(self.f, self.b))

    @property
    def min_output_fb(self) -> float:
        return min(f + b for f, b in zip(self.of, self.ob))


def layer_limits_from(cm: CostModel, cfg: OuterConfig, moe_free_stages: bool = True
                      ) -> np.ndarray:
    """A model of several layer kinds (``cm.per_kind``, V = 1): lmax_from[o, x, a], the most
    layers option o fits at stage x starting at layer a (memory; <= L - (N-1) and <= L - a).
    ``moe_free_stages=False`` (``SearchOptions``): no stage after the first starts at or before
    the model's first MoE layer, so the first stage holds one (the leading dense layers never
    make a stage of their own; 0 layers there)."""
    cm = cm.at_cp(cfg.cp)
    n, L = cfg.num_stages, cm.model.num_layers
    limit = L - (n - 1) * cfg.virtual_stages
    out = np.zeros((len(cfg.options), n, L + 1), dtype=np.int32)
    for o, (k, t) in enumerate(cfg.options):
        for x in range(n):
            out[o, x, :] = cm.max_layers_row(
                capacity_bytes=cm.capacity_bytes[k], stage=x, num_stages=n, tp=t, dp=cfg.dp_cp,
                micro_batch_size=cfg.micro_batch_size, num_microbatches=cfg.num_microbatches,
                schedule=cfg.schedule, type_index=k, ep=cfg.ep)
    if not moe_free_stages and n > 1:
        first_moe = first_moe_layer(cm.model)
        if first_moe is not None and first_moe > 0:
            out[:, 1:, 1:first_moe + 1] = 0
    return np.minimum(out, max(limit, 0))


def first_moe_layer(model) -> int | None:
    """The 0-based index of the model's first MoE layer; None without one."""
    kinds = getattr(model, "layer_kinds", ())
    for i, k in enumerate(getattr(model, "layer_kind_of", ())):
        if kinds[k].is_moe:
            return i
    return None


def layer_limits(cm: CostModel, cfg: OuterConfig, moe_free_stages: bool = True) -> np.ndarray:
    """lmax[o, x]: the most layers option o fits at stage x (memory; <= L - (N-1) V). A model
    of several layer kinds (``cm.per_kind``): the most over the first layers stage x can have
    (an upper bound; ``layer_limits_from`` is exact)."""
    cm = cm.at_cp(cfg.cp)
    n, L = cfg.num_stages, cm.model.num_layers
    limit = L - (n - 1) * cfg.virtual_stages
    if cm.per_kind and cfg.virtual_stages > 1:
        return _kind_limits(cm, cfg, limit)
    if cm.per_kind:
        # stage x starts at a layer a in [x V, L - (N - x) V] (every stage holds >= V layers)
        frm = layer_limits_from(cm, cfg, moe_free_stages)
        v = cfg.virtual_stages
        out = np.zeros((len(cfg.options), n), dtype=np.int32)
        for x in range(n):
            lo, hi = x * v, L - (n - x) * v
            if lo <= hi:
                out[:, x] = frm[:, x, lo:hi + 1].max(axis=1)
        return out
    out = np.zeros((len(cfg.options), n), dtype=np.int32)
    for o, (k, t) in enumerate(cfg.options):
        out[o, :] = cm.max_layers_by_stage(
            capacity_bytes=cm.capacity_bytes[k], stages=range(n), num_stages=n, tp=t,
            dp=cfg.dp_cp,
            micro_batch_size=cfg.micro_batch_size, num_microbatches=cfg.num_microbatches,
            schedule=cfg.schedule, virtual_stages=cfg.virtual_stages, limit=limit,
            type_index=k, ep=cfg.ep)
    return out


def stage_fits_counts(cm: CostModel, cfg: OuterConfig, o: int, x: int, counts) -> bool:
    """Whether option o at stage x holding ``counts[k]`` layers of each kind fits its memory
    (``CostModel.stage_memory``, as ``CostModel.stage_costs`` counts a plan's stage; ``cm``
    at the configuration's CP)."""
    k, t = cfg.options[o]
    return cm.stage_memory_bytes(
        layers=sum(counts), stage=x, num_stages=cfg.num_stages, tp=t, dp=cfg.dp_cp,
        micro_batch_size=cfg.micro_batch_size, num_microbatches=cfg.num_microbatches,
        schedule=cfg.schedule, virtual_stages=cfg.virtual_stages, type_index=k,
        kind_counts=tuple(counts), ep=cfg.ep) <= cm.capacity_bytes[k]


def _kind_limits(cm: CostModel, cfg: OuterConfig, limit: int) -> np.ndarray:
    """lmax of a model of several kinds with interleaving (an upper bound: a stage's kinds
    then depend on every stage's layers): per (o, x) the sum over the kinds of the most
    layers of that kind alone that fit. Memory grows with every layer, so a stage that fits
    holds at most that many of each kind."""
    memo = cm.__dict__.setdefault("_kind_limits_memo", {})
    key = (replace(cfg, chunk_totals=()), limit)
    if key in memo:
        return memo[key].copy()
    totals = cm.model.kind_counts
    out = np.zeros((len(cfg.options), cfg.num_stages), dtype=np.int32)
    for o in range(len(cfg.options)):
        for x in range(cfg.num_stages):
            most = 0
            for i, total in enumerate(totals):
                def fits(c: int) -> bool:
                    return stage_fits_counts(cm, cfg, o, x, [c if j == i else 0
                                                             for j in range(len(totals))])
                lo, hi = 0, total          # fits(lo) (0 layers: the rest of the stage)
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    if fits(mid):
                        lo = mid
                    else:
                        hi = mid - 1
                most += lo
            out[o, x] = min(most, max(limit, 0))
    memo[key] = out
    return out.copy()


# --------------------------------------------------------------------------- root bound

class _TypeCapacity(NamedTuple):
    """One usable device type at the root: its options' M (f + b) and devices per stage (a
    tuple: ``_roots.root_core`` unpacks it)."""

    a: float                                  # M x its cheapest per-layer f + b
    count: int                                # most stages of the type: devices // min(d t)
    devices: int
    options: tuple[tuple[float, int], ...]    # (M (f + b), d t) per option of the type


def _capacity_types(cm: CostModel, cfg: OuterConfig, costs: OptionCosts
                    ) -> list[_TypeCapacity]:
    m, d = cfg.num_microbatches, cfg.dp_cp
    per_type: dict[int, list[tuple[float, int]]] = {}
    for o, (k, t) in enumerate(cfg.options):
        per_type.setdefault(k, []).append((m * (costs.f[o] + costs.b[o]), d * t))
    return [_TypeCapacity(min(a for a, _ in opts), cm.pools[k].size // min(dt for _, dt in opts),
                          cm.pools[k].size, tuple(opts))
            for k, opts in sorted(per_type.items())]


def _cap(a: float, t_ms: float, limit: int) -> int:
    q = t_ms / a if a > 0 else math.inf
    return limit if q >= limit else min(limit, int(q * (1 + 1e-9) + 1e-9))


def _capacity_at(types: list[_TypeCapacity], cfg: OuterConfig, L: int, t_ms: float) -> int:
    """Most layers N stages of time <= t_ms hold (-1: fewer than N stages hold V each): the
    best N stage caps (per type its cheapest option's cap, at most ``count`` stages), and, no
    more than that, per type its devices x the best layers per device over its options (its
    stages use disjoint devices: with per-stage TP, the many stages of the smallest TP and the
    speed of the largest do not go together)."""
    n, v = cfg.num_stages, cfg.virtual_stages
    limit = L - (n - 1) * v
    caps = []
    per_device = 0
    for ty in types:
        cap = _cap(ty.a, t_ms, limit)
        if cap >= v and ty.count > 0:
            caps.append((cap, ty.count))
            if len(ty.options) == 1:    # one TP: the stage count already says it
                per_device += min(ty.count, n) * cap
                continue
            ratio = max(_cap(a, t_ms, limit) / dt for a, dt in ty.options)
            per_device += min(int(ty.devices * ratio * (1 + 1e-12)), min(ty.count, n) * cap)
    caps.sort(reverse=True)
    total = taken = 0
    for cap, cnt in caps:
        j = min(cnt, n - taken)
        taken += j
        total += j * cap
    return min(total, per_device) if taken >= n else -1


def capacity_layers(cm: CostModel, cfg: OuterConfig, t_ms: float,
                    costs: OptionCosts | None = None) -> int:
    """Most layers the N stages can hold when every stage's serial work M l (f + b) <= t_ms.

    A stage of type k takes >= d * t_min(k) devices, so at most ndev_k // (d t_min(k)) stages
    are of type k, each holding <= floor(t_ms / (M min_t (f + b))) layers (and <= L - (N-1) V).
    The best N of those stages (caps descending) bound the layers any plan of this
    configuration with iteration time <= t_ms can place from above; -1 if fewer than N stages
    can hold V layers each.
    """
    costs = OptionCosts.of_config(cm, cfg) if costs is None else costs
    return _capacity_at(_capacity_types(cm, cfg, costs), cfg, cm.model.num_layers, t_ms)


def min_send_ms(cm: CostModel, micro_batch_size: int) -> float:
    """The fastest activation send of one micro-batch over any link of the cluster."""
    best = max(max(cm.intra_gbps), max(cm.inter_gbps), cm.cross_gbps)
    return send_ms(cm.activation_bytes(micro_batch_size), best, cm.latency_ms)


def stage_min_send_ms(cm: CostModel, cfg: OuterConfig) -> float:
    """The fastest send between two consecutive stages of ``cfg`` (a lower bound on every
    pipeline link of its plans, the ``minsend`` of the bounds).

    Two stages of different types use the cross-type link. Two stages of one type k: the later
    one starts at or after the earlier one's end (a type's stages take its devices in pool
    order), so their replica-0 devices are >= d t_o apart, t_o the earlier stage's TP; when
    d t_o >= the widest node span of the type for every option of k, they are on different
    nodes and the link is never faster than the type's inter-node one (the send takes the
    slowest replica link). Otherwise the faster of intra- and inter-node. On paper-setting-like
    clusters (TP x DP spanning whole nodes) this is the inter-node send instead of NVLink's:
    on LLaMA-3 405B over 512 devices (TP 8 on 8-GPU nodes) 2.69 ms instead of 0.30 ms per link
    in every path bound."""
    cm = cm.at_cp(cfg.cp)
    types = sorted({k for k, _ in cfg.options})
    best = cm.cross_gbps if len(types) >= 2 else 0.0
    for k in types:
        span = cm.pools[k].node_span
        if all(cfg.dp_cp * t >= span for kk, t in cfg.options if kk == k):
            g = cm.inter_gbps[k]
        else:
            g = max(cm.intra_gbps[k], cm.inter_gbps[k])
        best = max(best, g)
    return send_ms(cm.activation_bytes(cfg.micro_batch_size), best, cm.latency_ms)


def _fill_carry(cfg: OuterConfig, minsend: float) -> tuple[float, ...]:
    """Coefficients of the fill/drain recursion's largest carried work (``root_bound``):
    c_{p+1} = q c_p + (T - 2 minsend p) / M with q = 1 - 1 / (M V), c_0 = 0, so
    c_p = a_p T - g_p; returns (a_N, g_N, a_{N-1}, g_{N-1}, 2 minsend (N-1))."""
    n, m, v = cfg.num_stages, cfg.num_microbatches, cfg.virtual_stages
    q = 1.0 - 1.0 / (m * v)
    a = g = a_prev = g_prev = 0.0
    for p in range(n):
        a_prev, g_prev = a, g
        a, g = q * a + 1.0 / m, q * g + 2.0 * minsend * p / m
    return a, g, a_prev, g_prev, 2.0 * minsend * (n - 1)


def _fill_feasible(types: list[_TypeCapacity], cfg: OuterConfig, L: int, t_ms: float,
                   extra: float, carry: tuple[float, ...]) -> bool:
    """Whether N stages can hold the L layers within t_ms when the pipeline fill and drain
    are counted (``root_bound``'s third bound): the largest total per-micro-batch work the
    stages can carry covers the least work the layers need."""
    n, m, v = cfg.num_stages, cfg.num_microbatches, cfg.virtual_stages
    limit = L - (n - 1) * v
    need, work = L, extra
    for ty in types:        # cheapest first (``_fill_bound`` sorts them by a)
        # the type's largest cap is its cheapest option's (``_cap`` falls with a)
        cap = _cap(ty.a, t_ms, limit)
        if cap >= v and ty.count > 0:
            take = min(min(ty.count, n) * cap, need)
            work += take * ty.a / m
            need -= take
            if need == 0:
                break
    if need > 0:
        return False
    a_n, g_n, a_last, g_last, last_send = carry
    # the recursion is linear in T while every step's room T - 2 minsend p - c_p / V is >= 0
    # (it falls with p: checking the last step suffices); otherwise drop the sends (a larger
    # carry, still an upper bound)
    if t_ms - last_send - (a_last * t_ms - g_last) / v >= 0.0:
        carried = a_n * t_ms - g_n
    else:
        carried = a_n * t_ms
    return work <= carried * (1 + 1e-9)


def root_bound(cm: CostModel, cfg: OuterConfig, costs: OptionCosts | None = None) -> float:
    """Lower bound on every plan of ``cfg``: the largest of the per-stage work bound, the
    capacity bound (the smallest t with ``capacity_layers(t) >= L``; capacity only changes at
    t = M (f + b)_k n, so that t is found by bisection over those values, and returned
    1e-9 below) and the fill/drain bound, plus the per-iteration overhead every plan adds after
    its pipeline; inf when no plan of ``cfg`` can hold the layers.

    Fill/drain: stage p's first op waits for micro-batch 0's chunk-0 forward through the
    stages before it and after its last op (chunk 0's backward of micro-batch M-1, for every
    schedule here) that backward runs back through them, so with w_i = F_i + B_i (all chunks;
    chunk 0 holds >= l_i / V of stage i's layers) M w_p + (sum_{i<p} w_i) / V + 2 minsend p
    <= T. The sum of w that N stages can carry under these is at most the greedy recursion's
    (each step is increasing in the sum before it), and it must cover the least work of the
    layers: a fractional knapsack of L layers over the types' rooms at T (<= count x cap
    stages' layers each), cheapest (f + b) first, plus the cheapest embedding and output
    layers. Feasibility is monotone in T, so the smallest feasible T is found by bisection
    (``docs/search.md``; ``tests/test_search.py`` holds it below every configuration's
    exhaustive optimum).
    The arithmetic runs in C (``_roots.root_core``); ``_root_bound_py`` is the same bound in
    Python, the reference the tests compare it with."""
    cm = cm.at_cp(cfg.cp)
    costs = OptionCosts.of_config(cm, cfg) if costs is None else costs
    n = cfg.num_stages
    # what does not depend on N, shared by the configurations that differ only in it (the
    # expert-parallel degrees multiply them): the types' capacities, the fill's extra work,
    # the fastest stage-to-stage send
    memo = cm.__dict__.setdefault("_root_parts_memo", {})
    key = (cfg.options, cfg.micro_batch_size, cfg.cp, cfg.ep, cfg.dp, cfg.num_microbatches,
           id(costs))
    parts = memo.get(key)
    if parts is None or parts[0] is not costs:
        parts = memo[key] = (costs, _capacity_types(cm, cfg, costs), _fill_extra(costs),
                             stage_min_send_ms(cm, cfg))
    _, types, extra, minsend = parts
    L, m = cm.model.num_layers, cfg.num_microbatches
    base = _work_base(cm, cfg, costs)
    t = _roots.root_core(types, n, m, cfg.virtual_stages, L, base, extra,
                         minsend if n > 1 else 0.0)
    return t + cm.iteration_overhead_ms


def _root_inputs(cm: CostModel, cfg: OuterConfig, costs: OptionCosts
                 ) -> tuple[float, list[_TypeCapacity]]:
    """The work bound (``root_bound``'s base) and the usable types' capacities."""
    return _work_base(cm, cfg, costs), _capacity_types(cm, cfg, costs)


def _work_base(cm: CostModel, cfg: OuterConfig, costs: OptionCosts) -> float:
    """The work bound: some stage holds j >= ceil(L / N) layers, each micro-batch's f + b of
    them on one option, M times; and the L layers' f + b on one device. One kind: the cheapest
    layer's f + b times j (times L). Several kinds (``costs.kinds``): per option the sum of
    the j (L) cheapest layers by the kinds' counts, the least over the options: a MoE layer's
    all-to-alls are then priced in every stage that must hold one (with each layer at its
    cheapest kind, the dense layers' cost, DeepSeek-V3's EP 8 / 16 roots equalled EP 1's)."""
    L, n, m = cm.model.num_layers, cfg.num_stages, cfg.num_microbatches
    j = math.ceil(L / n)
    if not costs.kinds:
        minfb = costs.min_layer_fb
        return max(m * j * minfb, L * minfb)
    counts = cm.model.kind_counts
    if len(counts) != len(costs.kinds[0]):
        minfb = costs.min_layer_fb
        return max(m * j * minfb, L * minfb)

    def cheapest(kk, want: int) -> float:
        total, left = 0.0, want
        for fb, cnt in sorted(zip((x[0] + x[1] for x in kk), counts)):
            take = min(cnt, left)
            total += take * fb
            left -= take
            if left <= 0:
                break
        return total

    return max(m * min(cheapest(kk, j) for kk in costs.kinds),
               min(cheapest(kk, L) for kk in costs.kinds))


def _fill_extra(costs: OptionCosts) -> float:
    """The least work of the embedding and output layers (the fill/drain bound's extra)."""
    return min(f + b for f, b in zip(costs.ef, costs.eb)) + costs.min_output_fb


def _root_bound_py(cm: CostModel, cfg: OuterConfig, costs: OptionCosts | None = None) -> float:
    """``root_bound`` in Python (the reference of ``_roots.root_core``)."""
    cm = cm.at_cp(cfg.cp)
    costs = OptionCosts.of_config(cm, cfg) if costs is None else costs
    L, n, v = cm.model.num_layers, cfg.num_stages, cfg.virtual_stages
    base, types = _root_inputs(cm, cfg, costs)
    limit = L - (n - 1) * v
    cands = sorted({a * j for ty in types for a, _ in ty.options for j in range(v, limit + 1)})
    if not cands or _capacity_at(types, cfg, L, cands[-1]) < L:
        return math.inf
    lo, hi = 0, len(cands) - 1          # smallest index with capacity >= L
    while lo < hi:
        mid = (lo + hi) // 2
        if _capacity_at(types, cfg, L, cands[mid]) >= L:
            hi = mid
        else:
            lo = mid + 1
    bound = max(base, cands[lo] * (1 - 1e-9))
    return _fill_bound(types, cfg, L, bound, costs, cm) + cm.iteration_overhead_ms


def _fill_bound(types: list[_TypeCapacity], cfg: OuterConfig, L: int, bound: float,
                costs: OptionCosts, cm: CostModel) -> float:
    """``root_bound``'s fill/drain bound on the pipeline's time (>= ``bound``, the work and
    capacity bounds; inf when no T holds the layers)."""
    if cfg.num_stages == 1:
        return bound
    extra = _fill_extra(costs)
    carry = _fill_carry(cfg, stage_min_send_ms(cm, cfg))
    types = sorted(types, key=lambda ty: ty.a)
    lo_t, hi_t = bound, 2.0 * bound
    while not _fill_feasible(types, cfg, L, hi_t, extra, carry):
        lo_t, hi_t = hi_t, 2.0 * hi_t
        if hi_t > 1e15:
            return math.inf
    if _fill_feasible(types, cfg, L, lo_t, extra, carry):
        return bound
    while hi_t - lo_t > 1e-5 * hi_t:       # lo_t infeasible, hi_t feasible
        mid = 0.5 * (lo_t + hi_t)
        if _fill_feasible(types, cfg, L, mid, extra, carry):
            hi_t = mid
        else:
            lo_t = mid
    return lo_t


# --------------------------------------------------------------------------- bound structure

def _closed_form_structure(schedule: str, n: int, m: int) -> tuple | None:
    """(acnt, t1cnt, clast) of the V = 1 schedules without building the op orders.

    Forwards before stage s's first backward: ``1f1b`` min(N - s, M) (N-1-s warm-up forwards
    and the first steady-state forward), ``eager-1f1b`` min(2(N-1-s)+1, M) (warm-up only),
    ``gpipe`` M. F(s, mb 0) is every stage's first op (t1cnt = 1); the last op is B(s, M-1) of
    chunk 0; after the a_s forwards each runs B(s, k) and F(s, k + a_s) alternately
    (``steady_1f1b``: loop1 = 1; only 1F1B has a_{s+1} = a_s - 1 < M, which the adjacent-pair
    bound needs). ``tests/test_search.py`` checks these against ``schedules.op_orders``."""
    if schedule == "1f1b":
        acnt = [min(n - s, m) for s in range(n)]
    elif schedule == "eager-1f1b":
        acnt = [min(2 * (n - 1 - s) + 1, m) for s in range(n)]
    elif schedule == "gpipe":
        acnt = [m] * n
    else:
        return None
    return np.array(acnt, dtype=np.int32), np.ones(n, dtype=np.int32), 0, 1


@lru_cache(maxsize=512)
def bound_structure(schedule: str, n: int, m: int, v: int) -> "_search.BoundStructure":
    """acnt / t1cnt / clast of ``_search.BoundStructure`` from the schedule's op orders."""
    if v == 1:
        cf = _closed_form_structure(schedule, n, m)
        if cf is not None:
            acnt, t1cnt, clast, loop1 = cf
            return _search.BoundStructure(n, m, v, acnt, t1cnt, clast, loop1=loop1)
    return bound_structure_from_ids(schedule, n, m, v)


def bound_structure_from_ids(schedule: str, n: int, m: int, v: int) -> "_search.BoundStructure":
    """``bound_structure_from_orders`` from ``_core.order_ids`` (int arrays, no object per
    op: a huge M took seconds in Python); tests/test_core_orders.py checks it equal."""
    from .._core import decode_ids, order_ids

    if v == 1 and schedule == "interleaved-1f1b":   # megatron runs 1F1B then (same orders)
        acnt, t1cnt, clast, loop1 = _closed_form_structure("1f1b", n, m)
        return _search.BoundStructure(n, m, v, acnt, t1cnt, clast, loop1=loop1)
    if v == 1:
        return bound_structure_from_orders(schedule, n, m, v)
    ids = order_ids(schedule, n, m, v)
    acnt = np.zeros(n * v, dtype=np.int32)
    t1cnt = np.zeros(n * v, dtype=np.int32)
    clast = None
    for s in range(n):
        isb, ch, _, mb = decode_ids(ids[s], n, m, v)
        first_b = int(np.argmax(isb))
        if not isb[first_b] or (ch[first_b], mb[first_b]) != (v - 1, 0):
            raise AssertionError(f"{schedule}: first backward of stage {s} is not (V-1, 0)")
        t1 = int(np.argmax(~isb & (ch == v - 1) & (mb == 0)))
        acnt[s * v:(s + 1) * v] += np.bincount(ch[:first_b], minlength=v).astype(np.int32)
        t1cnt[s * v:(s + 1) * v] += np.bincount(ch[:t1 + 1], minlength=v).astype(np.int32)
        if not isb[-1] or mb[-1] != m - 1:
            raise AssertionError(f"{schedule}: last op of stage {s} is not B(., M-1)")
        if clast is None:
            clast = int(ch[-1])
        elif clast != int(ch[-1]):
            raise AssertionError(f"{schedule}: last chunk differs between stages")
    return _search.BoundStructure(n, m, v, acnt, t1cnt, clast,
                                  pair_counts_from_ids(ids, n, m, v), loop1=0)


def steady_1f1b(orders) -> bool:
    """Whether every stage s of a V = 1 schedule runs F(s, 0..a_s-1), then B(s, k) and
    F(s, k + a_s) alternately (the forward while one remains) up to B(s, M-1): 1F1B's order,
    where two adjacent stages j, j+1 with a_{j+1} = a_j - 1 form the loop
    B(j+1, k) -> B(j, k) -> F(j, k + a_j) -> F(j+1, k + a_j) -> B(j+1, k + 2) of
    ``_bounds.bound``'s adjacent-pair bound (which checks a_{j+1} = a_j - 1 per pair)."""
    for ops in orders:
        if any(op.chunk != 0 for op in ops):
            return False
        a = next((i for i, op in enumerate(ops) if op.is_backward), len(ops))
        m = len(ops) // 2
        want = [(False, k) for k in range(a)]
        for k in range(m):
            want.append((True, k))
            if k + a < m:
                want.append((False, k + a))
        if [(op.is_backward, op.microbatch) for op in ops] != want:
            return False
    return True


def bound_structure_from_orders(schedule: str, n: int, m: int, v: int
                                ) -> "_search.BoundStructure":
    """``bound_structure`` derived from ``schedules.op_orders`` (reference for the tests)."""
    orders = op_orders(schedule, n, m, v)
    acnt = np.zeros(n * v, dtype=np.int32)
    t1cnt = np.zeros(n * v, dtype=np.int32)
    clast = None
    for s, ops in enumerate(orders):
        first_b = next(i for i, op in enumerate(ops) if op.is_backward)
        if (ops[first_b].chunk, ops[first_b].microbatch) != (v - 1, 0):
            raise AssertionError(f"{schedule}: first backward of stage {s} is not (V-1, 0)")
        t1 = next(i for i, op in enumerate(ops)
                  if not op.is_backward and op.chunk == v - 1 and op.microbatch == 0)
        for i in range(first_b):
            acnt[s * v + ops[i].chunk] += 1
        for i in range(t1 + 1):
            t1cnt[s * v + ops[i].chunk] += 1
        last = ops[-1]
        if not last.is_backward or last.microbatch != m - 1:
            raise AssertionError(f"{schedule}: last op of stage {s} is not B(., M-1)")
        if clast is None:
            clast = last.chunk
        elif clast != last.chunk:
            raise AssertionError(f"{schedule}: last chunk differs between stages")
    return _search.BoundStructure(n, m, v, acnt, t1cnt, clast,
                                  pair_counts(orders, v) if v > 1 else None,
                                  loop1=int(v == 1 and steady_1f1b(orders)))


def pair_counts_from_ids(ids: np.ndarray, n: int, m: int, v: int) -> np.ndarray | None:
    """``pair_counts`` of the orders ``_core.order_ids`` gives (numpy, no object per op)."""
    from .._core import decode_ids

    isb, ch, _, mb = decode_ids(ids[0], n, m, v)
    fwd = ~isb
    c1 = int(np.argmax(fwd & (ch == 1)))
    head = fwd[:c1] & (ch[:c1] == 0)
    kstar = int(mb[:c1][head].max())
    out = np.zeros((n, 3, 2, v), dtype=np.int32)
    for s in range(n):
        isb, ch, _, mb = decode_ids(ids[s], n, m, v)
        fk = int(np.argmax(~isb & (ch == 0) & (mb == kstar)))
        b0 = int(np.argmax(isb & (ch == 0) & (mb == 0)))
        if b0 < fk:
            return None
        key = isb.astype(np.int64) * v + ch
        for part, (lo, hi) in enumerate(((0, fk + 1), (fk + 1, b0 + 1), (b0, len(key)))):
            out[s, part] = np.bincount(key[lo:hi], minlength=2 * v).reshape(2, v)
    return out


def pair_counts(orders, v: int) -> np.ndarray | None:
    """Op counts of the two-stage path bound of interleaved schedules, (N, 3, 2, V) int32:
    per stage s, [0] the ops up to and including F(s, 0, k*) (k* = the last micro-batch of
    the first chunk-0 forward group), [1] the ops after it up to and including B(s, 0, 0),
    [2] the ops from B(s, 0, 0) on (B(s, 0, 0) counts in both [1] and [2]), each per (forward
    / backward, chunk). For stages a < b the path stage a up to F(a, 0, k*), micro-batch k*'s
    chunk-0 forwards to b, stage b up to B(b, 0, 0), micro-batch 0's chunk-0 backwards down
    to a, stage a to its end, R_a is a lower bound (``_bounds.bound``, ``docs/search.md``).
    None when some stage runs B(s, 0, 0) before F(s, 0, k*) (no such path)."""
    first = orders[0]
    c1 = next(i for i, op in enumerate(first) if not op.is_backward and op.chunk == 1)
    kstar = max(op.microbatch for op in first[:c1] if not op.is_backward and op.chunk == 0)
    out = np.zeros((len(orders), 3, 2, v), dtype=np.int32)
    for s, ops in enumerate(orders):
        fk = next(i for i, op in enumerate(ops)
                  if not op.is_backward and op.chunk == 0 and op.microbatch == kstar)
        b0 = next(i for i, op in enumerate(ops)
                  if op.is_backward and op.chunk == 0 and op.microbatch == 0)
        if b0 < fk:
            return None
        for part, (lo, hi) in enumerate(((0, fk + 1), (fk + 1, b0 + 1), (b0, len(ops)))):
            for op in ops[lo:hi]:
                out[s, part, int(op.is_backward), op.chunk] += 1
    return out
