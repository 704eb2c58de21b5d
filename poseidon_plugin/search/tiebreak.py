"""The tie rule: among the plans within a tolerance of the fastest, a fixed order picks one.

With a tolerance t > 0 (``--tie-tolerance``) the search, once it knows the fastest plan (time
T*), returns the **preferred** plan among those no slower than T* x (1 + t): a stated few per
cent traded for a simpler plan. The preference reads no times. It was built to make noisy
launches agree on near-ties and does not: the preferred plan tends to sit at the window's
edge, where noise moves it in and out (``tests/test_plan_stability.py``; docs/usage.md's "Plan
stability"). What keeps a relaunch on its plan is ``SearchDriver.keep``. The order:

1. the configuration (``preference``): fewer pipeline stages, then no interleaving (smaller
   V), then the schedule's place in ``SCHEDULES``, then a smaller TP degree, then a larger
   micro-batch -- the plan with the fewest hand-offs and micro-batches, which the cost model
   predicts best;
2. then stage by stage from the first: its device type by name, its TP degree (smaller
   first), its layer count (fewer first).

This is the lexicographic minimum of that order over the plans with time <= the cap, found
exactly with the branch and bound (``_search.search_config`` returns the best plan below a
threshold, or none): a configuration holds a plan under the cap iff its search with the cap
as threshold returns one; then stage x's option and layer count are fixed one query at a time,
stages < x fixed (``prefix``) and stage x restricted through its memory limits (``lmax``:
0 bars an option, a smaller cap bisects the layer count). At most (options + log2 L) queries
per stage of the chosen configuration, plus one per configuration tried before it.

It runs under the search's deadline and at most ``TIE_SHARE`` of the time the search took
(``TIE_MIN_S`` at least): when it runs out the fastest plan stands and the statistics say so.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from ..simulator.schedules import SCHEDULES
from .configs import OuterConfig

TIE_SHARE = 0.5     # the tie rule may take this share of the search's own time ...
TIE_MIN_S = 2.0     # ... or this long, whichever is more (within a time budget)
EPS = 1e-9


def preference(cfg: OuterConfig) -> tuple:
    """A configuration's place in the tie rule's order (smaller first)."""
    return (cfg.num_stages, cfg.virtual_stages, SCHEDULES.index(cfg.schedule), cfg.tp,
            -cfg.micro_batch_size, cfg.dp, cfg.cp)


@dataclass
class TieResult:
    """The preferred plan: (time, configuration, options, layers), or why none was chosen."""

    status: str                  # "preferred", "fastest" (it is the preferred one) or "timed out"
    queries: int = 0             # branch-and-bound calls the rule made
    time_ms: float = math.nan
    cfg: OuterConfig | None = None
    opts: tuple[int, ...] = ()
    layers: tuple[int, ...] = ()
    within: int = 0              # configurations with a plan inside the window (of those tried)


class _OutOfTime(Exception):
    pass


class _Disagreed(Exception):
    """A query found no plan where an earlier one had (cannot happen with an exact search;
    ``--pruning ridge`` may): the fastest plan stands."""


class TieBreaker:
    """One run of the tie rule over a finished ``SearchDriver``'s space."""

    def __init__(self, driver, tolerance: float, deadline: float | None) -> None:
        self.d, self.ctx = driver, driver.ctx
        self.cap = driver.best.time_ms * (1.0 + tolerance)
        self.deadline = deadline
        self.queries = 0
        self._names = driver.cluster.type_names

    def _query(self, cfg: OuterConfig, blocks: bool, prefix=None, lmax=None):
        """The best plan of ``cfg`` with time <= the cap (within ``prefix``/``lmax``)."""
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise _OutOfTime
        self.queries += 1
        res = self.ctx.run(cfg, pruning=self.d.options.pruning, blocks=blocks,
                           threshold_ms=self.cap, deadline=self.deadline or 0.0,
                           prefix=prefix, lmax=lmax)
        self.d.stats.add_counters(res.counters())
        if res.timed_out:
            raise _OutOfTime
        return res.best

    def run(self) -> TieResult:
        try:
            return self._run()
        except _OutOfTime:
            return TieResult("timed out", self.queries)
        except _Disagreed:
            return TieResult("fastest", self.queries)

    def _run(self) -> TieResult:
        d = self.d
        o = d.options
        cands = sorted((i for i, c in enumerate(d.configs)
                        if d.lbs[i] <= self.cap * (1 + EPS)),
                       key=lambda i: (preference(d.configs[i]), d.configs[i].key))
        tried = 0
        for i in cands:
            cfg = d.configs[i]
            blocks = cfg.type_sequences_restricted(o.type_order, o.type_sequence_limit)
            tried += 1
            known = d.found.get(cfg)
            if known is None or known.time_ms > self.cap * (1 + EPS):
                if self._query(cfg, blocks) is None:
                    continue
            t, opts, layers = self._stages(cfg, blocks)
            return TieResult("preferred", self.queries, t, cfg, opts, layers, tried)
        raise _Disagreed   # the fastest plan lies in the window: some configuration holds it

    def _stages(self, cfg: OuterConfig, blocks: bool):
        """The preferred plan of ``cfg`` under the cap, stage by stage."""
        base = self.ctx.lmax(cfg)
        n, v = cfg.num_stages, cfg.virtual_stages
        order = sorted(range(len(cfg.options)),
                       key=lambda k: (self._names[cfg.options[k][0]], cfg.options[k][1], k))
        popts: list[int] = []
        plays: list[int] = []
        best = None
        for x in range(n):
            prefix = (list(popts), list(plays))
            for opt in order:
                if base[opt, x] < v:
                    continue
                mask = np.array(base, dtype=np.int32)
                mask[:, x] = 0
                mask[opt, x] = base[opt, x]
                got = self._query(cfg, blocks, prefix, mask)
                if got is not None:
                    best = got
                    break
            else:
                raise _Disagreed   # the configuration had a plan under the cap with this prefix
            # the fewest layers stage x can take: bisect its cap (each plan found moves hi down)
            lo, hi = v, best[2][x]
            while lo < hi and x < n - 1:   # (the last stage takes the layers left)
                mid = (lo + hi) // 2
                mask[opt, x] = mid
                got = self._query(cfg, blocks, prefix, mask)
                if got is None:
                    lo = mid + 1
                else:
                    best, hi = got, got[2][x]
            popts.append(opt)
            plays.append(hi)
        t, opts, layers = best
        assert tuple(opts) == tuple(popts) and tuple(layers) == tuple(plays)
        return t, tuple(opts), tuple(layers)
