"""Plan search: enumeration, stage-level bound, ridge-like layer pruning, warm-up sampling.

Search space
------------
Outer configuration: schedule (``1f1b``, ``eager-1f1b``, ``interleaved-1f1b`` with V = 2..max),
micro-batch size b, DP degree d (M = G / (d b) must be an integer), TP mode (one t for all stages,
or per stage), pipeline degree N. Inner (Cython, ``_search.pyx``): per stage, its option
(device type, t) and its layer count l >= V (sum = layers), placed by ``placement.py``.
TP candidates of a type: powers of two dividing the heads, the query groups and every node size
of the type.

Type sequences (which device type serves which stage)
-----------------------------------------------------
``type_order="any"`` enumerates every sequence (interleaving types allowed), ``"blocks"`` only
those where the stages of each type are contiguous (T! block orders x counts), ``"auto"``
(default) takes ``any`` for an outer configuration when (#usable types)^N <= ``type_sequence_limit``
(default ``TYPE_SEQUENCE_LIMIT`` = 3^20) and ``blocks`` otherwise. ``blocks`` CAN lose the optimum (an interleaved order may be better,
e.g. to put high-memory devices first twice); the plan's ``search.type_order_restricted_configs``
says how many configurations were restricted. Nothing else is restricted: no symmetry reduction is
applied to type sequences, because the pipeline position of every stage matters (warm-up depth,
memory, links).

Stage-level bound (validity)
----------------------------
All weights are >= 0 and the iteration time is a longest path, so any path gives a lower bound.
For a decided stage i (head_i = sum_{j<i} (first-chunk forward_j + Pf_j) is a path to its first op):

* its ops run one at a time: the last op ends >= head_i + all its work;
* its first backward B(i, V-1, 0) needs micro-batch 0's round trip through all later stages; the
  a_i forwards it runs before that backward are serial, as are everything after it;
* the last op of stage i is the backward of the last micro-batch (chunk ``clast``); from it the
  backward chain runs down to any stage k <= i and then R_k.
Undecided stages are bounded below by the cheapest per-layer (f+b) over the options times the
layers still to place, the cheapest send, and, for the stage holding the most of the remaining
layers (>= ceil(L_rem / K)), M times its work. ``tests/test_search_bound.py`` checks g <= the
simulated time of every completion (hypothesis).

Capacity bound (layer ranges)
-----------------------------
Every stage j runs its M forwards and M backwards one at a time, so a completion with time
<= T has M l_j (f+b)_j <= T - (a path outside stage j): stage j holds at most
floor((T - path) / (M (f+b)_j)) layers. At a node (stage x decided) the path is the one of the
``gy`` term (head_x + fc[x,0] + 2 minsend + bc[x,clast] + tail_x); the later stages' types are
open, so per type k at most D_k // (d t_min(k)) stages (D_k devices left), each holding at most
the largest cap of the type's options; the best K of them hold at most cap(l) layers, and a
stage-x count l with cap(l) < Lrem - l is cut. cap is non-increasing in l (the path grows with
l), which gives a lower end for l by fixpoint iteration (l >= Lrem - cap(lo)). At the root
(path >= 0) the same count gives ``root_bound``: the smallest T with capacity >= L.

Fill/drain and round-trip capacity cuts (V = 1 schedules; ``_search.pyx`` ``_capacity`` and
``_wcut``), with w_j = F_j + B_j >= l_j (f+b)_j of a later stage j and A = T - cap path:

* fill/drain: later stage j's first op F(j, 0) waits for micro-batch 0's forward through the
  later stages before it, and after its last op B(j, M-1) the backward runs back through them,
  so M w_j + U_j <= A - 2 minsend (position) with U_j the w of those stages; U_K then obeys a
  recursion increasing in U, capped at every step by the W limit below (U_p <= U_K = W), and
  the layers fit a fractional knapsack of budget U_K - outmin (the last stage's w also holds the
  output layer; per type <= min(cnt_k, K) stages of <= cap_k layers, cheapest (f+b) first);
* round trip: with W = the w of all later stages (the last one holds the output layer), the
  ``_bound`` RT path through stage j gives l_j ((M-1) b + (M - a_j) f) <= A - 2 minsend (K-1)
  - W, and the decided stages' RT term gives W <= thr - MC - P - 2 minsend K; for W in each of
  a few pieces [Wa, Wb] of the feasible range the layers are bounded by the per-type caps at
  W = Wa and the knapsack of budget Wb; a count l of stage x is cut when every piece holds
  < Lrem - l. Per piece also the positional caps: stage j's own a_j and memory limit lmax[o, j]
  give a cap pc[p, k] per position and type, and the best assignment of types to positions
  (type k on <= cnt_k of them) is bounded by weak LP duality, sum_k cnt_k u_k +
  sum_p max_k (pc[p, k] - u_k) for any u >= 0 (``_wpos``); the knapsack's per-type room is
  the sum of the type's best min(cnt_k, K) positional caps. Both are cuts at the threshold (a completion <= thr would satisfy them), not
  parts of g; ``tests/test_search.py`` checks per configuration that the bounded search at
  threshold = the exhaustive optimum still finds it.

Objective: the schedule as megatron-core runs it
------------------------------------------------
A plan's time is the simulator's with ``engine=True`` (``ENGINE_TIMING``): for 1f1b (and the
analysis-only eager-1f1b and gpipe) the paper's DAG; for interleaved-1f1b ``_core.EngineDAG``,
megatron-core's blocking, bundled p2p calls (a forward's activation leaves with the next
backward's gradient). The paper's DAG under-predicts interleaved plans by 3.8-4.5 % on
settings 1-2 and picked an interleaved plan for setting 1 that megatron-core runs slower than
the best 1f1b plan. Every bound above is a bound on the paper's DAG, and the engine's time is
never below it (each op starts no earlier), so they stay valid and the search stays exact.

Iterative deepening
-------------------
The outer loop runs rounds with threshold caps R0 (1.02)^r (R0 = the smallest root bound; never
above the incumbent): a round whose search ends with no plan <= cap proves the optimum > cap;
the first round that finds one has found the best plan, since every better plan is <= cap and
was in its search. Rounds below the optimum are cheap (the bounds cut at the first stages), and
the last one searches with a threshold within 2 % of the optimum, where the bound and the
capacity cut leave almost nothing. When the next cap would pass the incumbent, one round (per
pass) searches with the midpoint of the proven bound and the incumbent if their gap is > 0.2 %
(a round costs far less when its cap is close to the optimum than when it starts from a
distant incumbent and must first find the optimum; when the incumbent is already the optimum,
the extra round costs less than the last one), then the last searches with the incumbent.
This replaces a good warm-up incumbent; the warm-up still runs (on the configurations with the
lowest root bounds) and caps the rounds.

Passes (blocks seed)
--------------------
With ``type_order`` ``auto`` or ``any`` the rounds run twice: first over every configuration
restricted to the contiguous ``blocks`` sequences (cheap; under a time budget it yields a good
plan early), then, seeded with that pass's best plan as incumbent, over the configurations
whose space is larger (>= 2 usable types, N >= 2, and ``any`` allowed for them). The full space
is a superset of the blocks space, so the seed is a plan of it: the second pass's rounds stop
below the seed, its last round searches with threshold = seed (plans tying it are found too, so
the tie-break is the one of a single pass), and if it finds nothing the seed is the full-space
optimum. Per-configuration lower bounds of the first pass are discarded for the configurations
the second pass re-searches (they only held in the smaller space).

Determinism and workers
-----------------------
Configurations are searched one after another; ``workers`` (default: every core) threads
share the search of a large one: a configuration whose previous search (an earlier round)
took >= SPLIT_NODES nodes has its tree cut into subtrees (the prefixes of its first stages
that survive the cuts), which the threads take one at a time, all in ``nogil`` C, sharing the
incumbent (``_search.search_config``). The plan (time, then the configuration key, then the
stage options and layers, as tie-break) does not depend on ``workers``: every thread keeps
the smallest (time, assignment) it meets and the results are merged in that order. The
statistics (``nodes``, ``cut_*``, ``plans_simulated``) do depend on the threads' interleaving
when a split happened; ``Plan.search`` then carries ``"statistics_depend_on_timing": true``
(false otherwise: the statistics are reproducible). Threads, not processes: on the 2-core
reference machine a fork pool over configurations was slower than one process (the rounds
end in one dominant configuration, and the pool duplicated the per-process caches).

Layer-level pruning (Theorem 2)
-------------------------------
``ridge``: within one (type, t) group the layer counts along the stages rise then fall (paper).
``safe``: applied only when the outer configuration satisfies the theorem's assumptions:
eager-1f1b (the schedule the proof covers), d = 1 (the proof's DAG has no all-reduce nodes),
b_i = r f_i with one r > 1 for every option, M >= 2N, every send <= (r-1)/2 x the smallest
one-layer forward, and memory never binding; the first and last stages (embedding / output
costs, F != l f) are left out of the groups; and an allocation that is not ridge-like is only
skipped when it satisfies F_min >= alpha F_max (alpha = max(2/3, r/(1+r))). Otherwise exact.
``none``: exhaustive, no bound, no ridge, no warm-up (an independent check of the others).
"""

