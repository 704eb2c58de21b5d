"""What the best plan is compared with.

``baseline_plans``: (a) ``megatron-default``, Megatron's even split over all devices (one TP,
even layers, 1F1B, the largest feasible DP, homogeneous assumptions) timed on the real cluster;
(b) ``best-single-type``, the best plan on one device type only (the search on a sub-cluster).
``baseline_results`` gives, where a baseline has no plan, the one-line reason instead;
``baseline_entries`` is their JSON form beside a plan (``Plan.baselines``).

Why no plan fits at all (``explain_infeasible``) is ``infeasible.py``.
"""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType

from ..costs import CostModel
from ..errors import InfeasibleError, PoseidonError
from ..plan import Plan
from .build import build_plan
from .configs import OuterConfig
from . import driver   # driver.search_plan looked up at call time (tests spy on it)
from .instance import SearchContext
from .infeasible import held_kinds
from .options import tp_candidates

GIB = 1024 ** 3


# --------------------------------------------------------------------------- baselines

BASELINE_NAMES = ("megatron-default", "best-single-type")


def baseline_plans(cluster, model, options, profiles=None, deadline: float | None = None
                   ) -> dict[str, Plan | None]:
    """The two baselines under ``options`` (a ``SearchOptions``); None where none fits."""
    return {name: got if isinstance(got, Plan) else None
            for name, got in baseline_results(cluster, model, options, profiles,
                                              deadline).items()}


def baseline_results(cluster, model, options, profiles=None, deadline: float | None = None
                     ) -> dict[str, Plan | str]:
    """The two baselines under ``options``: each a Plan, or the one-line reason it has none.
    ``deadline`` (``time.monotonic()``): the even splits stop there once one is timed, the
    single-type searches share the time left; a baseline without a plan by then goes on for
    at most ``options.overrun_s`` more (None: no limit). A baseline cut short says so in its
    plan's ``search["cut"]`` (what was not tried), or its reason starts with ``CUT``."""
    options.check_against(cluster, model)
    ctx = SearchContext(CostModel(cluster, model, profiles, seq_length=options.seq_length,
                                  training=options.training))
    return {"megatron-default": _megatron_default(ctx, options, deadline),
            "best-single-type": _best_single_type(cluster, model, options, profiles, deadline)}


CUT = "cut at the time budget"
"""How a baseline cut short by the deadline names it (its reason, or ``search["cut"]``)."""


def _hard_end(deadline: float | None, options) -> float | None:
    """Until when a baseline without a plan may go on: ``deadline + options.overrun_s``."""
    if deadline is None or options.overrun_s is None:
        return None
    return deadline + options.overrun_s


def _past(t: float | None) -> bool:
    import time

    return t is not None and time.monotonic() > t


def baseline_entries(results: dict[str, Plan | str], plan_ms: float) -> tuple[dict, ...]:
    """The JSON form of ``baseline_results`` beside a plan of ``plan_ms``: per baseline its
    name, status ("ok" or "no plan"), predicted time, pp/dp/tp, schedule, speed-up of the plan
    over it (baseline time / plan time), the reason when it has no plan, and ``cut``: what the
    time budget left untried (None: nothing)."""
    out = []
    for name, got in results.items():
        if isinstance(got, Plan):
            t = got.predicted_iteration_time_ms
            out.append(dict(name=name, status="ok", predicted_iteration_time_ms=t, pp=got.pp,
                            dp=got.dp, tp=got.tp if got.uniform_tp else None,
                            schedule=got.schedule, speedup=t / plan_ms if plan_ms else None,
                            reason=None, cut=got.search.get("cut")))
        else:
            out.append(dict(_empty_entry(name), status="no plan", reason=got))
    return tuple(out)


def skipped_baseline_entries(reason: str = "--no-baselines") -> tuple[dict, ...]:
    """The JSON form of baselines that were not computed."""
    return tuple(dict(_empty_entry(name), status="skipped", reason=reason)
                 for name in BASELINE_NAMES)


