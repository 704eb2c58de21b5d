"""The distributed search's speed-up: one search shared by P processes on this machine
(``search/distributed.py``), per case and P; printed as Markdown.

Run: ``.venv/bin/python benchmarks/bench_distributed.py --processes 1 2 4 8 16
[--cases 6-288 405b-512] [--budget S] [--workers-per-process K] [--transport tcp|manager]``.

Each P runs in fresh processes: P = 1 is the plain ``search_plan`` (no distributed code);
P > 1 starts P processes, searcher 0 coordinates. Every process gets ``--workers-per-process``
search threads (default: the cores / P, at least 1), so each row uses the whole machine.
Transport ``tcp`` (default): a torch.distributed TCPStore, what ``poseidon plan --distributed``
and a launch use; ``manager``: a multiprocessing manager's dict (no torch needed).

Cases: the paper settings of ``bench_search.py`` (global batch 128, sequence 4096) and the
frontier clusters of ``bench_scale.py`` (global batch 1024, sequence 4096). Columns:
``wall s`` = the search's wall time on searcher 0 (from when every process is up), ``nodes`` =
search-tree nodes of every searcher, ``plan ms`` / ``bound ms`` = the plan's predicted time and
the proven lower bound, ``exhaustive`` = the search ended (not the budget), ``speed-up`` = the
P = 1 row's wall time / this row's (same case). The runner-up is off (it runs on searcher 0
alone).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import socket
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))
for p in (ROOT, HERE):
    if p not in sys.path:
        sys.path.insert(0, p)

from _machine import cpu_model  # noqa: E402

# case -> (cluster file stem, model, global batch)
CASES = {
    "1": ("paper-setting1", "llama3-8b", 128),
    "2": ("paper-setting2", "llama2-13b", 128),
    "3": ("paper-setting3", "llama-30b", 128),
    "5": ("paper-setting5", "llama2-13b", 128),
    "6-96": ("paper-setting6-96", "llama3-70b", 128),
    "6-288": ("paper-setting6", "llama3-70b", 128),
    "405b-512": ("scale-512", "llama3-405b", 1024),
    "405b-1024": ("scale-1024", "llama3-405b", 1024),
    "405b-4096": ("scale-4096", "llama3-405b", 1024),
    "70b-4096": ("scale-4096", "llama3-70b", 1024),
}
COLUMNS = ("case", "processes", "threads each", "wall s", "speed-up", "nodes", "plan ms",
           "bound ms", "exhaustive", "plan")


def _inputs(case: str, budget: float | None, workers: int):
    from poseidon_plugin.cluster import load_cluster
    from poseidon_plugin.model import get_model
    from poseidon_plugin.search import SearchOptions

    cfile, mname, gbs = CASES[case]
    cluster = load_cluster(os.path.join(ROOT, "examples", "clusters", cfile + ".yaml"))
    opts = SearchOptions(global_batch_size=gbs, seq_length=4096, time_budget_s=budget,
                         workers=workers, runner_up=False)
    return cluster, get_model(mname), opts


def _summary(plan, wall: float) -> dict:
    s = plan.search
    shape = (f"{plan.schedule}{'' if plan.virtual_stages == 1 else f' V={plan.virtual_stages}'} "
             f"pp={plan.pp} dp={plan.dp} tp={plan.tp if plan.uniform_tp else 'per-stage'} "
             f"b={plan.micro_batch_size}")
    return dict(wall=wall, nodes=s["nodes"], plan_ms=plan.predicted_iteration_time_ms,
                bound_ms=plan.lower_bound_ms, exhaustive=s["exhaustive"], plan=shape,
                stages=[(st.device_type, st.layers) for st in plan.stages])


def _store(transport: str, rank: int, size: int, addr):
    from poseidon_plugin.search.distributed import MemoryStore  # noqa: F401  (the protocol)

    if transport == "manager":
        return _ManagerStore(addr)
    import datetime

    import torch.distributed as dist

    from poseidon_plugin.megatron.launch.search_transport import TorchStore

    host, port = addr
    store = dist.TCPStore(host, port, size, rank == 0, timeout=datetime.timedelta(seconds=300),
                          wait_for_workers=False)
    return TorchStore(store, "bench/")


class _ManagerStore:
    def __init__(self, addr) -> None:
        self.d, self.lock = addr

    def set(self, key: str, value: bytes) -> None:
        self.d[key] = bytes(value)

    def get(self, key: str):
        return self.d.get(key)

    def add(self, key: str, amount: int) -> int:
        with self.lock:
            v = int(self.d.get(key, b"0")) + amount
            self.d[key] = str(v).encode()
            return v


def _log(rank: int) -> None:
    if os.environ.get("BENCH_LOG"):     # BENCH_LOG=1: the search's debug lines, per process
        import logging
        logging.basicConfig(level=logging.DEBUG, format=f"%(relativeCreated)7.0f ms [{rank}] "
                            "%(message)s")


def _searcher(rank: int, size: int, case: str, budget, workers: int, transport: str, addr,
              results) -> None:
    from poseidon_plugin.search.distributed import Searchers

    _log(rank)
    store = _store(transport, rank, size, addr)
    with Searchers(store, rank, size, workers=workers) as g:
        store.set(f"ready/{rank}", b"1")     # imported and connected
        if rank != 0:
            g.serve()
            store.set(f"done/{rank}", b"1")
            return
        cluster, model, opts = _inputs(case, budget, workers)
        for r in range(1, size):     # the clock starts when every process is up (as in a launch)
            g.wait_for(f"ready/{r}", time.monotonic() + 300)
        t0 = time.perf_counter()
        plan = g.search(cluster, model, opts)
        results.put(_summary(plan, time.perf_counter() - t0))
    for r in range(1, size):      # (rank 0 hosts the TCP store: the others leave first)
        g.wait_for(f"done/{r}", time.monotonic() + 60)


def _single(case: str, budget, workers: int, results) -> None:
    from poseidon_plugin.search import search_plan

    _log(0)
    cluster, model, opts = _inputs(case, budget, workers)
    t0 = time.perf_counter()
    plan = search_plan(cluster, model, opts)
    results.put(_summary(plan, time.perf_counter() - t0))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(case: str, size: int, budget, workers: int, transport: str) -> dict:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    manager = None
    if size == 1:
        procs = [ctx.Process(target=_single, args=(case, budget, workers, results))]
    else:
        if transport == "manager":
            manager = ctx.Manager()
            addr = (manager.dict(), manager.Lock())
        else:
            addr = ("127.0.0.1", _free_port())
        procs = [ctx.Process(target=_searcher, args=(r, size, case, budget, workers, transport,
                                                     addr, results)) for r in range(size)]
    for p in procs:
        p.start()
    try:
        res = results.get(timeout=(budget or 3600) * 2 + 600)
    finally:
        for p in procs:
            p.join(timeout=120)
            if p.is_alive():
                p.kill()
        if manager is not None:
            manager.shutdown()
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--cases", nargs="+", default=["6-288", "405b-512"], choices=list(CASES))
    ap.add_argument("--budget", type=float, default=None,
                    help="time budget per search (s); default none: to the end")
    ap.add_argument("--workers-per-process", type=int, default=None,
                    help="search threads per process (default: cores / processes)")
    ap.add_argument("--transport", choices=["tcp", "manager"], default="tcp")
    ns = ap.parse_args(argv)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"machine: {cpu_model()}, {cores} cores, load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())} at start; Python "
          f"{platform.python_version()}; transport {ns.transport}; budget "
          f"{ns.budget if ns.budget is not None else 'none'}\n")
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    for case in ns.cases:
        base = None
        for size in ns.processes:
            workers = ns.workers_per_process or max(1, cores // size)
            r = run(case, size, ns.budget, workers, ns.transport)
            if size == 1 or base is None:
                base = r["wall"] if size == 1 else None
            up = "" if base is None else f"x{base / r['wall']:.2f}"
            print(f"| {case} | {size} | {workers} | {r['wall']:.2f} | {up} | {r['nodes']:,} | "
                  f"{r['plan_ms']:.2f} | {r['bound_ms']:.2f} | "
                  f"{'yes' if r['exhaustive'] else 'no'} | {r['plan']} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
