"""Why no plan fits: the candidate that comes closest and how much memory it lacks
(``explain_infeasible``, the search's error when nothing fits)."""

from __future__ import annotations

from ..costs import CostModel, chunk_layers
from .configs import OuterConfig

GIB = 1024 ** 3


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


def held_kinds(cm: CostModel, layers, x: int) -> tuple[int, ...] | None:
    """The layers of each kind stage x of a one-chunk plan holds (a model of several kinds,
    ``cm.per_kind``; None otherwise: the memory is then the same without them)."""
    if not cm.per_kind:
        return None
    a = sum(layers[:x])
    return cm.model.kind_counts_in(a, a + layers[x])


def _shortfalls(cm: CostModel, cfg: OuterConfig, counts: dict[int, int]
                ) -> list[dict[int, tuple[int, int]]]:
    """short[x][k] = (memory - capacity, memory) of stage x (even layer split) on type k's
    best option."""
    cm = cm.at_cp(cfg.cp)
    n = cfg.num_stages
    base = chunk_layers(cm.model.num_layers, n)
    short: list[dict[int, tuple[int, int]]] = []
    for x in range(n):
        row: dict[int, tuple[int, int]] = {}
        for k, t in cfg.options:
            if counts[k] <= 0:
                continue
            mem = cm.stage_memory_bytes(layers=base[x], stage=x, num_stages=n, tp=t,
                                        dp=cfg.dp_cp,
                                        micro_batch_size=cfg.micro_batch_size,
                                        num_microbatches=cfg.num_microbatches,
                                        schedule=cfg.schedule,
                                        virtual_stages=cfg.virtual_stages, type_index=k,
                                        kind_counts=(held_kinds(cm, base, x)
                                                     if cfg.virtual_stages == 1 else None))
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
        counts[k] = max(counts.get(k, 0), cm.pools[k].size // (cfg.dp_cp * t))
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
    what = (f"(pp={cfg.num_stages}, tp={cfg.tp or 'per-stage'}, dp={cfg.dp}, "
            + (f"cp={cfg.cp}, " if cfg.cp > 1 else "") + "micro-batch "
            f"{cfg.micro_batch_size}, {cfg.schedule})")
    if tau <= 0:
        return (f"no plan fits: the closest {what} fits memory with an even layer split but "
                f"its stages cannot be placed on the devices (TP groups must not span nodes)")
    return (f"no plan fits in device memory: the closest {what} lacks {tau / GIB:.2f} GiB on "
            f"stage {x} ({cm.type_names[k]}: needs {mem / GIB:.2f} GiB of "
            f"{cm.capacity_bytes[k] / GIB:.2f} GiB)")