def _empty_entry(name: str) -> dict:
    return dict(name=name, status="", predicted_iteration_time_ms=None, pp=None, dp=None,
                tp=None, schedule=None, speedup=None, reason=None, cut=None)


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


def megatron_default_plan(ctx: SearchContext, options, deadline: float | None = None
                          ) -> Plan | None:
    """The fastest even split over every device: TP t (valid on every type), N stages
    dividing the layers, d = devices / (t N), layers L / N per stage, 1F1B."""
    got = _megatron_default(ctx, options, deadline)
    return got if isinstance(got, Plan) else None


class _EvenSplitMisses:
    """How far the even splits got, for the reason when none fits."""

    def __init__(self):
        self.shapes: list[tuple[int, int, int]] = []      # (tp, pp, dp) dividing everything
        self.placed: list[tuple[int, int, int]] = []      # ... whose stages fit the type pools
        self.closest = None     # (shortfall bytes, tp, pp, dp, b, stage, type, memory)

    def memory(self, cm, t, n, d, b, types, mems) -> None:
        x = max(range(n), key=lambda x: mems[x] - cm.capacity_bytes[types[x]])
        short = mems[x] - cm.capacity_bytes[types[x]]
        if self.closest is None or short < self.closest[0]:
            self.closest = (short, t, n, d, b, x, types[x], mems[x])

    def reason(self, cm, tps: list[int], total: int, options) -> str:
        L, G = cm.model.num_layers, options.global_batch_size
        if not tps:
            return ("no TP degree is valid on every device type (a power of two dividing every "
                    "node's devices and the attention heads" + (
                        f", among --tp {' '.join(map(str, options.tp_degrees))}"
                        if options.tp_degrees else "") + ")")
        if not self.shapes:
            return (f"no pipeline depth divides the {L} layers with the {total} devices a "
                    f"multiple of TP x PP (TP {', '.join(map(str, tps))})")
        if not self.placed:
            deepest = sorted(self.shapes, key=lambda x: (-x[1], x[0]))[:3]
            pools = ", ".join(f"{name} {p.size}" for name, p in zip(cm.type_names, cm.pools))
            return ("no even split over all devices puts each stage's TP x DP devices on one "
                    f"device type (devices per type: {pools}; deepest splits: "
                    + ", ".join(f"pp={n} tp={t} dp={d} ({t * d} devices a stage)"
                                for t, n, d in deepest) + ")")
        if self.closest is None:
            dps = sorted({d for _, _, d in self.placed})
            return (f"the global batch {G} is not a multiple of DP x micro-batch size for any "
                    f"even split over all {total} devices (DP {', '.join(map(str, dps))}; "
                    f"micro-batch sizes {' '.join(map(str, options.micro_batch_sizes))})")
        short, t, n, d, b, x, k, mem = self.closest
        return (f"no even split fits in device memory: the closest (pp={n}, tp={t}, dp={d}, "
                f"micro-batch {b}) lacks {short / GIB:.2f} GiB on stage {x} ({cm.type_names[k]}:"
                f" needs {mem / GIB:.2f} GiB of {cm.capacity_bytes[k] / GIB:.2f} GiB)")


