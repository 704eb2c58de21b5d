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
   surplus is taken off the most loaded stages; a stage gets at least V layers. A model of
   several layer kinds fills the stages in order by the exact limits and costs of each
   stage's own layer range (``_fill_layers_from``: ``lmax_from``, per-kind layer costs, the
   embedding and output layer), and also tries each order with one stage of the type with the
   cheapest output layer moved to the end (``_orders``).

Each candidate is placed with the search's own placement (TP groups inside a node) and timed by
the simulator through ``SearchContext.replay`` (the exact time the search would give it), so a
constructed plan is always feasible and its time is a valid incumbent: the branch and bound that
follows only returns plans at least as fast. With per-stage TP every type gets one option (the
best few per-type choices by an estimate, not only the fastest option: a deep pipeline needs
the slots of smaller TP degrees). The construction is a heuristic: it is not the optimum
(interleaved type orders, TP mixes within a type and uneven splits are left to the search).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math

from .configs import OuterConfig
from .instance import SearchContext
from .polish import CONSTRUCT_EVALS, polish


def _type_slots(ctx: SearchContext, cfg: OuterConfig, choice: dict[int, int] | None = None
                ) -> list[tuple[float, int, int, int]]:
    """Per usable type: (layer time f + b of its option, type, option, stage slots); the
    option is ``choice[type]`` where given, else the type's cheapest (f + b)."""
    costs = ctx.option_costs(cfg)
    lmax = ctx.lmax(cfg)
    best: dict[int, int] = {}
    for o, (k, _t) in enumerate(cfg.options):
        if int(lmax[o].max()) < cfg.virtual_stages:
            continue
        if choice is not None and k in choice:
            if choice[k] == o:
                best[k] = o
            continue
        if k not in best or costs.f[o] + costs.b[o] < costs.f[best[k]] + costs.b[best[k]]:
            best[k] = o
    return sorted((costs.f[o] + costs.b[o], k, o,
                   min(ctx.cm.pools[k].size // (cfg.dp_cp * cfg.options[o][1]), cfg.num_stages))
                  for k, o in best.items())


TP_CHOICES = 2   # per-stage TP: the constructions tried, best estimated per-type TP choices first


def _tp_choices(ctx: SearchContext, cfg: OuterConfig) -> list[dict[int, int] | None]:
    """Per-stage TP: one option per type for every type, the TP_CHOICES combinations whose
    N fastest stage slots reach the layer count at the smallest target time (each slot holds
    min(its memory limit, T / (M (f + b))) layers; a bisection on T per combination). One TP
    per type is still a construction's restriction (the search mixes them); the cheapest
    (f + b) alone (the fastest option) gives few slots, too few for deep pipelines."""
    per_type: dict[int, list[int]] = {}
    for o, (k, _t) in enumerate(cfg.options):
        per_type.setdefault(k, []).append(o)
    if all(len(os_) == 1 for os_ in per_type.values()):
        return [None]
    costs, lmax = ctx.option_costs(cfg), ctx.lmax(cfg)
    n, m, L = cfg.num_stages, cfg.num_microbatches, ctx.cm.model.num_layers
    scored = []
    for combo in itertools.product(*per_type.values()):
        groups = sorted((m * (costs.f[o] + costs.b[o]), int(lmax[o].max()),
                         ctx.cm.pools[cfg.options[o][0]].size // (cfg.dp_cp * cfg.options[o][1]))
                        for o in combo)
        chosen, left = [], n
        for load, cap, cnt in groups:
            if cap >= cfg.virtual_stages and cnt > 0 and left > 0:
                chosen.append((load, cap, min(cnt, left)))
                left -= min(cnt, left)
        if left > 0 or sum(cap * c for _, cap, c in chosen) < L:
            continue
        lo, hi = 0.0, max(load for load, _, _ in chosen) * L
        for _ in range(40):
            mid = 0.5 * (lo + hi)
            if sum(c * min(cap, int(mid / load)) for load, cap, c in chosen) >= L:
                hi = mid
            else:
                lo = mid
        scored.append((hi, combo))
    scored.sort()
    return [{cfg.options[o][0]: o for o in combo} for _, combo in scored[:TP_CHOICES]]


def _stage_types(ctx: SearchContext, cfg: OuterConfig, swaps: int = 0,
                 choice: dict[int, int] | None = None) -> list[tuple[int, int]] | None:
    """(type, option) of the N stages: the N fastest stage slots over the usable types; then
    ``swaps`` times, a slot of the type with the least memory room (layers it can hold) is
    traded for a free slot of the type with the most (memory, not speed, is what a large model
    runs out of first)."""
    types = _type_slots(ctx, cfg, choice)
    n = cfg.num_stages
    if sum(c for *_, c in types) < n:
        return None
    lmax = ctx.lmax(cfg)
    room = {k: int(lmax[o].max()) for _, k, o, _ in types}
    take: dict[int, int] = {}
    left = n
    for _, k, _, c in types:            # fastest first
        take[k] = min(c, left)
        left -= take[k]
    free = {k: c - take[k] for _, k, _, c in types}
    for _ in range(swaps):
        give = [k for k in take if take[k] > 0]
        get = [k for k in free if free[k] > 0]
        if not give or not get:
            break
        a = min(give, key=lambda k: (room[k], k))
        b = max(get, key=lambda k: (room[k], -k))
        if room[b] <= room[a]:
            break
        take[a] -= 1
        free[a] += 1
        take[b] += 1
        free[b] -= 1
    opt = {k: o for _, k, o, _ in types}
    return [(k, opt[k]) for _, k, _, _ in types for _ in range(take[k])]


def _caps_at(t: float, caps: list[int], loads: list[float], v: int) -> list[int]:
    """Each stage's layers at target time t: min(memory cap, floor(t / load)), at least v."""
    if not math.isfinite(t):
        return [max(c, v) for c in caps]
    return [max(min(c, int(t / ld)) if ld > 0 else c, v) for c, ld in zip(caps, loads)]


def _fill_layers(caps: list[int], loads: list[float], total: int, v: int) -> list[int] | None:
    """Layers per stage for the smallest target time T at which ``_caps_at(T)`` holds
    ``total`` layers; the surplus leaves the most loaded stages. T is found exactly: the caps
    only step at the times k x load of a stage, so the steps are taken in time order (a heap)
    until they reach ``total``; the steps tied with the last one are taken with it."""
    n = len(caps)
    if sum(_caps_at(math.inf, caps, loads, v)) < total:
        return None
    counts = _caps_at(0.0, caps, loads, v)
    have = sum(counts)
    steps = [((counts[x] + 1) * loads[x], x) for x in range(n)
             if loads[x] > 0 and counts[x] < caps[x]]
    heapq.heapify(steps)
    t = 0.0
    while have < total:
        t, x = heapq.heappop(steps)
        counts[x] += 1
        have += 1
        if counts[x] < caps[x]:
            heapq.heappush(steps, ((counts[x] + 1) * loads[x], x))
    layers = _caps_at(t * (1.0 + 1e-9), caps, loads, v) if t > 0 else counts
    surplus = sum(layers) - total
    while surplus > 0:
        x = max((x for x in range(n) if layers[x] > v), key=lambda x: (layers[x] * loads[x], x))
        layers[x] -= 1
        surplus -= 1
    return layers


def _most_layers(ctx: SearchContext, cfg: OuterConfig, choice: dict[int, int] | None = None
                 ) -> int:
    """Most layers any N usable stage slots can hold under memory (each slot at its type's
    largest limit over the positions): below the layer count, no swap can help."""
    lmax = ctx.lmax(cfg)
    rooms = []
    for _, k, o, c in _type_slots(ctx, cfg, choice):
        rooms += [int(lmax[o].max())] * c
    rooms.sort(reverse=True)
    return sum(rooms[:cfg.num_stages]) if len(rooms) >= cfg.num_stages else -1


ROOM_GRID = (2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64, 80, 96, 128)
# memory_room's cheap bound reads the limits of the stages N - g, g in this grid (for 1F1B the
# micro-batches in flight are min(g, M) there: the memo's entries serve every depth N)


def memory_room(ctx: SearchContext, cfg: OuterConfig) -> int:
    """Most layers any plan of ``cfg`` can place under memory, from above: the sum over the
    stages of the roomiest option's limit there (``sum_x max_o lmax[o, x]``; the types' slot
    counts ignored). Below the layer count no plan of ``cfg`` fits: the construction skips
    it (on a memory-tight cluster most configurations: 405B on 2,048 devices with a 24 and a
    32 GiB type, 75 of the first 3,200 by root bound pass).

    First a cheaper bound, ``lmax`` (every stage) only where it passes: a uniform model's
    stages 1 .. N-2 differ only in the micro-batches they hold, which do not rise with the
    stage, so their limits do not fall with it; stage 0 holds as many or more and the
    embedding besides. So each run of stages up to a sampled one (N - g, g in ROOM_GRID) is
    counted at the sampled stage's limit, the last stage at its own."""
    L = ctx.cm.model.num_layers
    if cfg not in ctx._lmax:
        bound = room_bound(ctx, cfg)
        if bound is not None and bound < L:
            return bound
    return int(ctx.lmax(cfg).max(axis=0).sum())


def room_bound(ctx: SearchContext, cfg: OuterConfig) -> int | None:
    """``memory_room``'s cheap bound (>= ``sum_x max_o lmax[o, x]``) from the stages N - g,
    g in ROOM_GRID, and the last; None where it does not apply (a model of several layer kinds,
    whose limits depend on each stage's first layer; N <= 8: ``lmax`` costs as little)."""
    n = cfg.num_stages
    if ctx.cm.per_kind or n <= 8:
        return None
    cm, v, L = ctx.cm.at_cp(cfg.cp), cfg.virtual_stages, ctx.cm.model.num_layers
    marks = sorted(n - g for g in ROOM_GRID if g <= n - 1)   # ascending, the last N - 2
    stages = marks + [n - 1]
    best = [0] * len(stages)
    for k, t in cfg.options:
        row = cm.max_layers_by_stage(
            capacity_bytes=cm.capacity_bytes[k], stages=stages, num_stages=n, tp=t,
            dp=cfg.dp_cp, micro_batch_size=cfg.micro_batch_size,
            num_microbatches=cfg.num_microbatches, schedule=cfg.schedule,
            virtual_stages=v, limit=L - (n - 1) * v, type_index=k)
        best = [max(a, b) for a, b in zip(best, row)]
    # stages 0 .. marks[0] at marks[0]'s limit, (marks[j-1], marks[j]] at marks[j]'s
    return (marks[0] + 1) * best[0] + best[-1] + sum(
        (marks[j] - marks[j - 1]) * best[j] for j in range(1, len(marks)))


def _layer_times(ctx: SearchContext, cfg: OuterConfig, o: int) -> list[float]:
    """A model of several layer kinds: t[i] = M (f + b) of layers [0, i) on option o (each
    layer at its own kind's costs), L + 1 entries."""
    costs = ctx.option_costs(cfg)
    m = cfg.num_microbatches
    out = [0.0]
    for kind in ctx.cm.model.layer_kind_of:
        f, b, _gl, _og = costs.kinds[o][kind]
        out.append(out[-1] + m * (f + b))
    return out


def _fill_layers_from(ctx: SearchContext, cfg: OuterConfig, opts: list[int]
                      ) -> list[int] | None:
    """A model of several layer kinds: the layers per stage of ``opts`` by the exact limits
    and costs of each stage's own layer range (stages filled in order, so stage x starts at
    the layers of the stages before it). For a target time T stage x takes the most layers
    from its first layer a whose time M sum(f + b) is at most T, within its memory limit
    from a (``lmax_from[o, x, a]``) and leaving V layers to every later stage; the last stage
    takes the rest. The smallest T (bisection) at which the rest fits the last stage, in
    memory and within T, gives the split; None when no T does."""
    frm = ctx.lmax_from(cfg)
    costs = ctx.option_costs(cfg)
    n, v, m, L = cfg.num_stages, cfg.virtual_stages, cfg.num_microbatches, ctx.cm.model.num_layers
    # the first stage also runs the embedding, the last the output layer (M (f + b) each)
    first = m * (costs.ef[opts[0]] + costs.eb[opts[0]])
    last = m * (costs.of[opts[-1]] + costs.ob[opts[-1]]) + (first if n == 1 else 0.0)
    pre: dict[int, list[float]] = {}
    for o in opts:
        if o not in pre:
            pre[o] = _layer_times(ctx, cfg, o)

    def split(t: float) -> tuple[list[int] | None, bool]:
        """(layers, the last stage within t) at target t; layers None where a stage cannot
        hold its V layers."""
        a, layers = 0, []
        for x, o in enumerate(opts):
            p = pre[o]
            if x == n - 1:
                rest = L - a
                if not v <= rest <= frm[o, x, a]:
                    return None, False
                layers.append(rest)
                return layers, last + p[L] - p[a] <= t
            hi = min(int(frm[o, x, a]), L - a - (n - 1 - x) * v)
            if hi < v:
                return None, False
            room = t - (first if x == 0 else 0.0)
            take = bisect.bisect_right(p, p[a] + room, a, a + hi + 1) - 1 - a
            layers.append(max(v, take))
            a += layers[-1]
        return None, False

    lo, hi = 0.0, (first + last + max(p[L] for p in pre.values())) * (1.0 + 1e-9)
    best = split(hi)[0]
    if best is None:
        return None
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        layers, ok = split(mid)
        if layers is not None and ok:
            hi, best = mid, layers
        else:
            lo = mid
        if hi - lo <= 1e-9 * hi:
            break
    return best


def _match_chunk_totals(layers: list[int], loads: list[float], totals: tuple[int, ...]
                        ) -> list[int] | None:
    """A split near ``layers`` whose model chunks hold ``totals`` (an interleaved
    configuration of a model of several kinds, ``OuterConfig.chunk_totals``), or None: the
    totals fix how many stages hold l = j (mod V) (r_j = S_{j-1} - S_j, r_0 the rest); the
    stages of the largest remainders take the largest ones, each the nearest count of its
    remainder, then V layers at a time move from the most loaded stage (M (f + b) per layer,
    ``loads``) to the least until the layers add up. The exact check (memory, the totals) is
    the replay's."""
    v, n = len(totals), len(layers)
    want = [totals[j - 1] - totals[j] for j in range(1, v)]
    want = [n - sum(want)] + want
    if min(want) < 0:
        return None
    rems = sorted((j for j in range(v) for _ in range(want[j])), reverse=True)
    order = sorted(range(n), key=lambda x: (-(layers[x] % v), x))
    out = list(layers)
    for x, j in zip(order, rems):
        down = layers[x] - (layers[x] - j) % v
        out[x] = down if down >= v and layers[x] - down <= down + v - layers[x] else down + v
    total = sum(layers)
    for _ in range(2 * n + 2):
        diff = sum(out) - total
        if diff == 0:
            return out
        if diff > 0:
            cand = [x for x in range(n) if out[x] - v >= v]
            if not cand:
                return None
            x = max(cand, key=lambda x: (out[x] * loads[x], -x))
            out[x] -= v
        else:
            x = min(range(n), key=lambda x: (out[x] * loads[x], x))
            out[x] += v
    return None


def _orders(ctx: SearchContext, cfg: OuterConfig, blocks: dict[int, list[int]], mixed: bool):
    """(type order, stage options): every order of the type blocks; for a model of several
    layer kinds also each order with one stage of the type of the cheapest output layer
    (M (of + ob)) moved to the end, where the output layer runs (a memory-poor or slow type's
    block that must come last under the exact limits would otherwise carry it)."""
    costs = ctx.option_costs(cfg)
    end = None
    if mixed and len(blocks) > 1:
        end = min(blocks, key=lambda k: (min(costs.of[o] + costs.ob[o] for o in blocks[k]), k))
    for order in itertools.permutations(sorted(blocks)):
        opts = [o for k in order for o in blocks[k]]
        yield order, opts
        if end is not None and order[-1] != end:
            at = max(i for i, o in enumerate(opts) if cfg.options[o][0] == end)
            yield order, opts[:at] + opts[at + 1:] + [opts[at]]


def _construct_with(ctx: SearchContext, cfg: OuterConfig, stages, allowed=None):
    """The best (time, options, layers) over the block orders of ``stages``, or None;
    ``allowed(cfg, opts)``: whether stage options lie in the searched space (None: all do)."""
    lmax = ctx.lmax(cfg)
    costs = ctx.option_costs(cfg)
    n, v, m, L = cfg.num_stages, cfg.virtual_stages, cfg.num_microbatches, ctx.cm.model.num_layers
    mixed = ctx.lmax_from(cfg) is not None
    blocks: dict[int, list[int]] = {}
    for k, o in stages:
        blocks.setdefault(k, []).append(o)
    best = None
    for _order, opts in _orders(ctx, cfg, blocks, mixed):
        if allowed is not None and not allowed(cfg, opts):
            continue
        if mixed:
            layers = _fill_layers_from(ctx, cfg, opts)
            if layers is None or not ctx.fits(cfg, opts, layers):
                continue
        else:
            loads = [m * (costs.f[o] + costs.b[o]) for o in opts]
            caps = [int(lmax[o, x]) for x, o in enumerate(opts)]
            layers = _fill_layers(caps, loads, L, v)
            if layers is not None and cfg.chunk_totals:
                layers = _match_chunk_totals(layers, loads, cfg.chunk_totals)
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


def construct_plan(ctx: SearchContext, cfg: OuterConfig, allowed=None,
                   deadline: float | None = None):
    """(time ms, stage options, layers) of the best constructed plan of ``cfg``, or None when
    the construction finds no feasible one: per type one option (its fastest, or with
    per-stage TP the best estimated per-type TP choices, ``_tp_choices``), then
    ``_construct_choice``. ``allowed(cfg, opts)``: whether stage options lie in the searched
    space (the mixed-model orders with one stage moved to the end need not). ``deadline``
    (``time.monotonic()``): the polish stops there (a constructed plan is still returned)."""
    if memory_room(ctx, cfg) < ctx.cm.model.num_layers:
        return None
    got = [c for c in (_construct_choice(ctx, cfg, ch, allowed, deadline)
                       for ch in _tp_choices(ctx, cfg)) if c is not None]
    return min(got) if got else None


def _construct_choice(ctx: SearchContext, cfg: OuterConfig, choice: dict[int, int] | None,
                      allowed=None, deadline: float | None = None):
    """The fastest slots first; when they cannot hold the model, the fewest memory swaps that
    can (1, 2, 4, ... then bisection), and twice that; then ``polish``."""
    first = _stage_types(ctx, cfg, choice=choice)
    if first is None or _most_layers(ctx, cfg, choice) < ctx.cm.model.num_layers:
        return None
    got = _construct_with(ctx, cfg, first, allowed)
    if got is not None:
        return _polish(ctx, cfg, *got, deadline=deadline)
    tried: dict[int, object] = {0: None}

    def attempt(s: int):
        if s not in tried:
            st = _stage_types(ctx, cfg, s, choice)
            tried[s] = None if st is None else _construct_with(ctx, cfg, st, allowed)
        return tried[s]

    hi = 1
    while attempt(hi) is None:
        if hi >= cfg.num_stages:
            return None
        hi = min(2 * hi, cfg.num_stages)
    lo = hi // 2                        # attempt(lo) failed (or lo = 0)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if attempt(mid) is None:
            lo = mid
        else:
            hi = mid
    cands = [c for c in (attempt(hi), attempt(min(2 * hi, cfg.num_stages))) if c is not None]
    return _polish(ctx, cfg, *min(cands), deadline=deadline)


def _polish(ctx: SearchContext, cfg: OuterConfig, t: float, opts, layers,
            deadline: float | None = None):
    """The cheap polish of a constructed plan: first improvement, at most
    ``polish.CONSTRUCT_EVALS`` simulations, none after ``deadline``."""
    got = polish(ctx, cfg, opts, layers, t, max_evals=CONSTRUCT_EVALS, first_improvement=True,
                 deadline=deadline)
    return got.time_ms, got.opts, got.layers
