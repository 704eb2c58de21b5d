"""How long a time-limited search takes against its ``--time-budget``; printed as Markdown.

Run: ``.venv/bin/python benchmarks/bench_budget.py [--budgets 0.5 2 5] [--repeats 3]``;
``--cli [--cli-budget 10]``: the whole ``poseidon plan`` run instead (see ``CLI_ROWS``).

The wall-time claims the tests no longer assert (a test asserts behaviour; a loaded CI host
missed these margins): ``search_plan`` on paper setting 6 (LLaMA-3 70B on 288 devices) with a
budget of ``B`` s, runner-up included, in this process after one warm-up search. Columns:
``budget`` = ``time_budget_s``, ``wall s`` = the median wall time of ``search_plan`` (loading
excluded), ``over s`` = wall - budget (the start-up work before the deadline is set and the
first-plan overrun), ``runner-up`` = its status. The tests check that every runner-up and
layout query gets a deadline no later than the search's (tests/test_runner_up.py) and that the
CLI's baselines and search share one budget (tests/test_search_progress.py), not these times.

``--cli``: the whole ``poseidon plan`` command (Python's start, loading, baselines, search,
runner-up, output) as a subprocess per row of ``CLI_ROWS``: the huge global batch of issue 30
(paper setting 1, 8B, global batch 131,072: M up to 131,072 micro-batches) and the memory-tight
405B cluster. Columns: wall s (the process, Python's start and imports included), ``over s`` =
wall - budget, ``after end s`` = the wall time from the budget's end (it starts after parsing)
to the exit (the target: <= 1 s), the child's CPU seconds, those it used after the budget's end,
its peak RSS, and ``uptime``'s load before and after (the shared 2-core host's other work shows
in wall, not in CPU).
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


CLI_ROWS = (
    ("huge-M", ["--cluster", "examples/clusters/paper-setting1.yaml", "--model", "llama3-8b",
                "--global-batch-size", "131072", "--seq-length", "4096", "--workers", "1"]),
    ("memtight-2048", ["--cluster", "benchmarks/clusters/memtight-2048.yaml", "--model",
                       "llama3-405b", "--global-batch-size", "1024", "--seq-length", "4096",
                       "--workers", "1"]),
)


def _load() -> str:
    import subprocess

    try:
        out = subprocess.run(["uptime"], capture_output=True, text=True, timeout=10).stdout
        return out.split("load average:")[1].strip().split(",")[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        return "n/a"


def cli_rows(budget: float, repeats: int) -> None:
    """The whole CLI run per ``CLI_ROWS`` row (see the module docstring)."""
    import subprocess

    from _machine import cpu_model

    print(f"CPU: {cpu_model()}, {os.cpu_count()} cores\n")
    print("| case | budget s | wall s | over s | after end s | CPU s | CPU after end s | "
          "peak RSS MB | load before / after |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    env = dict(os.environ, PYTHONPATH=ROOT)
    for name, args in CLI_ROWS:
        for _ in range(repeats):
            before = _load()
            t0 = time.monotonic()
            p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", "plan",
                                  *args, "--time-budget", str(budget)], cwd=ROOT, env=env,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            err = p.stderr.read()
            after = next((x.split()[1:] for x in err.splitlines()
                          if x.startswith("BENCH-AFTER-END ")), ["nan", "nan"])
            _, status, ru = os.wait4(p.pid, 0)       # this child's own CPU and peak RSS
            wall = time.monotonic() - t0
            p.returncode = os.waitstatus_to_exitcode(status)
            if p.returncode != 0:
                print(f"| {name} | {budget:g} | failed: {err.strip()[-200:]} |")
                continue
            cpu = ru.ru_utime + ru.ru_stime
            print(f"| {name} | {budget:g} | {wall:.2f} | {wall - budget:+.2f} | "
                  f"{float(after[0]):+.2f} | {cpu:.2f} | {float(after[1]):.2f} | "
                  f"{ru.ru_maxrss / 1024:.0f} | {before} / {_load()} |", flush=True)


def _child(argv: list[str]) -> int:
    """``poseidon plan argv`` in this process, then on stderr ``BENCH-AFTER-END wall cpu``:
    the wall seconds from the budget's end (``cli._Budget.end``) to the exit, and the CPU
    seconds this process used after that end (a timer thread reads the CPU clock there)."""
    import threading

    from poseidon_plugin import cli

    got: dict = {}
    init = cli._Budget.__init__

    def budget_init(self, *a, **k):
        init(self, *a, **k)
        got["end"] = self.end
        if self.end is not None:
            t = threading.Timer(max(0.0, self.end - time.monotonic()),
                                lambda: got.setdefault("cpu", time.process_time()))
            t.daemon = True
            t.start()

    cli._Budget.__init__ = budget_init
    rc = cli.main(argv)
    wall, cpu = time.monotonic(), time.process_time()
    if got.get("end") is not None:
        sys.stderr.write(f"BENCH-AFTER-END {wall - got['end']:.3f} "
                         f"{cpu - got.get('cpu', cpu):.3f}\n")
    return rc


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        sys.exit(_child(sys.argv[2:]))
    if "--cli" in sys.argv:
        ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
        ap.add_argument("--cli", action="store_true")
        ap.add_argument("--cli-budget", type=float, default=10.0)
        ap.add_argument("--repeats", type=int, default=1)
        ns = ap.parse_args()
        cli_rows(ns.cli_budget, ns.repeats)
        return
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
