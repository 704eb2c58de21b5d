"""Search at frontier scale: time to the first plan, the gap to the proven bound at the budget,
and peak memory, per case; printed as Markdown.

Run: ``.venv/bin/python benchmarks/bench_scale.py [--cases 405b-512 ...] [--budget S]``.

Cases: LLaMA-3 405B (``llama3-405b``, global batch 1024, sequence 4096) on the 512 / 1024 /
2048 / 4096-device clusters of four GPU generations in ``examples/clusters/scale-*.yaml``, and
LLaMA-3 70B on the 4096-device one, and 405B on the memory-tight 2048-device cluster
``benchmarks/clusters/memtight-2048.yaml`` (``405b-memtight-2048``); ``close-4096`` /
``close-1024``: 405B on 4,096 / 1,024 devices of four types within 20 % of each other's speed
(``examples/clusters/close-4096.yaml``, and the same shape with a quarter of the nodes), where
the lower bound is the hard part; the MoE rows: DeepSeek-V3 (``deepseek-v3``) on 1,024 and
2,048 devices and Qwen3-235B-A22B on 512, each of three GPU types
(``examples/clusters/moe-3type-*.yaml``), expert parallelism searched. Each case runs in its
own process (so ``max RSS`` is the
case's own) with ``--budget`` seconds (default 120). Columns: ``first plan s`` = when the first
feasible plan was known (the constructive plans come first); ``plan ms`` = the returned plan's
predicted iteration time; ``bound ms`` / ``gap`` = the proven lower bound over the whole space
and (plan - bound) / plan; ``exhaustive`` = the search finished (the gap is then 0);
``gap at 5/10/30/60/120 s`` = the live gap (the driver's anytime bound and incumbent) at
those times, as the driver's last tick before them left it (the bound and the incumbent move
only there; ``-`` past the budget, or before the first plan; the final gap once the search
ended). The times are the process's clock: under ``LD_PRELOAD=benchmarks/cpuclock.so`` (built
from ``benchmarks/cpuclock.c``, see there) that is its CPU time, budget included, so with
``--workers 1`` a loaded machine measures what one idle core would do.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

CASES = {f"405b-{n}": (f"scale-{n}", "llama3-405b", 1024) for n in (512, 1024, 2048, 4096)}
CASES["70b-4096"] = ("scale-4096", "llama3-70b", 1024)
CASES["70b-10240"] = ("scale-10240", "llama3-70b", 1024)
# memory-tight: 405B on 2,048 devices of 80 / 40 / 32 / 24 GiB (most configurations cannot hold it)
CASES["405b-memtight-2048"] = ("benchmarks/clusters/memtight-2048", "llama3-405b", 1024)
# close-matched: four types within 20 % of each other's speed (issue 30)
CASES["close-4096"] = ("close-4096", "llama3-405b", 1024)
CASES["close-1024"] = ("close-1024", "llama3-405b", 1024)
# the MoE frontier rows (issue 29): expert parallelism searched, on three GPU types
CASES["dsv3-1024"] = ("moe-3type-1024", "deepseek-v3", 1024)
CASES["dsv3-2048"] = ("moe-3type-2048", "deepseek-v3", 1024)
CASES["qwen3-235b-512"] = ("moe-3type-512", "qwen3-235b-a22b", 1024)
TRAJECTORY_S = (5, 10, 30, 60, 120)
SAMPLE_S = 0.05   # the trajectory's sampling: a tick's gap at most this often (and at each
                  # improvement); every tick's took 5.4 s of memtight-2048's first 6 s (13,946
                  # configurations, a tick per configuration the construction tries)
COLUMNS = ("case", "devices", "configs", "first plan s", "search s", "plan ms", "bound ms", "gap",
           "exhaustive", "plan", "max RSS MB",
           "gap at " + "/".join(str(t) for t in TRAJECTORY_S) + " s")


def run_one(case: str, budget: float, workers: int | None) -> dict:
    from poseidon_plugin.cluster import load_cluster
    from poseidon_plugin.errors import PoseidonError
    from poseidon_plugin.model import get_model

    from poseidon_plugin.search import SearchOptions
    from poseidon_plugin.search.driver import SearchDriver

    cfile, mname, gbs = CASES[case]
    cluster = load_cluster(os.path.join(ROOT, *(() if "/" in cfile else ("examples", "clusters")),
                                        cfile + ".yaml"))
    t0 = time.perf_counter()
    driver = SearchDriver(cluster, get_model(mname), SearchOptions(
        global_batch_size=gbs, seq_length=4096, time_budget_s=budget, workers=workers))
    seen: list[tuple[float, float | None]] = []   # (seconds, live gap) at each change
    tick = driver.tick

    last = [-1.0]

    def record(improved: bool = False) -> None:   # the gap moves only at the driver's ticks
        tick(improved=improved)
        now = time.perf_counter() - t0
        if improved or now - last[0] >= SAMPLE_S:   # (a snapshot is O(configurations): one
            last[0] = now                            # per tick cost the search seconds)
            seen.append((now, driver.snapshot().gap))

    driver.tick = record
    try:
        driver.search()
        p = driver.plan()
    except PoseidonError as exc:
        return dict(case=case, devices=cluster.total_devices, error=str(exc),
                    seconds=time.perf_counter() - t0)
    ended = time.perf_counter() - t0
    s = p.search
    holding = []      # the lowest proven bounds (most nodes first): what holds the gap
    for i in sorted(range(len(driver.configs)),
                    key=lambda i: (driver.lbs[i], -driver.work.get(i, 0)))[:4]:
        c = driver.configs[i]
        f = driver.found.get(c)
        holding.append(dict(config=f"{c.schedule} V={c.virtual_stages} pp={c.num_stages} "
                                   f"dp={c.dp} tp={c.tp} "
                                   + (f"cp={c.cp} " if c.cp > 1 else "")
                                   + (f"ep={c.ep} " if c.ep > 1 else "")
                                   + f"b={c.micro_batch_size}",
                            root_ms=driver.roots[i], proven_ms=driver.lbs[i],
                            found_ms=None if f is None else f.time_ms,
                            nodes=driver.work.get(i, 0)))
    traj = []
    for at in TRAJECTORY_S:
        g = None
        if at <= budget:
            g = p.gap if at >= ended else next((g for t, g in reversed(seen) if t <= at), None)
        traj.append(None if g is None else round(g, 5))
    shape = (f"{p.schedule}{'' if p.virtual_stages == 1 else f' V={p.virtual_stages}'} "
             f"pp={p.pp} dp={p.dp} tp={p.tp if p.uniform_tp else 'per-stage'} "
             + (f"ep={p.ep} " if p.moe else "") + f"b={p.micro_batch_size}")
    return dict(case=case, devices=cluster.total_devices, configs=s["configs"],
                first_plan_s=s["first_plan_s"], seconds=s["seconds"],
                plan_ms=p.predicted_iteration_time_ms, bound_ms=p.lower_bound_ms, gap=p.gap,
                exhaustive=s["exhaustive"], plan=shape, nodes=s["nodes"], trajectory=traj,
                holding=holding,
                max_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def row(r: dict) -> list[str]:
    if "error" in r:
        return [r["case"], str(r["devices"]), "", "", f"{r['seconds']:.1f}",
                f"error: {' '.join(r['error'].split())}", "", "", "", "", "", ""]
    return [r["case"], f"{r['devices']:,}", f"{r['configs']:,}", f"{r['first_plan_s']:.1f}",
            f"{r['seconds']:.1f}", f"{r['plan_ms']:,.0f}", f"{r['bound_ms']:,.0f}",
            f"{100 * r['gap']:.2f}%", "yes" if r["exhaustive"] else "no", r["plan"],
            f"{r['max_rss_mb']:.0f}",
            " / ".join("-" if g is None else f"{100 * g:.2f}%" for g in r["trajectory"])]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--budget", type=float, default=120.0, help="search budget per case (s)")
    p.add_argument("--workers", type=int, default=None, help="default: one per core")
    p.add_argument("--one", help=argparse.SUPPRESS)   # internal: run one case, print JSON
    ns = p.parse_args(argv)
    if ns.one:
        print(json.dumps(run_one(ns.one, ns.budget, ns.workers)))
        return 0
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _machine import cpu_model

    print(f"Machine: {cpu_model()}, {os.cpu_count()} cores, Python "
          f"{platform.python_version()}; budget {ns.budget:g} s per case, workers "
          f"{ns.workers or os.cpu_count()}.\n")
    rows, raw = [], []
    for c in ns.cases:
        print(f"bench_scale: {c} ...", file=sys.stderr, flush=True)
        cmd = [sys.executable, os.path.abspath(__file__), "--one", c, "--budget", str(ns.budget)]
        if ns.workers:
            cmd += ["--workers", str(ns.workers)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        raw.append(json.loads(out.strip().splitlines()[-1]))
        rows.append(row(raw[-1]))
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "|".join("---" if c in ("case", "plan", "exhaustive") or c.startswith("gap at")
                         else "---:"
                         for c in COLUMNS) + "|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    print("\nPer case, the configurations with the lowest proven bound (what holds the gap): "
          "root bound, proven bound, best plan found for it, nodes of its last search.\n")
    for r in raw:
        for h in r.get("holding", []):
            found = "-" if h["found_ms"] is None else f"{h['found_ms']:,.1f}"
            print(f"- {r['case']}: {h['config']}: root {h['root_ms']:,.1f}, proven "
                  f"{h['proven_ms']:,.1f}, found {found} ms, {h['nodes']:,} nodes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