from __future__ import annotations

import logging
import math
import os
import random
import time
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from . import _search
from ..simulator._core import get_dag
from ..costs import CostModel, chunk_layers, simulator_arrays
from ..errors import InfeasibleError, PoseidonError
from ..plan import DeviceSlot, Plan, StagePlan
from ..simulator.schedules import op_orders, validate_schedule
from ..simulator.pipeline import iteration_time_ms

log = logging.getLogger("poseidon")

SEARCH_SCHEDULES = ("1f1b", "eager-1f1b", "interleaved-1f1b", "gpipe")
PRUNING_MODES = ("safe", "ridge", "none")
TP_MODES = ("uniform", "per-stage")
TYPE_ORDERS = ("auto", "any", "blocks")
DEFAULT_MICRO_BATCH_SIZES = (1, 2, 4)
# ``type_order="auto"``: every type sequence while (#usable types)^N <= this (3 types: N <= 20;
# with the capacity bound the interleaved orders cost ~2x, and on paper-setting6 (288 NPUs)
# the contiguous ``blocks`` orders lose 2.1 %), contiguous blocks beyond.
TYPE_SEQUENCE_LIMIT = 3 ** 20
ROUND_STEP = 0.02   # iterative deepening: each round's threshold cap is 2 % above the last
BISECT_GAP = 0.002  # ... until it passes the incumbent: then one midpoint round if the gap > 0.2 %
MAX_ROUNDS = 64     # per pass; the last round searches with the incumbent alone
ENGINE_TIMING = True  # plans are timed as megatron-core runs them (_core.EngineDAG; see above)
SPLIT_NODES = 20000  # a configuration whose last search took this many nodes is split over threads
WARMUP_CONFIGS = 16  # warm-up samples come from this many configurations of lowest root bound


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

    @property
    def key(self) -> tuple:
        return (SEARCH_SCHEDULES.index(self.schedule), self.virtual_stages,
                self.micro_batch_size, self.dp, self.tp, self.num_stages)


# --------------------------------------------------------------------------- structure

def _closed_form_structure(schedule: str, n: int, m: int) -> tuple | None:
    """(acnt, t1cnt, clast) of the V = 1 schedules without building the op orders.

    Forwards before stage s's first backward: ``1f1b`` min(N - s, M) (N-1-s warm-up forwards
    and the first steady-state forward), ``eager-1f1b`` min(2(N-1-s)+1, M) (warm-up only),
    ``gpipe`` M. F(s, mb 0) is every stage's first op (t1cnt = 1); the last op is B(s, M-1) of
    chunk 0. ``tests/test_search.py`` checks these against ``schedules.op_orders``."""
    if schedule == "1f1b":
        acnt = [min(n - s, m) for s in range(n)]
    elif schedule == "eager-1f1b":
        acnt = [min(2 * (n - 1 - s) + 1, m) for s in range(n)]
    elif schedule == "gpipe":
        acnt = [m] * n
    else:
        return None
    return np.array(acnt, dtype=np.int32), np.ones(n, dtype=np.int32), 0


@lru_cache(maxsize=512)
def bound_structure(schedule: str, n: int, m: int, v: int) -> "_search.BoundStructure":
    """acnt / t1cnt / clast of ``_search.BoundStructure`` from the schedule's op orders."""
    if v == 1:
        cf = _closed_form_structure(schedule, n, m)
        if cf is not None:
            return _search.BoundStructure(n, m, v, *cf)
    return bound_structure_from_orders(schedule, n, m, v)


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
    return _search.BoundStructure(n, m, v, acnt, t1cnt, clast)


# --------------------------------------------------------------------------- enumeration

def tp_candidates(cluster, model, type_name: str, allowed=None) -> tuple[int, ...]:
    """TP degrees a stage of this type may use: powers of two dividing every node's device
    count, the attention heads and the query groups (and in ``allowed`` when given)."""
    sizes = [n.num_devices for n in cluster.nodes_of_type(type_name)]
    out = []
    t = 1
    while sizes and t <= min(sizes):
        if (all(s % t == 0 for s in sizes) and model.num_attention_heads % t == 0
                and model.num_query_groups % t == 0 and (allowed is None or t in allowed)):
            out.append(t)
        t *= 2
    return tuple(out)


def _divisors(x: int) -> list[int]:
    return [d for d in range(1, x + 1) if x % d == 0]


