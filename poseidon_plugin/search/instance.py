"""Per-configuration data of one search, and the calls into the Cython branch and bound.

A ``SearchContext`` wraps the ``CostModel`` of one (cluster, model, profiles, sequence length)
and owns the search's caches: per configuration its option costs, memory limits (``lmax``),
root bound and typed ``_search.ConfigInstance``; per (schedule, N, M, V) the simulator DAG.
Everything here is derived once and read many times (every round of iterative deepening
searches a configuration again with a lower threshold).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import numpy as np

from ..comm import send_ms
from ..costs import CostModel, chunk_layers, simulator_arrays, stage_layer_ranges
from ..plan import TIMING_MODEL
from .._core import DagCache, get_dag
from ..simulator.pipeline import iteration_time_ms
from . import _search
from .configs import (OptionCosts, OuterConfig, bound_structure, layer_limits,
                      chunk_totals_of, layer_limits_from, min_send_ms, root_bound,
                      stage_fits_counts,
                      stage_min_send_ms)

ENGINE_TIMING = TIMING_MODEL == "engine"
"""Plans are timed as megatron-core runs them (``_core.EngineDAG``: blocking, bundled p2p
calls); the paper's DAG under-predicts interleaved plans by ~4 % (see docs/search.md)."""


_COPIES = DagCache()    # the per-thread workspaces (slot > 0), bounded by bytes as get_dag's


def cached_dag(schedule: str, n: int, m: int, v: int, slot: int = 0, calls: tuple | None = None):
    """The simulator's ``PipelineDAG`` of (schedule, N, M, V) and megatron's per-op / per-call
    costs ``calls`` (``CostModel.engine_calls``), built once per process and ``slot`` (each
    thread of a split search uses its own slot: the DAG's workspace). Both caches are bounded
    by bytes (``_core.DagCache``), not by count: a DAG of 131,072 micro-batches holds ~0.3 GB."""
    if slot == 0:
        return get_dag(schedule, n, m, v, ENGINE_TIMING, calls)
    return _COPIES.get((schedule, n, m, v, slot, calls),
                       lambda: get_dag(schedule, n, m, v, ENGINE_TIMING, calls).copy())


DAG_BUILD_S_PER_OP = 3e-7
"""CPU seconds a DAG's build takes per op, taken high (2-core AMD EPYC: an interleaved EngineDAG
of 4.2M ops, PP 8, V 2, M 131,072: 1.0-1.4 s; a 1F1B DAG ~0.1 us an op)."""


def dag_build_seconds(cfg: OuterConfig, calls: tuple | None) -> float:
    """What timing the first plan of ``cfg`` costs in wall seconds before its first sweep: 0
    when its DAG is built (``_core.dag_is_built``), else DAG_BUILD_S_PER_OP per op (2 N M V)
    times the host's load per core when above 1 (a loaded host gives this process less)."""
    from .._core import dag_is_built

    if dag_is_built(cfg.schedule, cfg.num_stages, cfg.num_microbatches, cfg.virtual_stages,
                    ENGINE_TIMING, calls):
        return 0.0
    cpu = DAG_BUILD_S_PER_OP * 2 * cfg.num_stages * cfg.num_microbatches * cfg.virtual_stages
    return cpu * _load_factor()


def _load_factor() -> float:
    """max(1, 1-minute load average / cores); 1 where the OS does not say."""
    import os

    try:
        return max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))
    except (AttributeError, OSError):
        return 1.0


def time_assignment(cm: CostModel, cfg: OuterConfig, stage_opts, layers):
    """(stage costs, placements, unused devices, iteration time ms) of one assignment of
    ``cfg`` (an option index and a layer count per stage) through ``CostModel.stage_costs``
    and the simulator: the Python path every plan is checked and reported with (under context
    parallelism the CP-scoped cost model, the stage's DP x CP group as its ``dp``)."""
    cm = cm.at_cp(cfg.cp)
    stages, placements, unused = cm.stage_costs(
        stage_types=[cfg.options[o][0] for o in stage_opts],
        stage_tps=[cfg.options[o][1] for o in stage_opts], layers=list(layers), dp=cfg.dp_cp,
        micro_batch_size=cfg.micro_batch_size, num_microbatches=cfg.num_microbatches,
        schedule=cfg.schedule, virtual_stages=cfg.virtual_stages, ep=cfg.ep)
    wrap = cm.wrap_send_ms(placements, cfg.micro_batch_size) if cfg.virtual_stages > 1 else 0.0
    F, B, Pf, Pb, R = simulator_arrays(stages, cfg.virtual_stages, wrap)
    t = iteration_time_ms(F, B, Pf, Pb, R, cfg.num_microbatches, cfg.schedule,
                          cfg.virtual_stages, engine=ENGINE_TIMING,
                          calls=cm.engine_calls(cfg.micro_batch_size).as_tuple())
    return stages, placements, unused, t