def _megatron_default(ctx: SearchContext, options, deadline: float | None = None
                      ) -> Plan | str:
    """``megatron_default_plan``, or the reason no even split fits. Past ``deadline`` no
    further even split is timed once one is (the plan says how many were not); without one
    the splits go on until ``_hard_end``, then the reason is ``CUT``."""
    cm, model = ctx.cm, ctx.cm.model
    total = sum(p.size for p in cm.pools)
    L, G = model.num_layers, options.global_batch_size
    tps_all = sorted(set.intersection(*[
        set(tp_candidates(cm.cluster, model, n, options.tp_degrees)) for n in cm.type_names]))
    cands, misses = [], _EvenSplitMisses()
    hard, untimed = _hard_end(deadline, options), 0
    for t in tps_all:
        for n in (n for n in range(1, L + 1) if L % n == 0 and total % (t * n) == 0):
            d = total // (t * n)
            misses.shapes.append((t, n, d))
            types = _even_split_types(ctx, n, d * t)
            if types is None:
                continue
            misses.placed.append((t, n, d))
            for b in (b for b in options.micro_batch_sizes if G % (d * b) == 0):
                if (cands and _past(deadline)) or _past(hard):
                    untimed += 1
                    continue
                m = G // (d * b)
                opts = tuple(sorted({(k, t) for k in types}))
                cfg = OuterConfig("1f1b", 1, b, d, m, n, t, opts)
                layers = [L // n] * n
                mems = [cm.stage_memory_bytes(
                    layers=layers[x], stage=x, num_stages=n, tp=t, dp=d, micro_batch_size=b,
                    num_microbatches=m, schedule="1f1b", virtual_stages=1,
                    type_index=types[x], kind_counts=held_kinds(cm, layers, x)) for x in range(n)]
                if all(mems[x] <= cm.capacity_bytes[types[x]] for x in range(n)):
                    so = [opts.index((k, t)) for k in types]
                    cands.append((ctx.evaluate(cfg, so, layers), cfg.key, cfg, so, layers))
                else:
                    misses.memory(cm, t, n, d, b, types, mems)
    if not cands:
        if untimed:
            return f"{CUT} ({untimed} even splits not timed)"
        return misses.reason(cm, tps_all, total, options)
    tt, _, cfg, so, layers = min(cands, key=lambda c: c[:2])
    stats = {"baseline": "megatron-default"}
    if untimed:
        stats["cut"] = f"{untimed} of {untimed + len(cands)} even splits not timed"
    return build_plan(cm, cfg, so, layers, global_batch_size=G, predicted_ms=tt,
                      search_stats=stats)


def best_single_type_plan(cluster, model, options, profiles=None,
                          deadline: float | None = None) -> Plan | None:
    """The best plan of the search restricted to one device type (the fastest type wins);
    with a ``deadline`` each type's search gets an equal share of the time left."""
    got = _best_single_type(cluster, model, options, profiles, deadline)
    return got if isinstance(got, Plan) else None


def _best_single_type(cluster, model, options, profiles=None, deadline: float | None = None
                      ) -> Plan | str:
    """``best_single_type_plan``, or why no type has a plan (each type's one-line error)."""
    import time

    best, why, cut = None, [], []
    names = list(cluster.type_names)
    hard = _hard_end(deadline, options)
    for at, name in enumerate(names):
        if (best is not None and _past(deadline)) or _past(hard):
            cut.append(name)             # not searched: the time budget is spent
            continue
        opts = options.replace(runner_up=False, tie_tolerance=0.0, first_plan_overrun=False)
        if deadline is not None:
            left = max(0.05, (deadline - time.monotonic()) / (len(names) - at))
            opts = opts.replace(time_budget_s=left)
        try:
            p = driver.search_plan(single_type_cluster(cluster, name), model, opts, profiles)
        except (InfeasibleError, PoseidonError) as exc:
            why.append(f"{name}: {' '.join(str(exc).split())}")
            continue
        if best is None or p.predicted_iteration_time_ms < best.predicted_iteration_time_ms:
            best = p
    if best is None:
        if cut:
            return f"{CUT} ({', '.join(cut)} not searched" + (
                f"; {'; '.join(why)})" if why else ")")
        return "no device type has a plan on its own: " + "; ".join(why)
    if cut:
        best = replace(best, search=dict(best.search, cut=f"{', '.join(cut)} not searched"))
    return best


def single_type_cluster(cluster, name: str):
    """The sub-cluster of one device type's nodes (re-indexed; named ``cluster[type]``)."""
    nodes = tuple(n for n in cluster.nodes if n.device_type == name)
    renum = tuple(replace(n, index=i) for i, n in enumerate(nodes))
    return replace(cluster, name=f"{cluster.name}[{name}]", nodes=renum,
                   device_types=MappingProxyType({name: cluster.device_types[name]}),
                   links=replace(cluster.links, inter_node_gbps=MappingProxyType(
                       {name: cluster.links.inter_node_gbps[name]})))
