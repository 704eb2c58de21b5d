"""A constructive plan per outer configuration: a good feasible plan fast, at any size.

For one configuration (schedule, V, b, d, N, TP options) the construction picks

1. **the device types of the N stages**: every type offers ``devices // (d t)`` stage slots
   (t = its cheapest option's TP); the slots are ranked by the layer time ``M (f + b)`` of the
   type's cheapest option and the N fastest are taken (a type whose slots hold no layer under
   memory is skipped);
2. **their order**: the chosen types as contiguous blocks, every permutation of the block order
   (at most 4! = 24 orders for 4 types), so memory-rich types can take the early stages, which
   hold the most micro-batches in flight;
3. **the layers**: the smallest target time T (bisection) at which
   ``sum_x min(lmax[o_x, x], floor(T / (M (f + b)_x)))`` reaches the layer count, then the
   surplus is taken off the most loaded stages; a stage gets at least V layers.

Each candidate is placed with the search's own placement (TP groups inside a node) and timed by
the simulator through ``SearchContext.replay`` (the exact time the search would give it), so a
constructed plan is always feasible and its time is a valid incumbent: the branch and bound that
follows only returns plans at least as fast. The construction is a heuristic: it is not the
optimum (interleaved type orders, per-stage TP mixes and uneven splits are left to the search).
"""

from __future__ import annotations

import itertools
import math

from .configs import OuterConfig
from .instance import SearchContext


def _stage_types(ctx: SearchContext, cfg: OuterConfig) -> list[tuple[int, int]] | None:
    """(type, option) of the N stages: the N fastest stage slots over the usable types."""
    costs = ctx.option_costs(cfg)
    lmax = ctx.lmax(cfg)
    best: dict[int, int] = {}
    for o, (k, _t) in enumerate(cfg.options):
        if int(lmax[o].max()) < cfg.virtual_stages:
            continue
        if k not in best or costs.f[o] + costs.b[o] < costs.f[best[k]] + costs.b[best[k]]:
            best[k] = o
    slots = []
    for k, o in best.items():
        n_slots = ctx.cm.pools[k].size // (cfg.dp * cfg.options[o][1])
        slots += [(costs.f[o] + costs.b[o], k, o)] * min(n_slots, cfg.num_stages)
    if len(slots) < cfg.num_stages:
        return None
    slots.sort()
    return [(k, o) for _, k, o in slots[:cfg.num_stages]]


def _fill_layers(caps_at, n: int, total: int, v: int, loads: list[float]) -> list[int] | None:
    """Layers per stage for the smallest target time that holds ``total`` layers:
    ``caps_at(T)`` gives each stage's cap at T; the surplus leaves the most loaded stages."""
    if sum(caps_at(math.inf)) < total:
        return None
    lo, hi = 0.0, max(loads) * total
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if sum(caps_at(mid)) >= total:
            hi = mid
        else:
            lo = mid
        if hi - lo <= 1e-9 * hi:
            break
    layers = caps_at(hi)
    surplus = sum(layers) - total
    while surplus > 0:
        x = max((x for x in range(n) if layers[x] > v), key=lambda x: (layers[x] * loads[x], x))
        layers[x] -= 1
        surplus -= 1
    return layers


def construct_plan(ctx: SearchContext, cfg: OuterConfig):
    """(time ms, stage options, layers) of the best constructed plan of ``cfg``, or None when
    the construction finds no feasible one."""
    stages = _stage_types(ctx, cfg)
    if stages is None:
        return None
    lmax = ctx.lmax(cfg)
    costs = ctx.option_costs(cfg)
    n, v, m, L = cfg.num_stages, cfg.virtual_stages, cfg.num_microbatches, ctx.cm.model.num_layers
    blocks: dict[int, list[int]] = {}
    for k, o in stages:
        blocks.setdefault(k, []).append(o)
    best = None
    for order in itertools.permutations(sorted(blocks)):
        opts = [o for k in order for o in blocks[k]]
        loads = [m * (costs.f[o] + costs.b[o]) for o in opts]

        def caps_at(t: float, opts=opts, loads=loads) -> list[int]:
            out = []
            for x, o in enumerate(opts):
                c = int(lmax[o, x])
                if math.isfinite(t) and loads[x] > 0:
                    c = min(c, int(t / loads[x]))
                out.append(max(c, v))
            return out

        layers = _fill_layers(caps_at, n, L, v, loads)
        if layers is None or any(layers[x] > lmax[o, x] for x, o in enumerate(opts)):
            continue
        try:
            t = ctx.replay(cfg, opts, layers)[1]
        except ValueError:      # the placement (TP groups in a node) does not fit
            continue
        cand = (t, tuple(opts), tuple(layers))
        if best is None or cand < best:
            best = cand
    return best