@dataclass(frozen=True)
class RidgeRule:
    """Which layer-level rule a configuration's search applies (``_search.RidgeMode``)."""

    mode: int
    ends: int = 0
    alpha: float = 0.0


class SearchContext:
    """The cost model plus what the search derives from it per outer configuration."""

    def __init__(self, cm: CostModel, moe_free_stages: bool = True) -> None:
        self.cm = cm
        self.moe_free_stages = moe_free_stages   # SearchOptions.moe_free_stages
        self._costs: dict[OuterConfig, OptionCosts] = {}
        self._lmax: dict[OuterConfig, np.ndarray] = {}
        self._lmax_from: dict[OuterConfig, np.ndarray] = {}
        self._fit: dict[OuterConfig, object] = {}
        self._lmax_rows: dict[OuterConfig, list[list[int]]] = {}
        self._roots: dict[OuterConfig, float] = {}
        self._instances: dict[tuple, tuple[_search.ConfigInstance, bool]] = {}
        self.build_deadline: float | None = None   # replay: no DAG whose build outlasts it

    # ------------------------------------------------------------------ derived data
    def option_costs(self, cfg: OuterConfig) -> OptionCosts:
        hit = self._costs.get(cfg)
        if hit is None:
            hit = self._costs[cfg] = OptionCosts.of_config(self.cm, cfg)
        return hit

    def lmax(self, cfg: OuterConfig) -> np.ndarray:
        """lmax[o, x] (read-only): the most layers option o fits at stage x."""
        hit = self._lmax.get(cfg)
        if hit is None:
            hit = self._lmax[cfg] = layer_limits(self.cm, cfg, self.moe_free_stages)
            hit.setflags(write=False)
        return hit

    def lmax_from(self, cfg: OuterConfig) -> np.ndarray | None:
        """A model of several layer kinds: lmax_from[o, x, a] (read-only), the most layers
        option o fits at stage x from first layer a; None for a uniform model and for an
        interleaved configuration (``fit_layers``: a stage's chunks lie apart)."""
        if not self.cm.per_kind or cfg.virtual_stages > 1:
            return None
        hit = self._lmax_from.get(cfg)
        if hit is None:
            hit = self._lmax_from[cfg] = layer_limits_from(self.cm, cfg, self.moe_free_stages)
            hit.setflags(write=False)
        return hit

    def fits(self, cfg: OuterConfig, opts, layers) -> bool:
        """Every stage's layers fit its memory (and hold at least V layers): ``lmax``, or for
        a model of several layer kinds the limit from the stage's first layer."""
        v = cfg.virtual_stages
        if cfg.chunk_totals:
            return self._fits_chunks(cfg, opts, layers)
        frm = self.lmax_from(cfg)
        if frm is None:
            lmax = self.lmax_rows(cfg)
            return all(v <= l <= lmax[o][x] for x, (o, l) in enumerate(zip(opts, layers)))
        a = 0
        for x, (o, l) in enumerate(zip(opts, layers)):
            if not v <= l <= frm[o, x, a]:
                return False
            a += l
        return True

    def _fits_chunks(self, cfg: OuterConfig, opts, layers) -> bool:
        """``fits`` of an interleaved configuration of a model of several kinds: the layers
        give its chunk totals and every stage fits with the layers of its own chunks."""
        v, n = cfg.virtual_stages, cfg.num_stages
        if len(layers) != n or any(l < v for l in layers):
            return False
        if chunk_totals_of(layers, v) != cfg.chunk_totals:
            return False
        ranges = stage_layer_ranges(layers, v)
        fit = self.fit_layers(cfg)
        return all(fit(o, x, tuple(a for a, _ in ranges[x]), l) >= l
                   for x, (o, l) in enumerate(zip(opts, layers)))

    def fit_layers(self, cfg: OuterConfig):
        """An interleaved configuration of a model of several kinds: the callable
        (o, x, chunk starts, cap) -> the most layers l <= cap option o fits at stage x whose
        chunk c holds layers [starts[c], starts[c] + chunk_layers(l, V)[c]) (memory from the
        kinds those chunks hold, ``configs.stage_fits_counts``). Memory grows with l (one more
        layer adds one layer to one chunk): a bisection, memoised."""
        hit = self._fit.get(cfg)
        if hit is not None:
            return hit
        cm, v = self.cm.at_cp(cfg.cp), cfg.virtual_stages
        model, L = cm.model, cm.model.num_layers
        memo: dict[tuple, tuple[int, int]] = {}
        seen: dict[tuple, bool] = {}

        def fits(o: int, x: int, starts, l: int) -> bool:
            counts = [0] * len(model.layer_kinds)
            for a, c in zip(starts, chunk_layers(l, v)):
                if a + c > L:
                    return False
                for k, got in enumerate(model.kind_counts_in(a, a + c)):
                    counts[k] += got
            key = (o, x, tuple(counts))
            if key not in seen:
                seen[key] = stage_fits_counts(cm, cfg, o, x, counts)
            return seen[key]

        def fit(o: int, x: int, starts: tuple, cap: int) -> int:
            key = (o, x, starts)
            got = memo.get(key)
            if got is not None and (cap <= got[1] or got[0] < got[1]):
                return min(got[0], cap)
            lo, hi = 0, cap
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if fits(o, x, starts, mid):
                    lo = mid
                else:
                    hi = mid - 1
            memo[key] = (lo, cap)
            return lo

        self._fit[cfg] = fit
        return fit

    def lmax_rows(self, cfg: OuterConfig) -> list[list[int]]:
        """``lmax`` as nested Python lists (read often from Python: no numpy scalars)."""
        hit = self._lmax_rows.get(cfg)
        if hit is None:
            hit = self._lmax_rows[cfg] = self.lmax(cfg).tolist()
        return hit

    def root_bound(self, cfg: OuterConfig) -> float:
        hit = self._roots.get(cfg)
        if hit is None:
            hit = self._roots[cfg] = root_bound(self.cm, cfg, self.option_costs(cfg))
        return hit

    def send_range_ms(self, micro_batch_size: int) -> tuple[float, float]:
        """(fastest, slowest) activation send of one micro-batch over any link."""
        cm = self.cm
        worst = min(min(cm.intra_gbps), min(cm.inter_gbps), cm.cross_gbps)
        return (min_send_ms(cm, micro_batch_size),
                send_ms(cm.activation_bytes(micro_batch_size), worst, cm.latency_ms))

    def ridge_rule(self, cfg: OuterConfig, pruning: str) -> RidgeRule:
        """``ridge``: the paper's cut everywhere; ``safe``: its provably safe form where
        Theorem 2's conditions hold (eager-1F1B, d = 1, M >= 2N, N >= 3, one b/f ratio r > 1
        over the options, sends <= (r-1)/2 min f, no memory limit below L - (N-1)); else off."""
        if pruning == "ridge":
            return RidgeRule(_search.RIDGE_MODES["cut"], 1)
        if self.cm.per_kind:
            # Theorem 2's premise (interchangeable layers) does not hold for several kinds
            return RidgeRule(_search.RIDGE_MODES["off"])
        if pruning != "safe" or cfg.schedule != "eager-1f1b" or cfg.dp_cp != 1:
            return RidgeRule(_search.RIDGE_MODES["off"])
        n, m = cfg.num_stages, cfg.num_microbatches
        if m < 2 * n or n < 3:
            return RidgeRule(_search.RIDGE_MODES["off"])
        costs = self.option_costs(cfg)
        ratios = [b / f for f, b in zip(costs.f, costs.b) if f > 0]
        if len(ratios) != len(costs.f):
            return RidgeRule(_search.RIDGE_MODES["off"])
        r = ratios[0]
        if r <= 1.0 or any(abs(x - r) > 1e-9 * r for x in ratios):
            return RidgeRule(_search.RIDGE_MODES["off"])
        if self.send_range_ms(cfg.micro_batch_size)[1] > (r - 1.0) / 2.0 * min(costs.f):
            return RidgeRule(_search.RIDGE_MODES["off"])
        if int(self.lmax(cfg).min()) < self.cm.model.num_layers - (n - 1):
            return RidgeRule(_search.RIDGE_MODES["off"])
        return RidgeRule(_search.RIDGE_MODES["safe"], 0, max(2.0 / 3.0, r / (1.0 + r)))

    def instance(self, cfg: OuterConfig, *, pruning: str, blocks: bool
                 ) -> _search.ConfigInstance:
        """The typed read-only instance ``_search.search_config`` walks (cached)."""
        key = (cfg, pruning, blocks)
        hit = self._instances.get(key)
        if hit is None:
            hit = self._instances[key] = self._build_instance(cfg, pruning, blocks)
        return hit

    def _build_instance(self, cfg: OuterConfig, pruning: str, blocks: bool,
                        lmax: np.ndarray | None = None) -> _search.ConfigInstance:
        cm, costs = self.cm.at_cp(cfg.cp), self.option_costs(cfg)
        rule = self.ridge_rule(cfg, pruning)
        node_of, local_of, type_off = [], [], []
        for p in cm.pools:
            type_off.append(len(node_of))
            node_of.extend(p.node_of)
            local_of.extend(p.local_of)
        st = bound_structure(cfg.schedule, cfg.num_stages, cfg.num_microbatches,
                             cfg.virtual_stages)
        kinds = lmax_from = None
        if costs.kinds:
            L = cm.model.num_layers
            kk = np.array(costs.kinds, dtype=np.float64)            # O x K x 4
            prefix = np.array(cm.model._kind_prefix, dtype=np.int32)  # K x (L + 1)
            kinds = tuple(np.ascontiguousarray(kk[:, :, i]) for i in range(4)) + (prefix,)
            lmax_from = self.lmax_from(cfg)
            if lmax is not None and lmax_from is not None:   # the tie rule's masks
                lmax_from = np.minimum(lmax_from, np.asarray(lmax)[:, :, None])
            assert prefix.shape == (len(cm.model.layer_kinds), L + 1)
        return _search.ConfigInstance(
            st, dp=cfg.dp_cp, num_layers=cm.model.num_layers,
            act_bytes=cm.activation_bytes(cfg.micro_batch_size), latency_ms=cm.latency_ms,
            cross_gbps=cm.cross_gbps, minsend=stage_min_send_ms(cm, cfg),
            minfb=costs.min_layer_fb, outmin=costs.min_output_fb, alpha=rule.alpha,
            ridge_mode=rule.mode, ridge_ends=rule.ends, blocks=int(blocks),
            use_bound=0 if pruning == "none" else 1,
            opt_type=[k for k, _ in cfg.options], opt_tp=[t for _, t in cfg.options],
            f=costs.f, b=costs.b, ef=costs.ef, eb=costs.eb, of=costs.of, ob=costs.ob,
            gl=costs.gl, ge=costs.ge, go=costs.go, og=costs.og or None,
            overhead_ms=cm.iteration_overhead_ms, sharded=cm.sharded_optimizer,
            wpg=cm.param_per_grad_byte, overlap_grad=cm.training.overlap_grad_reduce,
            overlap_param=cm.training.overlap_param_gather,
            gpp=float(cm.training.grad_bytes), bucket=float(cm.training.ddp_bucket_size),
            lmax=self.lmax(cfg) if lmax is None else lmax,
            ndev=[p.size for p in cm.pools], type_off=type_off, intra=list(cm.intra_gbps),
            inter=list(cm.inter_gbps), node_of=node_of, local_of=local_of, kinds=kinds,
            lmax_from=lmax_from, ep=cfg.ep, xg=costs.xg or None,
            chunk_totals=cfg.chunk_totals or None,
            fit=self.fit_layers(cfg) if cfg.chunk_totals else None,
            kxg=(np.ascontiguousarray(np.array(costs.kxg, dtype=np.float64))
                 if costs.kxg else None))

    # ------------------------------------------------------------------ searching
    def run(self, cfg: OuterConfig, *, pruning: str, blocks: bool, threshold_ms: float,
            deadline: float = 0.0, threads: int = 1, memo: bool = True, slot: int = 0,
            prefix: tuple | None = None, lmax: np.ndarray | None = None
            ) -> _search.ConfigResult:
        """Branch and bound over ``cfg``: the best plan with time <= ``threshold_ms``.
        The DAG is built only when the search reaches its first leaf (most configurations are
        settled by the bounds alone); threads > 1: one DAG per thread (its own workspace).
        ``slot``: which DAG workspace (``cached_dag``; searches that run at the same time
        need different ones, and slot 0 is the calling thread's). ``prefix``: (options,
        layers) of the first stages, fixed; ``lmax``: tighter per-stage limits than memory's
        (an O x N array <= ``self.lmax(cfg)``, 0 bars an option from a stage): the best plan
        of that part of the space (the tie rule's queries, one thread)."""
        key = (cfg.schedule, cfg.num_stages, cfg.num_microbatches, cfg.virtual_stages)
        calls = self.cm.engine_calls(cfg.micro_batch_size).as_tuple()
        inst = (self.instance(cfg, pruning=pruning, blocks=blocks) if lmax is None
                else self._build_instance(cfg, pruning, blocks, lmax))
        return _search.search_config(inst, lambda: cached_dag(*key, slot, calls), threshold_ms,
                                     deadline, threads,
                                     lambda s: cached_dag(*key, slot + s, calls),
                                     memo, prefix)

    def split(self, cfg: OuterConfig, *, pruning: str, blocks: bool, threshold_ms: float,
              deadline: float = 0.0, threads: int = 1):
        """(D, prefixes, result): ``cfg``'s subtrees for searchers in several processes
        (``_search.split_prefixes``)."""
        return _search.split_prefixes(self.instance(cfg, pruning=pruning, blocks=blocks),
                                      threshold_ms, deadline, threads)

    def run_prefixes(self, cfg: OuterConfig, depth: int, fetch, *, pruning: str, blocks: bool,
                     threshold_ms: float, deadline: float = 0.0, threads: int = 1,
                     slot: int = 0) -> _search.ConfigResult:
        """Search the chunks of ``cfg``'s subtrees ``fetch`` hands out
        (``_search.search_prefixes``), with ``threads`` threads (DAG slots from ``slot``)."""
        key = (cfg.schedule, cfg.num_stages, cfg.num_microbatches, cfg.virtual_stages)
        calls = self.cm.engine_calls(cfg.micro_batch_size).as_tuple()
        return _search.search_prefixes(
            self.instance(cfg, pruning=pruning, blocks=blocks),
            lambda: cached_dag(*key, slot, calls), threshold_ms, deadline, depth, fetch,
            threads, lambda s: cached_dag(*key, slot + s, calls))

    def replay(self, cfg: OuterConfig, opts, layers, threshold_ms: float = 1e300
               ) -> tuple[list[float], float]:
        """(g after each stage, simulated time) of one complete assignment through the
        search's own cost and bound code (for the tests); ``threshold_ms``: the search's
        threshold while g is computed (bounds that read it hold for plans no slower).
        ``build_deadline`` (``time.monotonic()``, set by a search with a plan and a budget):
        ValueError, as for a plan that cannot be placed, where the DAG is not built and its
        build (``dag_build_seconds``) would end past it (a huge M: 0.4 CPU-s and up)."""
        calls = self.cm.engine_calls(cfg.micro_batch_size).as_tuple()
        if self.build_deadline is not None:
            need = dag_build_seconds(cfg, calls)
            if need > 0.0 and time.monotonic() + need > self.build_deadline:
                raise ValueError(f"the simulator's DAG of {cfg.num_microbatches} micro-batches "
                                 f"is not built in the time left")
        dag = cached_dag(cfg.schedule, cfg.num_stages, cfg.num_microbatches,
                         cfg.virtual_stages, 0, calls)
        return _search.replay_assignment(self.instance(cfg, pruning="none", blocks=False), dag,
                                         list(opts), list(layers), min(threshold_ms, 1e300))

    def evaluate(self, cfg: OuterConfig, stage_opts, layers) -> float:
        """Iteration time of one assignment through the Python cost path and the simulator
        (the independent check of the Cython path)."""
        return time_assignment(self.cm, cfg, stage_opts, layers)[3]

    def random_assignment(self, cfg: OuterConfig, rng: random.Random):
        """A random (stage options, layers) of ``cfg`` that fits the devices and memory, or
        None (the warm-up samples and the tests' random plans)."""
        cm, lmax = self.cm, self.lmax_rows(cfg)
        n, v, d = cfg.num_stages, cfg.virtual_stages, cfg.dp_cp
        cursors = [0] * len(cm.pools)
        opts = []
        for x in range(n):
            cand = []
            for o, (k, t) in enumerate(cfg.options):
                pool = cm.pools[k]
                start = cursors[k]
                if start < pool.size and pool.local_of[start] % t:
                    start += t - pool.local_of[start] % t
                if start + d * t <= pool.size and lmax[o][x] >= v:
                    cand.append((o, start + d * t))
            if not cand:
                return None
            o, nxt = rng.choice(cand)
            cursors[cfg.options[o][0]] = nxt
            opts.append(o)
        return self._random_layers(cfg, opts, rng)

    def _random_layers(self, cfg: OuterConfig, opts: list[int], rng: random.Random):
        lmax, n, v = self.lmax_rows(cfg), cfg.num_stages, cfg.virtual_stages
        caps = [lmax[o][x] for x, o in enumerate(opts)]
        L = self.cm.model.num_layers
        if sum(caps) < L or v * n > L:
            return None
        layers = []
        rem = L
        for x in range(n):
            lo = max(v, rem - sum(caps[x + 1:]))
            hi = min(caps[x], rem - (n - 1 - x) * v)
            if hi < lo:
                return None
            layers.append(lo if x == n - 1 and lo == hi else rng.randint(lo, hi))
            rem -= layers[-1]
        if rem != 0 or not self.fits(cfg, opts, layers):
            return None
        return opts, layers
