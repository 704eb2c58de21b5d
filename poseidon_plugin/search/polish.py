"""Local search on a complete plan: a better incumbent for the branch and bound, fast.

The constructive plans (``construct.py``) fill layers by a per-stage time estimate and place
device types as contiguous blocks. The simulated time of such a plan is often a few per cent
from what small changes reach: an interleaved pipeline, for one, runs its stages' chunks best
with an even split of layers (a stage of 3 layers over V = 2 chunks has a 2-layer chunk), which
the fill does not see; a deep 1F1B pipeline may gain from one more stage on devices left idle.
``polish`` walks from a plan to a local optimum by best improvement over these moves, each plan
timed by the search's own placement, cost and simulator path (``SearchContext.replay``, the
time the branch and bound would give it):

* **layers**: k layers from stage i to stage j (k = 1, and k = V for interleaved schedules:
  a move that keeps every chunk's parity), the most loaded stages giving first;
* **swap**: the layer counts of stages i and j exchanged, their options (device type, TP)
  exchanged, or both;
* **replace**: stage i on another option, its layers kept;
* **grow** / **shrink** (when ``resize`` gives the configuration with one stage more or less,
  the same schedule, V, micro-batch, DP and TP): a stage of some option inserted at position
  p with V layers from the most loaded stage; stage i removed, its layers to a neighbour.

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
    """The result of ``polish``: the plan (its configuration may differ from the start's
    after grow / shrink moves), its time, and what the walk did."""

    time_ms: float
    cfg: OuterConfig
    opts: tuple[int, ...]
    layers: tuple[int, ...]
    steps: int        # improving moves taken
    evals: int        # plans timed
    complete: bool    # reached a local optimum (no move improves), not a cap or the deadline


Resize = Callable[[OuterConfig, int], "OuterConfig | None"]
Plan3 = tuple[OuterConfig, list[int], list[int]]


def _moves(cfg: OuterConfig, opts: list[int], layers: list[int], per_layer,
           resize: Resize | None) -> Iterator[Plan3]:
    """Every neighbour of (cfg, opts, layers) in a deterministic order, layer moves first,
    from the most loaded stage (layers x ``per_layer[option]``) to the least loaded (a capped
    walk tries the likeliest moves first); may include plans that do not fit (the caller
    checks)."""
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
                    yield cfg, opts, moved
    for i in range(n):
        for j in range(i + 1, n):
            if layers[i] != layers[j]:
                trade = list(layers)
                trade[i], trade[j] = layers[j], layers[i]
                yield cfg, opts, trade
            if opts[i] == opts[j]:
                continue
            swapped = list(opts)
            swapped[i], swapped[j] = opts[j], opts[i]
            yield cfg, swapped, layers
            if layers[i] != layers[j]:
                yield cfg, swapped, trade
    for i in range(n):
        for o in range(len(cfg.options)):
            if o != opts[i]:
                other = list(opts)
                other[i] = o
                yield cfg, other, layers
    if resize is None:
        return
    bigger = resize(cfg, n + 1)
    if bigger is not None and layers[givers[0]] - v >= v:
        index = {opt: o for o, opt in enumerate(bigger.options)}
        mapped = [index.get(cfg.options[o]) for o in opts]
        if None not in mapped:
            took = list(layers)
            took[givers[0]] -= v
            for new in range(len(bigger.options)):
                for at in range(n + 1):
                    yield (bigger, mapped[:at] + [new] + mapped[at:],
                           took[:at] + [v] + took[at:])
    smaller = resize(cfg, n - 1) if n > 1 else None
    if smaller is not None:
        index = {opt: o for o, opt in enumerate(smaller.options)}
        mapped = [index.get(cfg.options[o]) for o in opts]
        for i in range(n):
            rest = mapped[:i] + mapped[i + 1:]
            if None in rest:
                continue
            for to in sorted({i - 1, i + 1} & set(range(n))):
                merged = list(layers)
                merged[to] += merged[i]
                del merged[i]
                yield smaller, rest, merged


def polish(ctx: SearchContext, cfg: OuterConfig, opts, layers, time_ms: float, *,
           allowed: Callable[[OuterConfig, list[int]], bool] | None = None,
           resize: Resize | None = None, deadline: float | None = None,
           max_evals: int = POLISH_EVALS, first_improvement: bool = False) -> Polished:
    """Best-improvement local search from the feasible plan (``opts``, ``layers``) of
    ``cfg`` with simulated time ``time_ms``; stops at a local optimum, after ``max_evals``
    timed plans or at ``deadline`` (``time.monotonic()``), keeping the best plan so far.
    ``resize(cfg, n)``: the configuration like ``cfg`` with n stages, or None (no grow /
    shrink moves without it). ``first_improvement``: take the first faster neighbour instead
    (more steps under a small ``max_evals``: the construction's cheap polish)."""
    cur: Plan3 = (cfg, list(opts), list(layers))
    cur_t = time_ms
    steps = evals = 0
    while True:
        c0, o0, l0 = cur
        costs = ctx.option_costs(c0)
        per_layer = [f + b for f, b in zip(costs.f, costs.b)]
        best = None
        for c, o, l in _moves(c0, o0, l0, per_layer, resize):
            lmax, v = ctx.lmax_rows(c), c.virtual_stages
            if any(not v <= l[x] <= lmax[o[x]][x] for x in range(c.num_stages)):
                continue
            if o is not o0 and allowed is not None and not allowed(c, o):
                continue
            if evals >= max_evals or (deadline is not None and time.monotonic() > deadline):
                if best is not None:
                    cur_t, cur, steps = best[0], best[1], steps + 1
                return _result(cur_t, cur, steps, evals, False)
            try:
                t = ctx.replay(c, o, l)[1]
            except ValueError:        # the devices of some type do not hold the stages
                continue
            evals += 1
            if t < cur_t * (1 - 1e-12) and (best is None or t < best[0]):
                best = (t, (c, list(o), list(l)))
                if first_improvement:
                    break
        if best is None:
            return _result(cur_t, cur, steps, evals, True)
        cur_t, cur = best
        steps += 1


def _result(t: float, plan: Plan3, steps: int, evals: int, complete: bool) -> Polished:
    cfg, opts, layers = plan
    return Polished(t, cfg, tuple(opts), tuple(layers), steps, evals, complete)
