"""What the best plan is compared with, and why no plan fits.

``baseline_plans``: (a) ``megatron-default``, Megatron's even split over all devices (one TP,
even layers, 1F1B, the largest feasible DP, homogeneous assumptions) timed on the real cluster;
(b) ``best-single-type``, the best plan on one device type only (the search on a sub-cluster).

``explain_infeasible``: when no plan fits, one line naming the candidate that comes closest and
how much memory it lacks.
"""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType

from ..costs import CostModel, chunk_layers
from ..errors import InfeasibleError, PoseidonError
from ..plan import Plan
from .build import build_plan
from .configs import OuterConfig, tp_candidates
from .instance import SearchContext

GIB = 1024 ** 3


# --------------------------------------------------------------------------- baselines

def baseline_plans(cluster, model, options, profiles=None) -> dict[str, Plan | None]:
    """The two baselines under ``options`` (a ``SearchOptions``); None where none fits."""
    options.check_against(cluster, model)
    ctx = SearchContext(CostModel(cluster, model, profiles, seq_length=options.seq_length,
                                  training=options.training))
    return {"megatron-default": megatron_default_plan(ctx, options),
            "best-single-type": best_single_type_plan(cluster, model, options, profiles)}


def _even_split_types(ctx: SearchContext, n: int, per_stage: int) -> list[int] | None:
    """Stages in cluster order filling the type pools (``per_stage`` devices each)."""
    types, free = [], [p.size for p in ctx.cm.pools]
    for _ in range(n):
        k = next((k for k in range(len(free)) if free[k] >= per_stage), None)
        if k is None:
            return None
        free[k] -= per_stage
        types.append(k)
    return types


