"""Local search on a complete plan: a better incumbent for the branch and bound, fast.

The constructive plans (``construct.py``) fill layers by a per-stage time estimate and place
device types as contiguous blocks. The simulated time of such a plan is often a few per cent
from what small changes reach: an interleaved pipeline, for one, runs its stages' chunks best
with an even split of layers (a stage of 3 layers over V = 2 chunks has a 2-layer chunk), which
the fill does not see. ``polish`` walks from a plan to a local optimum by best improvement
over three kinds of moves, each plan timed by the search's own placement, cost and simulator
path (``SearchContext.replay``, the time the branch and bound would give it):

* **layers**: k layers from stage i to stage j (k = 1, and k = V for interleaved schedules:
  a move that keeps every chunk's parity), the most loaded stages giving first;
* **swap**: the options (device type, TP) of stages i and j exchanged, with or without their
  layer counts;
* **replace**: stage i on another option, its layers kept.

A move is taken only when the plan still fits (memory limit ``lmax``, at least V layers per
stage, the devices of every type: ``replay`` refuses what does not fit) and lies in the
allowed space (``allowed``: contiguous type blocks where the search is restricted to them), so
the result is feasible and never slower than the input. Best improvement, not first: a plan
one move from a better plan reaches a plan at least as fast as that one (the tests rely on
it). It is a heuristic: a local optimum, not the optimum; the branch and bound that follows
proves or improves it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from .configs import OuterConfig
from .instance import SearchContext

POLISH_EVALS = 200_000   # a safety cap on the plans one polish times (deadline aside)
CONSTRUCT_EVALS = 400    # the cheap polish of every constructed plan (about 100 us a plan at
                         # N = 62, M = 128); the driver's polish phase then goes further


@dataclass(frozen=True)
class Polished:
    """The result of ``polish``: the plan, its time, and what the walk did."""

    time_ms: float
    opts: tuple[int, ...]
    layers: tuple[int, ...]
    steps: int        # improving moves taken
    evals: int        # plans timed
    complete: bool    # reached a local optimum (no move improves), not a cap or the deadline


def _moves(cfg: OuterConfig, opts: list[int], layers: list[int], per_layer
           ) -> Iterator[tuple[list[int], list[int]]]:
    """Every neighbour of (opts, layers) in a deterministic order, layer moves first, from
    the most loaded stage (layers x ``per_layer[option]``) to the least loaded (a capped walk
    tries the likeliest moves first); may include plans that do not fit (the caller checks)."""
    n, v = cfg.num_stages, cfg.virtual_stages
    load = [layers[x] * per_layer[opts[x]] for x in range(n)]
    givers = sorted(range(n), key=lambda x: (-load[x], x))
    takers = sorted(range(n), key=lambda x: (load[x], x))
    for k in sorted({1, v}):
        for i in givers:
            if layers[i] - k < v:
                continue
            for j in takers:
                if j != i:
                    moved = list(layers)
                    moved[i] -= k
                    moved[j] += k
                    yield opts, moved
    for i in range(n):
        for j in range(i + 1, n):
            if opts[i] == opts[j]:
                continue
            swapped = list(opts)
            swapped[i], swapped[j] = opts[j], opts[i]
            yield swapped, layers
            if layers[i] != layers[j]:
                both = list(layers)
                both[i], both[j] = layers[j], layers[i]
                yield swapped, both
    for i in range(n):
        for o in range(len(cfg.options)):
            if o != opts[i]:
                other = list(opts)
                other[i] = o
                yield other, layers


def polish(ctx: SearchContext, cfg: OuterConfig, opts, layers, time_ms: float, *,
           allowed: Callable[[list[int]], bool] | None = None, deadline: float | None = None,
           max_evals: int = POLISH_EVALS, first_improvement: bool = False) -> Polished:
    """Best-improvement local search from the feasible plan (``opts``, ``layers``) of
    ``cfg`` with simulated time ``time_ms``; stops at a local optimum, after ``max_evals``
    timed plans or at ``deadline`` (``time.monotonic()``), keeping the best plan so far.
    ``first_improvement``: take the first faster neighbour instead (more steps under a small
    ``max_evals``: the construction's cheap polish)."""
    lmax = ctx.lmax(cfg)
    costs = ctx.option_costs(cfg)
    per_layer = [f + b for f, b in zip(costs.f, costs.b)]
    v = cfg.virtual_stages
    cur_o, cur_l, cur_t = list(opts), list(layers), time_ms
    steps = evals = 0
    while True:
        best = None
        for o, l in _moves(cfg, cur_o, cur_l, per_layer):
            if any(not v <= l[x] <= lmax[o[x], x] for x in range(cfg.num_stages)):
                continue
            if o is not cur_o and allowed is not None and not allowed(o):
                continue
            if evals >= max_evals or (deadline is not None and evals % 64 == 0
                                      and time.monotonic() > deadline):
                return Polished(*_pick(best, cur_t, cur_o, cur_l), steps + (best is not None),
                                evals, False)
            try:
                t = ctx.replay(cfg, o, l)[1]
            except ValueError:        # the devices of some type do not hold the stages
                continue
            evals += 1
            if t < cur_t * (1 - 1e-12) and (best is None or t < best[0]):
                best = (t, o, l)
                if first_improvement:
                    break
        if best is None:
            return Polished(cur_t, tuple(cur_o), tuple(cur_l), steps, evals, True)
        cur_t, cur_o, cur_l = best[0], list(best[1]), list(best[2])
        steps += 1


def _pick(best, t, o, l) -> tuple[float, tuple[int, ...], tuple[int, ...]]:
    if best is not None and best[0] < t:
        t, o, l = best
    return t, tuple(o), tuple(l)
