"""How long a time-limited search takes against its ``--time-budget``; printed as Markdown.

Run: ``.venv/bin/python benchmarks/bench_budget.py [--budgets 0.5 2 5] [--repeats 3]``.

The wall-time claims the tests no longer assert (a test asserts behaviour; a loaded CI host
missed these margins): ``search_plan`` on paper setting 6 (LLaMA-3 70B on 288 devices) with a
budget of ``B`` s, runner-up included, in this process after one warm-up search. Columns:
``budget`` = ``time_budget_s``, ``wall s`` = the median wall time of ``search_plan`` (loading
excluded), ``over s`` = wall - budget (the start-up work before the deadline is set and the
first-plan overrun), ``runner-up`` = its status. The tests check that every runner-up and
layout query gets a deadline no later than the search's (tests/test_runner_up.py) and that the
CLI's baselines and search share one budget (tests/test_search_progress.py), not these times.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def main() -> None:
    from _machine import cpu_model
    from poseidon_plugin.cluster import load_cluster
    from poseidon_plugin.model import get_model
    from poseidon_plugin.search import SearchOptions, search_plan

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.5, 2.0, 5.0])
    ap.add_argument("--repeats", type=int, default=3)
    ns = ap.parse_args()
    cluster = load_cluster(os.path.join(ROOT, "examples", "clusters", "paper-setting6.yaml"))
    model = get_model("llama3-70b")
    opts = lambda b: SearchOptions(global_batch_size=128, seq_length=4096, time_budget_s=b,
                                   workers=1)
    search_plan(cluster, model, opts(0.2))                  # warm-up (imports, first caches)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"CPU: {cpu_model()}, {os.cpu_count()} cores, load average {load:.1f} at start\n")
    print("| budget s | wall s (median) | over s | runner-up |")
    print("|---:|---:|---:|---|")
    for b in ns.budgets:
        walls, status = [], set()
        for _ in range(ns.repeats):
            t0 = time.monotonic()
            plan = search_plan(cluster, model, opts(b))
            walls.append(time.monotonic() - t0)
            status.add(plan.search["runner_up_status"])
        w = statistics.median(walls)
        print(f"| {b:g} | {w:.2f} | {w - b:+.2f} | {', '.join(sorted(status))} |")


if __name__ == "__main__":
    main()
