"""Search wall time, plans simulated and branches cut, per paper setting; printed as Markdown.

Run: ``.venv/bin/python benchmarks/bench_search.py [--cases 1 2 6-96] [--max-seconds S]``.

Rows: the paper's settings 1-5 (``examples/clusters/paper-setting{1..5}.yaml`` with the paper's
models) and LLaMA-3 70B on 96 / 192 / 288 NPUs (``paper-setting6-96``, ``-192`` and
``paper-setting6``, the paper's setting 6). The paper's own search times for the 70B rows
(Table "search time ... varying scales": 26.0 s, 47.8 s, 75.8 s) are printed beside ours; the
paper gives settings 1-5 only as a bar chart, so those cells are empty. The paper's machine, batch
and sequence length are not stated; ours are printed above the table.

Columns: ``search s`` = wall time of ``search_plan`` (warm-up sampling included, baselines
excluded); ``exhaustive`` = ``yes``, or ``not exhaustive`` when ``--max-seconds`` (passed as
``time_budget_s``) stopped the search; the counters come from ``plan.search``: outer
configurations (and how many were cut at the root by their bound), search-tree nodes, plans
simulated, and branches cut by each rule (stage-level bound, memory, ridge-like layer rule,
device count). ``iter ms`` = the plan's predicted iteration time; ``runner-up`` = the fastest plan of
any other configuration and its margin over the plan, ``other layout`` = the margin of the
fastest plan of the same configuration with another device type on some stage
(``search/runnerup.py``; their time, ``runner-up s``, is part of ``search s``); ``vs megatron`` / ``vs single``
= speed-up over the two baselines of ``search.baseline_plans`` (Megatron's even split on all
devices; the best plan on one device type), ``n/a`` when the baseline has no feasible plan. The
baselines get the same ``--max-seconds`` budget.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from poseidon_plugin.cluster import load_cluster  # noqa: E402
from poseidon_plugin.errors import PoseidonError  # noqa: E402
from poseidon_plugin.model import get_model  # noqa: E402
from poseidon_plugin.search import SearchOptions, baseline_plans, search_plan  # noqa: E402
from _machine import cpu_model  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

# case -> (cluster file stem, model preset, the paper's Poseidon search time in s or None)
CASES: dict[str, tuple[str, str, float | None]] = {
    "1": ("paper-setting1", "llama3-8b", None),
    "2": ("paper-setting2", "llama2-13b", None),
    "3": ("paper-setting3", "llama-30b", None),
    "4": ("paper-setting4", "mixtral-8x7b", None),
    "5": ("paper-setting5", "llama2-13b", None),
    "6-96": ("paper-setting6-96", "llama3-70b", 26.0),
    "6-192": ("paper-setting6-192", "llama3-70b", 47.8),
    "6-288": ("paper-setting6", "llama3-70b", 75.8),
}
ALIASES = {"6": "6-288"}

COLUMNS = ("case", "model", "devices", "search s", "paper s", "exhaustive", "configs (root-cut)",
           "nodes", "plans simulated", "cut bound", "cut memory", "cut ridge", "cut devices",
           "plan", "iter ms", "runner-up", "other layout", "runner-up s", "vs megatron", "vs single")




def cores() -> str:
    n = os.cpu_count() or 1
    try:
        avail = len(os.sched_getaffinity(0))
    except AttributeError:
        avail = n
    return f"{avail}" if avail == n else f"{avail} of {n}"


def _int(x) -> str:
    return f"{int(x):,}"


def run_case(case: str, ns) -> list[str]:
    cfile, mname, paper_s = CASES[case]
    cluster = load_cluster(os.path.join(ROOT, "examples", "clusters", cfile + ".yaml"))
    model = get_model(mname)
    common = dict(global_batch_size=ns.global_batch_size, seq_length=ns.seq_length,
                  time_budget_s=ns.max_seconds, workers=ns.workers)
    t0 = time.perf_counter()
    try:
        plan = search_plan(cluster, model, SearchOptions(pruning=ns.pruning, tp_mode=ns.tp_mode,
                                                         **common))
    except PoseidonError as exc:
        wall = time.perf_counter() - t0
        msg = " ".join(str(exc).split())
        return [case, mname, str(cluster.total_devices), f"{wall:.1f}",
                "" if paper_s is None else f"{paper_s:.1f}", f"error: {msg}"] + [""] * 14
    wall = time.perf_counter() - t0
    s = plan.search
    shape = _shape(plan.schedule, plan.virtual_stages, plan.pp, plan.dp,
                   plan.tp if plan.uniform_tp else None, plan.micro_batch_size)
    t = plan.predicted_iteration_time_ms
    speed = {"megatron-default": "skipped", "best-single-type": "skipped"}
    if not ns.no_baselines:
        base = baseline_plans(cluster, model, SearchOptions(**common))
        for name, bp in base.items():
            speed[name] = "n/a" if bp is None else f"x{bp.predicted_iteration_time_ms / t:.2f}"
    exhaustive = ("yes" if s.get("exhaustive") else
                  f"no (gap {100 * plan.gap:.1f} %, bound {plan.lower_bound_ms:.1f} ms)")
    return [case, mname, str(cluster.total_devices), f"{wall:.1f}",
            "" if paper_s is None else f"{paper_s:.1f}", exhaustive,
            f"{_int(s.get('configs', 0))} ({_int(s.get('configs_cut_root', 0))})",
            _int(s.get("nodes", 0)), _int(s.get("plans_simulated", 0)),
            _int(s.get("cut_bound", 0)), _int(s.get("cut_memory", 0)),
            _int(s.get("cut_ridge", 0)), _int(s.get("cut_devices", 0)),
            shape, f"{t:.1f}", _runner_up(s), _layout(s), f"{s.get('runner_up_s', 0):.2f}",
            speed["megatron-default"], speed["best-single-type"]]


def _shape(schedule: str, v: int, pp: int, dp: int, tp: int | None, b: int) -> str:
    """A configuration as the plan column writes it (tp None: per-stage)."""
    return (f"{schedule}{'' if v == 1 else f' V={v}'} pp={pp} dp={dp} "
            f"tp={tp if tp is not None else 'per-stage'} b={b}")


def _layout(s: dict) -> str:
    """The other-layout cell: its margin, or its state."""
    state = s.get("layout_status", "off")
    if s.get("layout_margin") is None:
        return state
    return f"{100 * s['layout_margin']:+.2f} %" + ("" if state == "exact" else f" ({state})")


def _runner_up(s: dict) -> str:
    """The runner-up cell: its configuration and margin, or its state."""
    r, state = s.get("runner_up"), s.get("runner_up_status", "off")
    if not r or state == "none":
        return state
    shape = _shape(r["schedule"], r["virtual_stages"], r["pp"], r["dp"], r["tp"],
                   r["micro_batch_size"])
    margin = f"{100 * s['runner_up_margin']:+.2f} %"
    return f"{shape} {margin}" + ("" if state == "exact" else f" ({state})")


def markdown(rows: list[list[str]]) -> str:
    head = "| " + " | ".join(COLUMNS) + " |"
    sep = "|" + "|".join("---" if c in ("case", "model", "plan", "exhaustive") else "---:"
                         for c in COLUMNS) + "|"
    return "\n".join([head, sep] + ["| " + " | ".join(r) + " |" for r in rows])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", nargs="+", default=list(CASES),
                   help=f"rows to run (default all): {' '.join(CASES)} (6 = 6-288)")
    p.add_argument("--max-seconds", type=float, default=None, metavar="S",
                   help="per-case search budget (time_budget_s); rows it stops are marked "
                        "'not exhaustive'")
    p.add_argument("--global-batch-size", type=int, default=128)
    p.add_argument("--seq-length", type=int, default=4096)
    p.add_argument("--workers", type=int, default=None, help="default: one per core")
    p.add_argument("--pruning", choices=["safe", "ridge", "none"], default="safe")
    p.add_argument("--no-baselines", action="store_true", help="skip the speed-up columns")
    p.add_argument("--per-stage-tp", dest="tp_mode", action="store_const", const="per-stage",
                   default="uniform", help="search a TP degree per stage (default: uniform)")
    ns = p.parse_args(argv)
    cases = []
    for c in ns.cases:
        c = ALIASES.get(c, c)
        if c not in CASES:
            p.error(f"--cases: unknown case {c!r}; expected some of {' '.join(CASES)}")
        cases.append(c)
    if ns.max_seconds is not None and ns.max_seconds <= 0:
        p.error("--max-seconds: expected a number > 0")

    print(f"Machine: {cpu_model()}, {cores()} cores, Python {platform.python_version()}; "
          f"global batch {ns.global_batch_size}, sequence {ns.seq_length}, "
          f"workers {ns.workers or os.cpu_count()}, pruning {ns.pruning}, per-case budget "
          f"{'none' if ns.max_seconds is None else f'{ns.max_seconds:g} s'}.")
    print()
    rows = []
    for c in cases:
        print(f"bench_search: case {c} ...", file=sys.stderr, flush=True)
        rows.append(run_case(c, ns))
        print(f"bench_search: case {c}: {rows[-1][3]} s, {rows[-1][5]}", file=sys.stderr,
              flush=True)
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