def enumerate_configs(cm: CostModel, *, global_batch_size: int, schedules, tp_mode: str,
                      micro_batch_sizes, max_virtual_stages: int,
                      tp_degrees=None) -> list[OuterConfig]:
    cluster, model = cm.cluster, cm.model
    L = model.num_layers
    tps = [tp_candidates(cluster, model, name, tp_degrees) for name in cm.type_names]
    ndev = [p.size for p in cm.pools]
    out: list[OuterConfig] = []
    for sched in schedules:
        vs = range(2, max_virtual_stages + 1) if sched == "interleaved-1f1b" else (1,)
        for v in vs:
            for b in micro_batch_sizes:
                for d in _divisors(global_batch_size):
                    if global_batch_size % (d * b):
                        continue
                    m = global_batch_size // (d * b)
                    if tp_mode == "uniform":
                        all_t = sorted({t for ts in tps for t in ts})
                        groups = [(t, tuple((k, t) for k in range(len(tps)) if t in tps[k]))
                                  for t in all_t]
                    else:
                        groups = [(0, tuple((k, t) for k in range(len(tps)) for t in tps[k]))]
                    for t, opts in groups:
                        if not opts:
                            continue
                        cap = 0
                        for k in range(len(tps)):
                            tk = [tt for (kk, tt) in opts if kk == k]
                            if tk:
                                cap += ndev[k] // (d * min(tk))
                        nmax = min(cap, L // v)
                        for n in range(1, nmax + 1):
                            if v > 1:
                                try:
                                    validate_schedule(sched, n, m, v)
                                except PoseidonError:
                                    continue
                            out.append(OuterConfig(sched, v, b, d, m, n, t, opts))
    return out


# --------------------------------------------------------------------------- per-config data

def _option_arrays(cm: CostModel, cfg: OuterConfig) -> dict:
    cols = {k: [] for k in ("f", "b", "ef", "eb", "of", "ob", "gl", "ge", "go")}
    for (k, t) in cfg.options:
        lc = cm.layer_costs(k, t, cfg.micro_batch_size)
        cols["f"].append(lc.forward_ms)
        cols["b"].append(lc.backward_ms)
        cols["ef"].append(lc.embedding_forward_ms)
        cols["eb"].append(lc.embedding_backward_ms)
        cols["of"].append(lc.output_forward_ms)
        cols["ob"].append(lc.output_backward_ms)
        cols["gl"].append(lc.grad_bytes)
        cols["ge"].append(lc.embedding_grad_bytes)
        cols["go"].append(lc.output_grad_bytes)
    return cols


def _lmax(cm: CostModel, cfg: OuterConfig) -> np.ndarray:
    cache = cm.search_cache.setdefault("lmax", {})
    hit = cache.get(cfg)
    if hit is None:
        hit = cache[cfg] = _lmax_uncached(cm, cfg)
        hit.setflags(write=False)
    return hit


def _lmax_uncached(cm: CostModel, cfg: OuterConfig) -> np.ndarray:
    n, L = cfg.num_stages, cm.model.num_layers
    limit = L - (n - 1) * cfg.virtual_stages
    out = np.zeros((len(cfg.options), n), dtype=np.int32)
    for o, (k, t) in enumerate(cfg.options):
        for x in range(n):
            out[o, x] = cm.max_layers(
                capacity_bytes=cm.capacity_bytes[k], stage=x, num_stages=n, tp=t, dp=cfg.dp,
                micro_batch_size=cfg.micro_batch_size, num_microbatches=cfg.num_microbatches,
                schedule=cfg.schedule, virtual_stages=cfg.virtual_stages, limit=limit)
    return out


def _min_send(cm: CostModel, b: int) -> float:
    best = max(max(cm.intra_gbps), max(cm.inter_gbps), cm.cross_gbps)
    return cm.activation_bytes(b) * 8.0 / (best * 1e6) + cm.latency_ms


def _max_send(cm: CostModel, b: int) -> float:
    worst = min(min(cm.intra_gbps), min(cm.inter_gbps), cm.cross_gbps)
    return cm.activation_bytes(b) * 8.0 / (worst * 1e6) + cm.latency_ms


def _capacity_types(cm: CostModel, cfg: OuterConfig, cols: dict) -> list[tuple[float, int]]:
    """Per usable device type: (M x cheapest per-layer f + b, most stages of the type)."""
    m, d = cfg.num_microbatches, cfg.dp
    per_type: dict[int, tuple[float, int]] = {}
    for o, (k, t) in enumerate(cfg.options):
        a = m * (cols["f"][o] + cols["b"][o])
        best, dtmin = per_type.get(k, (math.inf, 0))
        per_type[k] = (min(best, a), d * t if dtmin == 0 else min(dtmin, d * t))
    return [(a, cm.pools[k].size // dt) for k, (a, dt) in sorted(per_type.items())]


def capacity_layers(cm: CostModel, cfg: OuterConfig, t_ms: float, cols: dict | None = None
                    ) -> int:
    """Most layers the N stages can hold when every stage's serial work M l (f + b) <= t_ms.

    A stage of type k takes >= d * t_min(k) devices, so at most ndev_k // (d t_min(k)) stages
    are of type k, each holding <= floor(t_ms / (M min_t (f + b))) layers (and <= L - (N-1) V).
    The best N of those stages (caps descending) bound the layers any plan of this
    configuration with iteration time <= t_ms can place from above; -1 if fewer than N stages
    can hold V layers each.
    """
    if cols is None:
        cols = _option_arrays(cm, cfg)
    return _capacity_at(_capacity_types(cm, cfg, cols), cfg, cm.model.num_layers, t_ms)


def _capacity_at(types: list[tuple[float, int]], cfg: OuterConfig, L: int, t_ms: float) -> int:
    n, v = cfg.num_stages, cfg.virtual_stages
    limit = L - (n - 1) * v
    caps = []
    for a, cnt in types:
        q = t_ms / a if a > 0 else math.inf
        cap = limit if q >= limit else min(limit, int(q * (1 + 1e-9) + 1e-9))
        if cap >= v and cnt > 0:
            caps.append((cap, cnt))
    caps.sort(reverse=True)
    total = taken = 0
    for cap, cnt in caps:
        j = min(cnt, n - taken)
        taken += j
        total += j * cap
    return total if taken >= n else -1


def root_bound(cm: CostModel, cfg: OuterConfig) -> float:
    """Lower bound on every plan of ``cfg``: the larger of the per-stage work bound and the
    capacity bound (the smallest t with ``capacity_layers(t) >= L``; capacity only changes at
    t = M (f + b)_k n, so that t is found by bisection over those values, and returned
    1e-9 below)."""
    key = ("root", cfg)
    cache = cm.search_cache.setdefault("root", {})
    hit = cache.get(cfg)
    if hit is not None:
        return hit
    cols = _option_arrays(cm, cfg)
    minfb = min(f + b for f, b in zip(cols["f"], cols["b"]))
    L, n, m, v = cm.model.num_layers, cfg.num_stages, cfg.num_microbatches, cfg.virtual_stages
    base = max(m * math.ceil(L / n) * minfb, L * minfb)
    types = _capacity_types(cm, cfg, cols)
    limit = L - (n - 1) * v
    cands = sorted({a * j for a, _ in types for j in range(v, limit + 1)})
    if not cands or _capacity_at(types, cfg, L, cands[-1]) < L:
        out = math.inf
    else:
        lo, hi = 0, len(cands) - 1          # smallest index with capacity >= L
        while lo < hi:
            mid = (lo + hi) // 2
            if _capacity_at(types, cfg, L, cands[mid]) >= L:
                hi = mid
            else:
                lo = mid + 1
        out = max(base, cands[lo] * (1 - 1e-9))
    del key
    cache[cfg] = out
    return out


def _safe_ridge_applies(cm: CostModel, cfg: OuterConfig, cols: dict, lmax: np.ndarray
                        ) -> tuple[bool, float]:
    if cfg.schedule != "eager-1f1b" or cfg.dp != 1:
        return False, 0.0
    n, m = cfg.num_stages, cfg.num_microbatches
    if m < 2 * n or n < 3:
        return False, 0.0
    ratios = [b / f for f, b in zip(cols["f"], cols["b"]) if f > 0]
    if len(ratios) != len(cols["f"]):
        return False, 0.0
    r = ratios[0]
    if r <= 1.0 or any(abs(x - r) > 1e-9 * r for x in ratios):
        return False, 0.0
    if _max_send(cm, cfg.micro_batch_size) > (r - 1.0) / 2.0 * min(cols["f"]):
        return False, 0.0
    limit = cm.model.num_layers - (n - 1)
    if int(lmax.min()) < limit:
        return False, 0.0
    return True, max(2.0 / 3.0, r / (1.0 + r))


def config_payload(cm: CostModel, cfg: OuterConfig, *, pruning: str, type_order: str,
                   type_sequence_limit: int, threshold_ms: float, deadline: float
                   ) -> tuple[dict, bool]:
    """The ``cfg`` dict ``_search.search_config`` takes; second value: blocks restriction used."""
    cols = _option_arrays(cm, cfg)
    lmax = _lmax(cm, cfg)
    usable_types = len({k for k, _ in cfg.options})
    if type_order == "auto":
        blocks = usable_types ** cfg.num_stages > type_sequence_limit
    else:
        blocks = type_order == "blocks"
    ridge_mode, ridge_ends, alpha = _search.RIDGE_OFF, 0, 0.0
    if pruning == "ridge":
        ridge_mode, ridge_ends = _search.RIDGE_CUT, 1
    elif pruning == "safe":
        ok, alpha = _safe_ridge_applies(cm, cfg, cols, lmax)
        if ok:
            ridge_mode = _search.RIDGE_SAFE
    node_of, local_of, type_off = [], [], []
    for p in cm.pools:
        type_off.append(len(node_of))
        node_of.extend(p.node_of)
        local_of.extend(p.local_of)
    payload = dict(
        d=cfg.dp, L=cm.model.num_layers, act_bytes=cm.activation_bytes(cfg.micro_batch_size),
        latency_ms=cm.latency_ms, cross_gbps=cm.cross_gbps,
        minsend=_min_send(cm, cfg.micro_batch_size),
        minfb=min(f + b for f, b in zip(cols["f"], cols["b"])),
        outmin=min(of + ob for of, ob in zip(cols["of"], cols["ob"])),
        alpha=alpha, ridge_mode=ridge_mode, ridge_ends=ridge_ends, blocks=int(blocks),
        use_bound=0 if pruning == "none" else 1,
        threshold_ms=threshold_ms, deadline=deadline,
        opt_type=[k for k, _ in cfg.options], opt_tp=[t for _, t in cfg.options],
        lmax=lmax, ndev=[p.size for p in cm.pools], type_off=type_off,
        intra=list(cm.intra_gbps), inter=list(cm.inter_gbps), node_of=node_of,
        local_of=local_of, **cols)
    return payload, blocks


def run_config(cm: CostModel, cfg: OuterConfig, *, pruning: str, type_order: str,
               type_sequence_limit: int, threshold_ms: float, deadline: float,
               threads: int = 1) -> dict:
    cache = cm.search_cache.setdefault("payload", {})
    pkey = (cfg, pruning, type_order, type_sequence_limit)
    hit = cache.get(pkey)
    if hit is None:
        hit = cache[pkey] = config_payload(cm, cfg, pruning=pruning, type_order=type_order,
                                           type_sequence_limit=type_sequence_limit,
                                           threshold_ms=math.inf, deadline=0.0)
    payload, blocks = hit
    payload = dict(payload, threshold_ms=threshold_ms, deadline=deadline)
    st = bound_structure(cfg.schedule, cfg.num_stages, cfg.num_microbatches, cfg.virtual_stages)
    key = (cfg.schedule, cfg.num_stages, cfg.num_microbatches, cfg.virtual_stages)
    # the DAG is built only when the search reaches its first leaf (most configurations are
    # settled by the bounds alone); threads > 1: one DAG per thread (its own workspace)
    res = _search.search_config(st, lambda: cached_dag(*key), payload, threads,
                                lambda slot: cached_dag(*key, slot))
    res["blocks"] = blocks
    return res


@lru_cache(maxsize=64)
def cached_dag(schedule: str, n: int, m: int, v: int, slot: int = 0):
    """The simulator's ``PipelineDAG`` of (schedule, N, M, V), built once per process and
    ``slot`` (each thread of a split search uses its own slot: the DAG's workspace)."""
    dag = get_dag(schedule, n, m, v, ENGINE_TIMING)
    return dag if slot == 0 else dag.copy()


def bound_trace(cm: CostModel, cfg: OuterConfig, opts, layers) -> tuple[list[float], float]:
    """(g after each stage, simulated time) of one complete assignment (for the tests)."""
    payload, _ = config_payload(cm, cfg, pruning="none", type_order="any",
                                type_sequence_limit=0, threshold_ms=math.inf, deadline=0.0)
    payload["forced"] = (list(opts), list(layers))
    st = bound_structure(cfg.schedule, cfg.num_stages, cfg.num_microbatches, cfg.virtual_stages)
    dag = cached_dag(cfg.schedule, cfg.num_stages, cfg.num_microbatches, cfg.virtual_stages)
    res = _search.search_config(st, dag, payload)
    return res["gtrace"], res["forced_T"]


# --------------------------------------------------------------------------- evaluation

def fast_plan_time(cm: CostModel, cfg: OuterConfig, stage_opts, layers) -> float:
    """``evaluate_plan_time`` through the search's own cost path and the cached DAG (equal to
    it: ``tests/test_search.py`` checks the bound trace's time against it)."""
    return bound_trace(cm, cfg, stage_opts, layers)[1]


def evaluate_plan_time(cm: CostModel, cfg: OuterConfig, stage_opts, layers) -> float:
    """Iteration time of one concrete assignment through the Python cost path + simulator."""
    types = [cfg.options[o][0] for o in stage_opts]
    tps = [cfg.options[o][1] for o in stage_opts]
    stages, placements, _ = cm.stage_costs(
        stage_types=types, stage_tps=tps, layers=layers, dp=cfg.dp,
        micro_batch_size=cfg.micro_batch_size, num_microbatches=cfg.num_microbatches,
        schedule=cfg.schedule, virtual_stages=cfg.virtual_stages)
    wrap = cm.wrap_send_ms(placements, cfg.micro_batch_size) if cfg.virtual_stages > 1 else 0.0
    F, B, Pf, Pb, R = simulator_arrays(stages, cfg.virtual_stages, wrap)
    return iteration_time_ms(F, B, Pf, Pb, R, cfg.num_microbatches, cfg.schedule,
                             cfg.virtual_stages, engine=ENGINE_TIMING)


def _random_assignment(cm: CostModel, cfg: OuterConfig, lmax: np.ndarray, rng: random.Random):
    n, v, d = cfg.num_stages, cfg.virtual_stages, cfg.dp
    cursors = [0] * len(cm.pools)
    opts = []
    for x in range(n):
        cand = []
        for o, (k, t) in enumerate(cfg.options):
            pool = cm.pools[k]
            start = cursors[k]
            if start < pool.size and pool.local_of[start] % t:
                start += t - pool.local_of[start] % t
            if start + d * t <= pool.size and lmax[o, x] >= v:
                cand.append((o, start + d * t))
        if not cand:
            return None
        o, nxt = rng.choice(cand)
        cursors[cfg.options[o][0]] = nxt
        opts.append(o)
    caps = [int(lmax[o, x]) for x, o in enumerate(opts)]
    L = cm.model.num_layers
    if sum(caps) < L or v * n > L:
        return None
    layers = []
    rem = L
    for x in range(n):
        later = n - 1 - x
        lo = max(v, rem - sum(caps[x + 1:]))
        hi = min(caps[x], rem - later * v)
        if hi < lo:
            return None
        layers.append(lo if x == n - 1 and lo == hi else rng.randint(lo, hi))
        rem -= layers[-1]
    if rem != 0:
        return None
    return opts, layers


# --------------------------------------------------------------------------- entry point

def _check_tp_degrees(cluster, model, tp_degrees) -> tuple[int, ...] | None:
    """None (every valid degree) or the allowed TP degrees; an error when none is valid."""
    if tp_degrees is None:
        return None
    tp_degrees = tuple(tp_degrees)
    if not tp_degrees or any(isinstance(t, bool) or not isinstance(t, int) or t < 1
                             for t in tp_degrees):
        raise PoseidonError(f"TP degrees (--tp / tp_degrees): expected integers >= 1, "
                            f"got {list(tp_degrees)!r}")
    valid = sorted({t for n in cluster.type_names for t in tp_candidates(cluster, model, n)})
    if not set(tp_degrees) & set(valid):
        raise PoseidonError(f"TP degrees (--tp / tp_degrees): none of {sorted(tp_degrees)} is "
                            f"valid on this cluster for {model.name} (valid: {valid}; a TP "
                            f"group stays in one node and divides the attention heads and "
                            f"query groups)")
    return tp_degrees


def _normalize_tp_mode(tp_mode: str) -> str:
    aliases = {"uniform": "uniform", "uniform-tp": "uniform", "per-stage": "per-stage",
               "per-stage-tp": "per-stage"}
    if tp_mode not in aliases:
        raise PoseidonError(f"TP mode (--uniform-tp / --per-stage-tp, tp_mode): expected "
                            f"'uniform' or 'per-stage', got {tp_mode!r}")
    return aliases[tp_mode]


def search_plan(cluster, model, options=None, profiles=None, **kw):
    """New entry point: ``search_plan(cluster, model, SearchOptions(...), profiles)``."""
    from .options import SearchOptions
    if options is None:
        options = SearchOptions(**{k: v for k, v in kw.items() if k != "profiles"})
        profiles = kw.get("profiles", profiles)
    o = options
    return _search_plan_old(cluster, model, global_batch_size=o.global_batch_size,
                            seq_length=o.seq_length, profiles=profiles, schedules=o.schedules,
                            pruning=o.pruning, tp_mode=o.tp_mode,
                            micro_batch_sizes=o.micro_batch_sizes,
                            max_virtual_stages=o.max_virtual_stages,
                            warmup_samples=o.warmup_samples, time_budget_s=o.time_budget_s,
                            workers=o.workers, progress=o.progress, seed=o.seed,
                            type_order=o.type_order, type_sequence_limit=o.type_sequence_limit,
                            tp_degrees=o.tp_degrees)


def _search_plan_old(cluster, model, *, global_batch_size: int, seq_length: int, profiles=None,
                schedules=("1f1b", "eager-1f1b", "interleaved-1f1b"), pruning: str = "safe",
                tp_mode: str = "uniform", micro_batch_sizes=None, max_virtual_stages: int = 2,
                warmup_samples: int = 500, time_budget_s: float | None = None,
                workers: int | None = None, progress: bool = False, seed: int = 0,
                type_order: str = "auto", type_sequence_limit: int = TYPE_SEQUENCE_LIMIT,
                tp_degrees=None, _return_best: bool = False) -> Plan:
    """The fastest plan (see the module docstring); InfeasibleError when nothing fits.
    ``tp_degrees``: the TP degrees allowed (default: every valid one)."""
    t0 = time.perf_counter()
    tp_mode = _normalize_tp_mode(tp_mode)
    if pruning not in PRUNING_MODES:
        raise PoseidonError(f"pruning (--pruning / pruning): expected one of "
                            f"{', '.join(PRUNING_MODES)}, got {pruning!r}")
    if type_order not in TYPE_ORDERS:
        raise PoseidonError(f"type order (--type-order / type_order): expected one of "
                            f"{', '.join(TYPE_ORDERS)}, "
                            f"got {type_order!r}")
    schedules = tuple(schedules)
    for s in schedules:
        if s not in SEARCH_SCHEDULES:
            raise PoseidonError(f"schedules (--schedules / schedules): expected some of "
                                f"{', '.join(SEARCH_SCHEDULES)}, "
                                f"got {s!r}")
    if not schedules:
        raise PoseidonError("schedules (--schedules / schedules): expected at least one schedule")
    for name, val in (("global batch size (--global-batch-size / global_batch_size)",
                       global_batch_size),
                      ("sequence length (--seq-length / seq_length)", seq_length),
                      ("max virtual stages (--max-virtual-stages / max_virtual_stages)",
                       max_virtual_stages)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise PoseidonError(f"{name}: expected an integer >= 1, got {val!r}")
    mbs = tuple(DEFAULT_MICRO_BATCH_SIZES if micro_batch_sizes is None else micro_batch_sizes)
    if not mbs or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in mbs):
        raise PoseidonError(f"micro-batch sizes (--micro-batch-sizes / micro_batch_sizes): "
                            f"expected integers >= 1, got {list(mbs)!r}")
    tp_degrees = _check_tp_degrees(cluster, model, tp_degrees)
    if time_budget_s is not None and time_budget_s <= 0:
        raise PoseidonError(f"time budget (--time-budget / time_budget_s): expected a number "
                            f"> 0, got {time_budget_s!r}")

    cm = CostModel(cluster, model, profiles, seq_length=seq_length)
    configs = enumerate_configs(cm, global_batch_size=global_batch_size, schedules=schedules,
                                tp_mode=tp_mode, micro_batch_sizes=mbs,
                                max_virtual_stages=max_virtual_stages, tp_degrees=tp_degrees)
    if not configs:
        splits = [b for b in mbs if global_batch_size % b == 0]
        if not splits:
            raise InfeasibleError(
                f"global batch size {global_batch_size} is not divisible by any micro-batch size "
                f"in {list(mbs)}: no batch split M = G / (dp x mbs) is an integer")
        raise InfeasibleError(
            f"no (dp, tp, pp, schedule) fits the cluster for global batch size "
            f"{global_batch_size} with micro-batch sizes {list(mbs)} (check the device counts, "
            f"TP divisibility and that interleaving has M a multiple of pp)")
    deadline_wall = None if time_budget_s is None else time.monotonic() + time_budget_s
    deadline_c = 0.0 if deadline_wall is None else deadline_wall

    stats = dict(configs=len(configs), configs_cut_root=0, configs_searched=0,
                 plans_simulated=0, nodes=0, cut_bound=0, cut_memory=0, cut_ridge=0,
                 cut_devices=0, cut_capacity=0, rounds=0, warmup_plans=0, type_order_restricted_configs=0)
    best: tuple | None = None   # (time, cfg.key, opts, layers, cfg)

    def consider(t: float, cfg: OuterConfig, opts, layers) -> None:
        nonlocal best
        cand = (t, cfg.key, tuple(opts), tuple(layers))
        if best is None or cand < best[:4]:
            best = cand + (cfg,)

    # ---- order configurations by their root bound (cheapest first; deterministic)
    if pruning == "none":
        order = list(range(len(configs)))
        roots = [0.0] * len(configs)
    else:
        roots = [root_bound(cm, c) for c in configs]
        order = sorted(range(len(configs)), key=lambda i: (roots[i], configs[i].key))
    log.debug("%d configurations and their root bounds: %.2f s", len(configs),
              time.perf_counter() - t0)

    threshold = math.inf
    if tp_mode == "per-stage" and pruning != "none":
        # the uniform-TP space is part of the per-stage one: its optimum (a much smaller search)
        # is a valid incumbent, so the per-stage rounds stop below it and a time budget never
        # returns a plan worse than the uniform one
        left = None if deadline_wall is None else max(1e-3, deadline_wall - time.monotonic())
        try:
            sb, sst = _search_plan_old(
                cluster, model, global_batch_size=global_batch_size, seq_length=seq_length,
                profiles=profiles, schedules=schedules, pruning=pruning, tp_mode="uniform",
                micro_batch_sizes=mbs, max_virtual_stages=max_virtual_stages,
                warmup_samples=warmup_samples, time_budget_s=left, workers=workers, seed=seed,
                type_order=type_order, type_sequence_limit=type_sequence_limit,
                tp_degrees=tp_degrees, _return_best=True)
        except InfeasibleError:
            stats["uniform_tp_seed_ms"] = None
        else:
            for k in ("nodes", "plans_simulated", "cut_bound", "cut_memory", "cut_ridge",
                      "cut_devices", "cut_capacity", "warmup_plans"):
                stats[k] += sst[k]
            stats["uniform_tp_seed_ms"] = round(sb[0], 3)
            threshold = sb[0]
            consider(sb[0], sb[4], sb[2], sb[3])

    # ---- warm-up sampling (seeds the bound; skipped by the exhaustive mode). The samples come
    # from the first WARMUP_CONFIGS configurations, by root bound, where a random assignment
    # fits (a few tries each; the promising ones, whose DAGs the search needs anyway, and few
    # DAGs to build), then at random among those.
    if pruning != "none" and warmup_samples > 0:
        rng = random.Random(seed)
        scan = iter([i for i in order if math.isfinite(roots[i])])
        pool: list[int] = []
        attempts = 0
        scanning = True

        def sample(i: int) -> bool:
            nonlocal threshold
            cfg = configs[i]
            a = _random_assignment(cm, cfg, _lmax(cm, cfg), rng)
            if a is None:
                return False
            t = fast_plan_time(cm, cfg, *a)
            stats["warmup_plans"] += 1
            threshold = min(threshold, t)
            consider(t, cfg, *a)
            return True

        while stats["warmup_plans"] < warmup_samples and attempts < 4 * warmup_samples:
            if (deadline_wall is not None and stats["warmup_plans"] > 0
                    and time.monotonic() > deadline_wall):
                break   # (one plan at least, so that a tiny budget still returns a plan)
            if scanning and len(pool) < WARMUP_CONFIGS:
                i = next(scan, None)
                if i is None:
                    scanning = False
                    continue
                for _ in range(4):
                    attempts += 1
                    if sample(i):
                        pool.append(i)
                        break
                continue
            if not pool:
                break
            attempts += 1
            sample(rng.choice(pool))
        log.debug("warm-up: %d plans, best %.3f ms (at %.2f s)", stats["warmup_plans"], threshold,
                  time.perf_counter() - t0)

    lbs = list(roots)          # per configuration: no plan of it is faster (besides the best)
    searched_last: set[int] = set()
    searched_ever: set[int] = set()
    timed_out = False
    complete = True
    used_threads = False
    work: dict[int, int] = {}   # configuration -> nodes of its last search (thread split)

    def absorb(i: int, res: dict, thr_used: float) -> None:
        nonlocal threshold, timed_out
        stats["configs_searched"] += 1
        searched_last.add(i)
        searched_ever.add(i)
        for k in ("nodes", "cut_bound", "cut_memory", "cut_ridge", "cut_devices",
                  "cut_capacity"):
            stats[k] += res[k]
        stats["plans_simulated"] += res["simulated"]
        if res["timed_out"]:
            timed_out = True
        else:
            lbs[i] = max(lbs[i], thr_used)
        if res["best"] is not None:
            t, opts, layers = res["best"]
            consider(t, configs[i], opts, layers)
            threshold = min(threshold, t)

    nworkers = workers if workers is not None else (os.cpu_count() or 1)
    nworkers = max(1, int(nworkers))
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(order), desc="poseidon search", unit="cfg", leave=False)

    def run_round(cap: float, pass_order: list[int], pass_type_order: str) -> None:
        """Search every configuration of ``pass_order`` whose root bound is <= min(cap,
        threshold) with the threshold min(cap, incumbent): afterwards the best plan of the
        pass's space with time <= cap is known. A configuration whose last search took
        >= SPLIT_NODES nodes is searched by ``nworkers`` threads (its subtrees shared)."""
        nonlocal timed_out, used_threads
        thr_of = (lambda: math.inf) if pruning == "none" else (lambda: min(cap, threshold))
        for i in pass_order:
            if deadline_wall is not None and time.monotonic() > deadline_wall:
                timed_out = True
                break
            if pruning != "none" and roots[i] > thr_of() * (1 + 1e-9):
                break   # order is by root bound: the rest are cut too
            thr = thr_of()
            threads = nworkers if nworkers > 1 and work.get(i, 0) >= SPLIT_NODES else 1
            res = run_config(cm, configs[i], pruning=pruning, type_order=pass_type_order,
                             type_sequence_limit=type_sequence_limit, threshold_ms=thr,
                             deadline=deadline_c, threads=threads)
            work[i] = res["nodes"]
            if res["split_depth"]:
                used_threads = True
            absorb(i, res, thr)
            if bar:
                bar.update(1)

    def run_pass(pass_order: list[int], pass_type_order: str) -> bool:
        """Iterative deepening over ``pass_order`` (see the module docstring); True when the
        pass completed (the incumbent is the best plan of the pass's space, or better).

        Round r searches with cap_r = root * (1+step)^r; a cap that would pass the incumbent
        becomes, once per pass, the midpoint of the proven bound and the incumbent if their gap
        is > 0.2 %, else the incumbent (cap = inf: threshold = incumbent). A round
        that ends with no plan <= cap_r proves every plan of the pass is > cap_r; the first
        round that finds one (threshold <= cap_r) has found the best plan, since every better
        plan would have been <= cap_r too. With an incumbent from an earlier pass (a seed),
        the rounds stop below it and the last round searches with the seed as threshold: any
        plan found beats or ties the seed, and if none, the seed is the best plan."""
        r0 = roots[pass_order[0]] if pass_order else math.inf
        deepen = pruning != "none" and math.isfinite(r0) and r0 > 0
        cap = r0 * (1 + ROUND_STEP) if deepen else math.inf
        proven = 0.0
        rounds = 0
        bisected = False
        while True:
            if deepen and cap >= threshold:
                # the next geometric cap passes the incumbent: once, if the gap is wide, search
                # with the midpoint of the proven bound and the incumbent (a round that finds
                # the optimum early is much cheaper than one that starts from a distant
                # incumbent; when the incumbent is the optimum this round costs less than the
                # last one), then with the incumbent itself
                if (not bisected and math.isfinite(threshold) and proven > 0
                        and threshold > proven * (1 + BISECT_GAP)):
                    bisected = True
                    cap = 0.5 * (proven + threshold)
                else:
                    cap = math.inf
            if rounds >= MAX_ROUNDS - 1:
                cap = math.inf
            rounds += 1
            stats["rounds"] += 1
            searched_last.clear()
            if bar:
                bar.reset()
            t_round = time.perf_counter()
            n_before = stats["nodes"]
            run_round(cap, pass_order, pass_type_order)
            log.debug("pass %s: round cap %.1f, incumbent %.1f, %d configs, %d nodes, %.2f s",
                      pass_type_order, cap, threshold, len(searched_last),
                      stats["nodes"] - n_before, time.perf_counter() - t_round)
            if timed_out or threshold <= cap or not math.isfinite(cap):
                break
            proven = max(proven, cap)
            cap *= 1 + ROUND_STEP
        # every configuration of the pass has no plan below ``proven`` (completed rounds) in
        # the pass's space
        for i in pass_order:
            lbs[i] = max(lbs[i], proven)
        return not timed_out

    # Passes. ``auto`` / ``any``: first the cheap contiguous-blocks space over every
    # configuration (seeds the incumbent with the best blocks plan, a good plan early under a
    # time budget), then the full space only over the configurations where it is larger
    # (interleaving allowed, >= 2 usable types, N >= 2), with that incumbent. The full space
    # is a superset, so the seed is a valid incumbent and the result is the full-space optimum.
    passes: list[tuple[list[int], str]]
    if type_order == "blocks" or pruning == "none":
        passes = [(order, type_order)]
    else:
        def widens(i: int) -> bool:
            cfg = configs[i]
            usable = len({k for k, _ in cfg.options})
            if usable < 2 or cfg.num_stages < 2:
                return False
            return type_order == "any" or usable ** cfg.num_stages <= type_sequence_limit
        full = [i for i in order if widens(i)]
        passes = [(order, "blocks")] + ([(full, type_order)] if full else [])
    try:
        for pass_order, pass_type_order in passes:
            if pass_order is not order:
                for i in pass_order:   # the blocks pass proved nothing about the full space
                    lbs[i] = roots[i]
            if not run_pass(pass_order, pass_type_order):
                complete = False
                break
        stats["configs_cut_root"] = len(configs) - len(searched_ever)
    finally:
        if bar:
            bar.close()
    # configurations whose final search space is the contiguous blocks only (and smaller
    # than the full one: >= 2 usable types, N >= 2)
    stats["type_order_restricted_configs"] = sum(
        1 for c in configs if c.num_stages >= 2 and len({k for k, _ in c.options}) >= 2
        and (type_order == "blocks" or type_order == "auto" and
             len({k for k, _ in c.options}) ** c.num_stages > type_sequence_limit))
    stats["passes"] = len(passes)

    if best is None:
        if timed_out:
            raise InfeasibleError(
                f"time budget (--time-budget / time_budget_s) of {time_budget_s:g} s ran out "
                f"before any plan was found; give the search more time")
        raise InfeasibleError(_closest_infeasible(cm, configs))

    exhaustive = complete and not timed_out
    t_best, _, opts, layers, cfg = best
    if exhaustive:
        lower = t_best
    else:
        lower = min([t_best] + lbs)
    stats.update(seconds=round(time.perf_counter() - t0, 3), exhaustive=exhaustive,
                 timed_out=timed_out, pruning=pruning, tp_mode=tp_mode, type_order=type_order,
                 workers=nworkers, statistics_depend_on_timing=used_threads)
    if _return_best:
        return best, stats
    return build_plan(cm, cfg, opts, layers, global_batch_size=global_batch_size,
                      predicted_ms=t_best, lower_bound_ms=lower, search_stats=stats)


def _stage_type_match(allowed: list[list[int]], counts: list[int]) -> list[int] | None:
    """A type per stage among those it allows, type k serving at most counts[k] stages, or
    None (bipartite b-matching by augmenting paths; a few dozen stages and types)."""
    owner: list[list[int]] = [[] for _ in counts]

    def augment(x: int, seen: set[int]) -> bool:
        for k in allowed[x]:
            if k in seen:
                continue
            seen.add(k)
            if len(owner[k]) < counts[k]:
                owner[k].append(x)
                return True
            for j, y in enumerate(owner[k]):
                if augment(y, seen):
                    owner[k][j] = x
                    return True
        return False

    if not all(augment(x, set()) for x in range(len(allowed))):
        return None
    got = [0] * len(allowed)
    for k, xs in enumerate(owner):
        for x in xs:
            got[x] = k
    return got


def _closest_infeasible(cm: CostModel, configs: list[OuterConfig]) -> str:
    """One line: the candidate that comes closest to fitting and how much memory it lacks.

    Per configuration (1F1B-like schedules): layers split evenly over the stages, each stage on
    a device type of the configuration's options with type k serving at most
    devices_k // (dp * t) stages; the shortfall of a configuration is the smallest, over such
    assignments, of its worst stage's (memory - capacity) (bisection over the candidate
    values, each checked by a matching). The configuration with the smallest shortfall is
    named, with its worst stage."""
    best = None
    gib = 1024 ** 3
    for cfg in configs:
        if cfg.schedule not in ("1f1b", "eager-1f1b", "gpipe"):
            continue
        need = cm.model.num_layers
        n = cfg.num_stages
        if n > need:
            continue
        base = [need // n + (1 if x < need % n else 0) for x in range(n)]
        counts: dict[int, int] = {}
        for k, t in cfg.options:
            c = cm.pools[k].size // (cfg.dp * t)
            counts[k] = max(counts.get(k, 0), c)
        # short[x][k] = (memory - capacity, memory) of stage x on type k's best option
        short: list[dict[int, tuple[int, int]]] = []
        for x in range(n):
            row: dict[int, tuple[int, int]] = {}
            for k, t in cfg.options:
                if counts[k] <= 0:
                    continue
                mem = cm.stage_memory_bytes(layers=base[x], stage=x, num_stages=n, tp=t,
                                            dp=cfg.dp, micro_batch_size=cfg.micro_batch_size,
                                            num_microbatches=cfg.num_microbatches,
                                            schedule=cfg.schedule,
                                            virtual_stages=cfg.virtual_stages)
                cand = (mem - cm.capacity_bytes[k], mem)
                if k not in row or cand < row[k]:
                    row[k] = cand
            short.append(row)
        ks = sorted(counts)
        cnt = [counts[k] for k in ks]
        values = sorted({v[0] for row in short for v in row.values()})

        def fits(tau: int) -> list[int] | None:
            allowed = [[i for i, k in enumerate(ks) if k in row and row[k][0] <= tau]
                       for row in short]
            return _stage_type_match(allowed, cnt)

        if not values or fits(values[-1]) is None:
            continue   # the devices cannot host n stages at all
        lo, hi = 0, len(values) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if fits(values[mid]) is not None:
                hi = mid
            else:
                lo = mid + 1
        tau = values[lo]
        assign = [ks[i] for i in fits(tau)]
        # the worst stage of that assignment (its shortfall is tau)
        x_w = max(range(n), key=lambda x: (short[x][assign[x]][0], -x))
        k_w = assign[x_w]
        cand = (tau, cfg.key)
        if best is None or cand < best[0]:
            best = (cand, cfg, x_w, k_w, short[x_w][k_w][1])
    if best is None:
        return "no plan fits: no configuration could be placed on the cluster"
    (tau, _), cfg, x, k, mem = best
    if tau <= 0:
        return (f"no plan fits: the closest (pp={cfg.num_stages}, tp={cfg.tp or 'per-stage'}, "
                f"dp={cfg.dp}, micro-batch {cfg.micro_batch_size}, {cfg.schedule}) fits memory "
                f"with an even layer split but its stages cannot be placed on the devices "
                f"(TP groups must not span nodes)")
    return (f"no plan fits in device memory: the closest (pp={cfg.num_stages}, "
            f"tp={cfg.tp or 'per-stage'}, dp={cfg.dp}, micro-batch {cfg.micro_batch_size}, "
            f"{cfg.schedule}) lacks {tau / gib:.2f} GiB on stage {x} "
            f"({cm.type_names[k]}: needs {mem / gib:.2f} GiB of "
            f"{cm.capacity_bytes[k] / gib:.2f} GiB)")


# --------------------------------------------------------------------------- plan

def build_plan(cm: CostModel, cfg: OuterConfig, opts, layers, *, global_batch_size: int,
               predicted_ms: float, lower_bound_ms: float | None = None,
               search_stats: dict | None = None, check: bool = True) -> Plan:
    types = [cfg.options[o][0] for o in opts]
    tps = [cfg.options[o][1] for o in opts]
    stages, placements, unused = cm.stage_costs(
        stage_types=types, stage_tps=tps, layers=list(layers), dp=cfg.dp,
        micro_batch_size=cfg.micro_batch_size, num_microbatches=cfg.num_microbatches,
        schedule=cfg.schedule, virtual_stages=cfg.virtual_stages)
    wrap = cm.wrap_send_ms(placements, cfg.micro_batch_size) if cfg.virtual_stages > 1 else 0.0
    F, B, Pf, Pb, R = simulator_arrays(stages, cfg.virtual_stages, wrap)
    t = iteration_time_ms(F, B, Pf, Pb, R, cfg.num_microbatches, cfg.schedule,
                          cfg.virtual_stages, engine=ENGINE_TIMING)
    if check and abs(t - predicted_ms) > 1e-6 * max(1.0, abs(t)):
        raise AssertionError(f"search and simulator disagree: {predicted_ms} vs {t}")
    for s, st in enumerate(stages):
        if st.memory_bytes > st.memory_capacity_bytes:
            raise AssertionError(f"plan exceeds memory on stage {s}")
    stage_plans = tuple(
        StagePlan(index=s, device_type=cm.type_names[types[s]], tp=tps[s], dp=cfg.dp,
                  layers=int(layers[s]), forward_ms=st.forward_ms, backward_ms=st.backward_ms,
                  send_forward_ms=st.send_forward_ms, send_backward_ms=st.send_backward_ms,
                  allreduce_ms=st.allreduce_ms, memory_bytes=int(st.memory_bytes),
                  memory_capacity_bytes=int(st.memory_capacity_bytes),
                  devices=tuple(tuple(DeviceSlot(n, d) for (n, d) in grp)
                                for grp in placements[s].slots))
        for s, st in enumerate(stages))
    model, cluster = cm.model, cm.cluster
    used = sum(cfg.dp * tp for tp in tps)
    flops = model.model_flops_per_iteration(global_batch_size, cm.seq_length)
    tflops_dev = flops / (t / 1e3) / used / 1e12
    peak = sum(cluster.device_types[cm.type_names[k]].peak_tflops * cfg.dp * tp
               for k, tp in zip(types, tps))
    mfu = flops / (t / 1e3) / (peak * 1e12)
    lb = t if lower_bound_ms is None else min(lower_bound_ms, t)
    return Plan(
        schedule=cfg.schedule, virtual_stages=cfg.virtual_stages, dp=cfg.dp,
        micro_batch_size=cfg.micro_batch_size, num_microbatches=cfg.num_microbatches,
        global_batch_size=global_batch_size, seq_length=cm.seq_length, stages=stage_plans,
        predicted_iteration_time_ms=t, model_name=model.name, cluster_name=cluster.name,
        unused_devices=tuple(DeviceSlot(n, d) for (n, d) in unused),
        search=dict(search_stats or {}),
        predicted_tokens_per_s=global_batch_size * cm.seq_length / (t / 1e3),
        model_tflops_per_device=tflops_dev, mfu=mfu, lower_bound_ms=lb,
        gap=(t - lb) / t if t > 0 else 0.0, num_layers=model.num_layers)


# --------------------------------------------------------------------------- baselines

def baseline_plans(cluster, model, *, global_batch_size: int, seq_length: int, profiles=None,
                   micro_batch_sizes=None, workers: int | None = 1, tp_degrees=None,
                   **kw) -> dict[str, Plan | None]:
    """(a) ``megatron-default``: Megatron's even split over ALL devices (one TP, even layers,
    1f1b, the largest feasible DP, homogeneous assumptions), simulated on the real cluster;
    (b) ``best-single-type``: the best plan that uses one device type only.
    A baseline that cannot fit is None."""
    cm = CostModel(cluster, model, profiles, seq_length=seq_length)
    mbs = tuple(DEFAULT_MICRO_BATCH_SIZES if micro_batch_sizes is None else micro_batch_sizes)
    out: dict[str, Plan | None] = {"megatron-default": None, "best-single-type": None}
    # (a) even split: every stage the same shape; stages fill types in cluster order
    total = sum(p.size for p in cm.pools)
    L = model.num_layers
    cands = []
    tp_degrees = _check_tp_degrees(cluster, model, tp_degrees)
    tps_all = sorted(set.intersection(*[set(tp_candidates(cluster, model, n, tp_degrees))
                                        for n in cm.type_names]))
    for t in tps_all:
        for n in range(1, L + 1):
            if L % n:
                continue
            if total % (t * n):
                continue
            d = total // (t * n)
            for b in mbs:
                if global_batch_size % (d * b):
                    continue
                m = global_batch_size // (d * b)
                # stages in cluster order: fill type pools
                types, free = [], [p.size for p in cm.pools]
                ok = True
                for _ in range(n):
                    k = next((k for k in range(len(free)) if free[k] >= d * t), None)
                    if k is None:
                        ok = False
                        break
                    free[k] -= d * t
                    types.append(k)
                if not ok:
                    continue
                opts = tuple(sorted({(k, t) for k in types}))
                cfg = OuterConfig("1f1b", 1, b, d, m, n, t, opts)
                layers = [L // n] * n
                fits = all(cm.stage_memory_bytes(
                    layers=layers[x], stage=x, num_stages=n, tp=t, dp=d, micro_batch_size=b,
                    num_microbatches=m, schedule="1f1b", virtual_stages=1)
                    <= cm.capacity_bytes[types[x]] for x in range(n))
                if not fits:
                    continue
                so = [opts.index((k, t)) for k in types]
                tt = evaluate_plan_time(cm, cfg, so, layers)
                cands.append((tt, cfg.key, cfg, so, layers))
    if cands:
        tt, _, cfg, so, layers = min(cands, key=lambda c: c[:2])
        out["megatron-default"] = build_plan(cm, cfg, so, layers,
                                             global_batch_size=global_batch_size,
                                             predicted_ms=tt, search_stats={"baseline":
                                                                            "megatron-default"})
    # (b) best plan on a single device type
    best = None
    for name in cm.type_names:
        sub = _single_type_cluster(cluster, name)
        try:
            p = search_plan(sub, model, global_batch_size=global_batch_size,
                            seq_length=seq_length, profiles=profiles,
                            micro_batch_sizes=micro_batch_sizes, workers=workers,
                            tp_degrees=tp_degrees, **kw)
        except (InfeasibleError, PoseidonError):
            continue
        if best is None or p.predicted_iteration_time_ms < best.predicted_iteration_time_ms:
            best = p
    out["best-single-type"] = best
    return out


def _single_type_cluster(cluster, name: str):
    from dataclasses import replace
    from types import MappingProxyType
    nodes = tuple(n for n in cluster.nodes if n.device_type == name)
    # keep global node indices meaningful: re-index but remember the original name in the plan
    renum = tuple(replace(n, index=i) for i, n in enumerate(nodes))
    return replace(cluster, name=f"{cluster.name}[{name}]", nodes=renum,
                   device_types=MappingProxyType({name: cluster.device_types[name]}),
                   links=replace(cluster.links, inter_node_gbps=MappingProxyType(
                       {name: cluster.links.inter_node_gbps[name]})))