def megatron_default_plan(ctx: SearchContext, options) -> Plan | None:
    """The fastest even split over every device: TP t (valid on every type), N stages
    dividing the layers, d = devices / (t N), layers L / N per stage, 1F1B."""
    cm, model = ctx.cm, ctx.cm.model
    total = sum(p.size for p in cm.pools)
    L, G = model.num_layers, options.global_batch_size
    tps_all = sorted(set.intersection(*[
        set(tp_candidates(cm.cluster, model, n, options.tp_degrees)) for n in cm.type_names]))
    cands = []
    for t in tps_all:
        for n in (n for n in range(1, L + 1) if L % n == 0 and total % (t * n) == 0):
            d = total // (t * n)
            types = _even_split_types(ctx, n, d * t)
            if types is None:
                continue
            for b in (b for b in options.micro_batch_sizes if G % (d * b) == 0):
                m = G // (d * b)
                opts = tuple(sorted({(k, t) for k in types}))
                cfg = OuterConfig("1f1b", 1, b, d, m, n, t, opts)
                layers = [L // n] * n
                if all(cm.stage_memory_bytes(
                        layers=layers[x], stage=x, num_stages=n, tp=t, dp=d, micro_batch_size=b,
                        num_microbatches=m, schedule="1f1b", virtual_stages=1,
                        type_index=types[x])
                       <= cm.capacity_bytes[types[x]] for x in range(n)):
                    so = [opts.index((k, t)) for k in types]
                    cands.append((ctx.evaluate(cfg, so, layers), cfg.key, cfg, so, layers))
    if not cands:
        return None
    tt, _, cfg, so, layers = min(cands, key=lambda c: c[:2])
    return build_plan(cm, cfg, so, layers, global_batch_size=G, predicted_ms=tt,
                      search_stats={"baseline": "megatron-default"})


def best_single_type_plan(cluster, model, options, profiles=None) -> Plan | None:
    """The best plan of the search restricted to one device type (the fastest type wins)."""
    from .driver import search_plan

    best = None
    for name in cluster.type_names:
        try:
            p = search_plan(single_type_cluster(cluster, name), model, options, profiles)
        except (InfeasibleError, PoseidonError):
            continue
        if best is None or p.predicted_iteration_time_ms < best.predicted_iteration_time_ms:
            best = p
    return best


def single_type_cluster(cluster, name: str):
    """The sub-cluster of one device type's nodes (re-indexed; named ``cluster[type]``)."""
    nodes = tuple(n for n in cluster.nodes if n.device_type == name)
    renum = tuple(replace(n, index=i) for i, n in enumerate(nodes))
    return replace(cluster, name=f"{cluster.name}[{name}]", nodes=renum,
                   device_types=MappingProxyType({name: cluster.device_types[name]}),
                   links=replace(cluster.links, inter_node_gbps=MappingProxyType(
                       {name: cluster.links.inter_node_gbps[name]})))


# --------------------------------------------------------------------------- infeasibility

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


def _shortfalls(cm: CostModel, cfg: OuterConfig, counts: dict[int, int]
                ) -> list[dict[int, tuple[int, int]]]:
    """short[x][k] = (memory - capacity, memory) of stage x (even layer split) on type k's
    best option."""
    n = cfg.num_stages
    base = chunk_layers(cm.model.num_layers, n)
    short: list[dict[int, tuple[int, int]]] = []
    for x in range(n):
        row: dict[int, tuple[int, int]] = {}
        for k, t in cfg.options:
            if counts[k] <= 0:
                continue
            mem = cm.stage_memory_bytes(layers=base[x], stage=x, num_stages=n, tp=t, dp=cfg.dp,
                                        micro_batch_size=cfg.micro_batch_size,
                                        num_microbatches=cfg.num_microbatches,
                                        schedule=cfg.schedule,
                                        virtual_stages=cfg.virtual_stages, type_index=k)
            cand = (mem - cm.capacity_bytes[k], mem)
            if k not in row or cand < row[k]:
                row[k] = cand
        short.append(row)
    return short


def _closest_assignment(cm: CostModel, cfg: OuterConfig):
    """(shortfall, worst stage, its type, its memory) of the assignment of types to stages
    with the smallest worst-stage shortfall (bisection over the candidate values, each
    checked by a matching); None when the devices cannot host the stages at all."""
    counts: dict[int, int] = {}
    for k, t in cfg.options:
        counts[k] = max(counts.get(k, 0), cm.pools[k].size // (cfg.dp * t))
    short = _shortfalls(cm, cfg, counts)
    ks = sorted(counts)
    cnt = [counts[k] for k in ks]
    values = sorted({v[0] for row in short for v in row.values()})

    def fits(tau: int) -> list[int] | None:
        allowed = [[i for i, k in enumerate(ks) if k in row and row[k][0] <= tau]
                   for row in short]
        return _stage_type_match(allowed, cnt)

    if not values or fits(values[-1]) is None:
        return None
    lo, hi = 0, len(values) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(values[mid]) is not None:
            hi = mid
        else:
            lo = mid + 1
    tau = values[lo]
    assign = [ks[i] for i in fits(tau)]
    x_w = max(range(cfg.num_stages), key=lambda x: (short[x][assign[x]][0], -x))
    k_w = assign[x_w]
    return tau, x_w, k_w, short[x_w][k_w][1]


def explain_infeasible(cm: CostModel, configs: list[OuterConfig]) -> str:
    """One line: the candidate that comes closest to fitting and how much memory it lacks.

    Per configuration (1F1B-like schedules): layers split evenly over the stages, each stage on
    a device type of the configuration's options with type k serving at most
    devices_k // (dp * t) stages; the shortfall of a configuration is the smallest, over such
    assignments, of its worst stage's (memory - capacity). The configuration with the smallest
    shortfall is named, with its worst stage."""
    best = None
    for cfg in configs:
        if cfg.schedule not in ("1f1b", "eager-1f1b", "gpipe"):
            continue
        if cfg.num_stages > cm.model.num_layers:
            continue
        got = _closest_assignment(cm, cfg)
        if got is None:
            continue   # the devices cannot host n stages at all
        if best is None or (got[0], cfg.key) < (best[1][0], best[0].key):
            best = (cfg, got)
    if best is None:
        return "no plan fits: no configuration could be placed on the cluster"
    cfg, (tau, x, k, mem) = best
    what = (f"(pp={cfg.num_stages}, tp={cfg.tp or 'per-stage'}, dp={cfg.dp}, micro-batch "
            f"{cfg.micro_batch_size}, {cfg.schedule})")
    if tau <= 0:
        return (f"no plan fits: the closest {what} fits memory with an even layer split but "
                f"its stages cannot be placed on the devices (TP groups must not span nodes)")
    return (f"no plan fits in device memory: the closest {what} lacks {tau / GIB:.2f} GiB on "
            f"stage {x} ({cm.type_names[k]}: needs {mem / GIB:.2f} GiB of "
            f"{cm.capacity_bytes[k] / GIB:.2f} GiB)")
