"""How sure the choice is: the runner-up, the fastest plan of any other configuration, and the
other layout, the fastest plan of the same configuration with another device type on a stage.

The search returns the fastest plan and proves it; it does not say how close the next choice
came. Where another configuration (schedule, PP, DP, TP, micro-batch, model chunks: what the
launch flags change) is within a per cent or two, the choice is a near-tie that a few per cent
of error in the costs -- noise of the profiler, an estimated layer -- could reverse; where the
next one is 20 % slower, it is not. So after the search (and after the tie rule and the
previous-plan rule, which may return another plan), the runner-up is the fastest plan whose
configuration differs from the returned plan's, and the margin is its time over the returned
plan's, minus one (negative only when the returned plan is not the fastest: a kept or preferred
plan).

Found exactly with what the search already knows -- each configuration's best plan found so far
(an upper bound on its optimum: ``driver.found``) and its proven lower bound (``driver.lbs``) --
and rounds of the branch and bound with a rising cap, as the search's own rounds: R = the best
other plan known, base = the lowest bound of the other configurations; round k searches every
other configuration whose bound is below min(cap_k, R) with that threshold, cap_k = base x (1 +
``MILESTONES[k]``). A plan found lowers R (and is its configuration's optimum, the best below
the threshold); none raises the configuration's bound to the threshold. When R <= cap_k after a
round, every other configuration's bound is >= R or its optimum is known: R is the runner-up's
time. Rounds near the base are cheap (the bounds cut most of the tree), so where the runner-up
is close it is found fast, and where it is not, the completed rounds still prove "no other
configuration within x %". Under ``--pruning ridge`` a query may miss plans, so the result is
the best found, not proven. Out of time (``RUNNER_SHARE`` of the search's time, ``RUNNER_MIN_S``
at least, within the search's deadline): the best other plan found and the lowest bound of the
configurations not settled -- the runner-up lies between.

The other layout (``RunnerUp.layout``) asks the same of the returned plan's own configuration:
the fastest plan whose device type differs on at least one stage is the minimum over stages x
of the best plan with stage x barred from the returned plan's type there (``lmax`` 0 on those
options, the tie rule's restriction of a stage), found in the same rounds, one part per stage.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from .incumbent import Incumbent

RUNNER_SHARE = 0.25   # the runner-up may take this share of the search's own time ...
RUNNER_MIN_S = 1.0    # ... or this long, whichever is more (within a time budget)
EPS = 1e-9
MILESTONES = (0.005, 0.01, 0.02, 0.05, 0.10, 0.20, 0.50, math.inf)   # the rounds' caps over
                      # the lowest bound of the other configurations (the last: no cap)


@dataclass
class RunnerUpResult:
    """``status``: ``exact`` (proven the fastest other configuration's plan), ``best found``
    (``--pruning ridge``: not proven), ``timed out`` (``time_ms`` the best other plan found,
    ``bound_ms`` no other configuration is faster), ``none`` (no other configuration has a
    feasible plan; proven unless timed out)."""

    status: str
    queries: int = 0
    time_ms: float | None = None
    bound_ms: float | None = None
    plan: object | None = None     # the runner-up's Incumbent (configuration, options, layers)
    open: int = 0                  # timed out: other configurations not ruled out below time_ms


class _OutOfTime(Exception):
    pass


class RunnerUp:
    """One runner-up search over a finished ``SearchDriver``'s space, against ``chosen``."""

    def __init__(self, driver, chosen, deadline: float | None) -> None:
        self.d, self.chosen, self.deadline = driver, chosen, deadline
        self.queries = 0

    def same(self, cfg) -> bool:
        """Whether ``cfg`` is the returned plan's configuration (per-stage TP: TP is a stage's
        choice, not the configuration's; the uniform-TP seed's plans carry uniform ones)."""
        return identity(cfg, self.d.options.tp_mode) == identity(self.chosen.cfg,
                                                                 self.d.options.tp_mode)

    def _bounds(self) -> dict[int, float]:
        """Every other configuration's index -> its proven lower bound."""
        d = self.d
        return {i: d.lbs[i] for i, c in enumerate(d.configs) if not self.same(c)}

    def run(self) -> RunnerUpResult:
        """The fastest plan of any other configuration."""
        d = self.d
        bounds = self._bounds()
        if not bounds:
            return RunnerUpResult("none")
        best = min((inc for c, inc in d.found.items() if not self.same(c)), default=None)

        def query(i: int, thr: float):
            res = self._query(i, thr)
            if res is None:
                return None
            cfg = d.configs[i]
            return Incumbent(res[0], cfg.key, tuple(res[1]), tuple(res[2]), cfg)

        return self._rounds(bounds, query, best, lambda i: d.configs[i].key)

    def layout(self) -> RunnerUpResult:
        """The fastest plan of the returned plan's own configuration with another device type
        on at least one stage: the min over stages x of the best plan whose stage x is barred
        from the returned plan's type there (``lmax`` 0 on those options, as the tie rule
        restricts a stage), in the same rounds. ``none``: no other type fits any stage."""
        d, ch = self.d, self.chosen
        mode = d.options.tp_mode
        own = [j for j, c in enumerate(d.configs) if identity(c, mode) == identity(ch.cfg, mode)]
        if not own:
            return RunnerUpResult("none")
        j = own[0]
        cfg = d.configs[j]
        types = [ch.cfg.options[o][0] for o in ch.opts]
        base = d.ctx.lmax(cfg)
        masks = {}
        for x, k in enumerate(types):
            mask = np.array(base, dtype=np.int32)
            for o, (ko, _) in enumerate(cfg.options):
                if ko == k:
                    mask[o, x] = 0
            if int(mask[:, x].max()) >= cfg.virtual_stages:
                masks[x] = mask
        if not masks:
            return RunnerUpResult("none")
        seq = tuple(types)

        def query(x: int, thr: float):
            res = self._query(j, thr, lmax=masks[x])
            if res is None:
                return None
            got = tuple(cfg.options[o][0] for o in res[1])
            assert got != seq, "a barred stage kept its type"
            return Incumbent(res[0], cfg.key, tuple(res[1]), tuple(res[2]), cfg)

        return self._rounds({x: d.lbs[j] for x in masks}, query, None, lambda x: x)

    def _rounds(self, lb: dict, query, best, key) -> RunnerUpResult:
        """The rounds with rising caps over the parts ``lb`` maps to their proven bounds:
        ``query(part, threshold)`` -> the part's best plan under it (an ``Incumbent``) or
        None; ``best`` an upper bound known beforehand."""
        d = self.d
        r = math.inf if best is None else best.time_ms
        base = max(min(lb.values()), EPS)
        try:
            for m in MILESTONES:
                cap = base * (1 + m)
                for part in sorted(lb, key=lambda p: (lb[p], key(p))):
                    thr = min(cap, r)
                    if lb[part] >= thr * (1 - EPS):
                        continue       # no plan of it below this round's threshold
                    cand = query(part, thr)
                    if cand is None:
                        lb[part] = max(lb[part], thr)
                        continue
                    lb[part] = max(lb[part], cand.time_ms)   # its optimum: the best below thr
                    if best is None or cand < best:
                        best, r = cand, cand.time_ms
                if r <= cap * (1 + EPS):
                    break
        except _OutOfTime:
            low = min([r] + list(lb.values()))
            still = sum(1 for x in lb.values() if x < r * (1 - EPS))
            return RunnerUpResult("timed out", self.queries,
                                  None if best is None else best.time_ms, low, best, still)
        if best is None:
            return RunnerUpResult("none", self.queries)
        status = "best found" if d.heuristic else "exact"
        return RunnerUpResult(status, self.queries, best.time_ms, best.time_ms, best)

    def _query(self, i: int, threshold: float, lmax=None):
        """The best plan of configuration ``i`` with time <= ``threshold`` (None: there is
        none). One whose last search in the rounds was a giant is split over every worker,
        as the search's rounds do."""
        d = self.d
        cfg = d.configs[i]
        threads = d.giant_threads(i) if lmax is None else 1
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise _OutOfTime
        self.queries += 1
        o = d.options
        blocks = cfg.type_sequences_restricted(o.type_order, o.type_sequence_limit)
        res = d.ctx.run(cfg, pruning=o.pruning, blocks=blocks, threshold_ms=threshold,
                        deadline=self.deadline or 0.0, threads=threads, lmax=lmax)
        d.stats.add_counters(res.counters())
        if res.split_depth:
            d.stats.statistics_depend_on_timing = True
        if res.timed_out:
            raise _OutOfTime
        return res.best


def identity(cfg, tp_mode: str) -> tuple:
    """What makes two plans' configurations the same: the launch's schedule, model chunks,
    micro-batch, DP and PP, and (uniform TP) the TP degree."""
    return (cfg.schedule, cfg.virtual_stages, cfg.micro_batch_size, cfg.dp, cfg.num_stages,
            cfg.tp if tp_mode == "uniform" else 0, cfg.cp)


def describe(cfg, names, opts, layers, tp_mode: str) -> dict:
    """The JSON form of a runner-up plan (``search.runner_up``; ``ep`` only when > 1)."""
    return {"schedule": cfg.schedule, "virtual_stages": cfg.virtual_stages,
            "pp": cfg.num_stages, "dp": cfg.dp, **({"cp": cfg.cp} if cfg.cp > 1 else {}),
            "tp": cfg.tp if tp_mode == "uniform" else None,
            "micro_batch_size": cfg.micro_batch_size,
            "stage_types": [names[cfg.options[o][0]] for o in opts],
            "stage_tps": [cfg.options[o][1] for o in opts],
            "layers": list(layers), **({"ep": cfg.ep} if cfg.ep > 1 else {})}
