"""Microseconds per pipeline simulation: `_core` (C sweep and Python fast path) vs the reference.

Run: ``.venv/bin/python benchmarks/bench_simulator.py`` (about a minute). Prints a Markdown table.

Columns: ``core C`` = one ``PipelineDAG.iteration_time`` call (the C API the search cimports),
timed over a nogil loop; ``core py`` = ``simulator.iteration_time_ms`` (validation + cached DAG
lookup + sweep); ``build`` = building the cached structure once per (schedule, N, M, V);
``reference`` = ``simulator_reference.iteration_time_ms`` (literal DAG + longest path, pure
Python, sampled fewer times at large sizes); ``ns/op`` = core C time per compute op.
"""

from __future__ import annotations

import os
import platform
import time

import numpy as np

from poseidon_plugin import _core
from poseidon_plugin.simulator import reference as ref
from poseidon_plugin.simulator import SCHEDULES, iteration_time_ms, normalize_inputs
from _machine import cpu_model  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

SIZES = [(4, 16), (8, 32), (16, 64), (32, 128)]
VIRTUAL = 2  # for interleaved-1f1b




def per_call_s(fn, budget_s: float, min_calls: int = 1) -> float:
    """Seconds per call of ``fn``, calling it for about ``budget_s`` (at least ``min_calls``)."""
    fn()  # warm
    calls, start = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - start
        if calls >= min_calls and elapsed >= budget_s:
            return elapsed / calls


def problem(schedule: str, n: int, m: int, rng: np.random.Generator) -> dict:
    v = VIRTUAL if schedule == "interleaved-1f1b" else 1
    links = n if schedule == "interleaved-1f1b" else n - 1
    return dict(forward_ms=rng.uniform(1, 3, n), backward_ms=rng.uniform(2, 6, n),
                send_forward_ms=rng.uniform(0, 0.5, links),
                send_backward_ms=rng.uniform(0, 0.5, links), allreduce_ms=rng.uniform(0, 5, n),
                num_microbatches=m, schedule=schedule, virtual_stages=v)


def main() -> None:
    rng = np.random.default_rng(0)
    print(f"machine: {cpu_model()}, {os.cpu_count()} logical cores; Python "
          f"{platform.python_version()}, one thread")
    print()
    print("| schedule | N | M | ops | core C (µs) | ns/op | core py (µs) | build (ms) "
          "| reference (µs) | ref/core C |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    per_op: list[float] = []
    for schedule in SCHEDULES:
        for n, m in SIZES:
            p = problem(schedule, n, m, rng)
            x = normalize_inputs(**p)
            args = (x.forward_ms, x.backward_ms, x.send_forward_ms, x.send_backward_ms,
                    x.allreduce_ms)
            t0 = time.perf_counter()
            dag = _core.PipelineDAG(schedule, n, m, x.virtual_stages)
            build_s = time.perf_counter() - t0
            reps = max(1000, 2_000_000 // dag.num_ops)
            c_s = per_call_s(lambda: dag.time_ms_repeated(*args, reps), 0.2) / reps
            py_s = per_call_s(lambda: iteration_time_ms(**p), 0.1)
            ref_s = per_call_s(lambda: ref.iteration_time_ms(**p), 0.3 if n < 32 else 0.0)
            expect = ref.iteration_time_ms(**p)
            got = dag.time_ms(*args)
            assert abs(got - expect) <= 1e-9 * max(1.0, expect), (schedule, n, m, got, expect)
            per_op.append(c_s / dag.num_ops)
            print(f"| {schedule}{' (V=2)' if x.virtual_stages > 1 else ''} | {n} | {m} "
                  f"| {dag.num_ops} | {c_s * 1e6:.2f} | {c_s / dag.num_ops * 1e9:.2f} "
                  f"| {py_s * 1e6:.1f} | {build_s * 1e3:.1f} | {ref_s * 1e6:,.0f} "
                  f"| {ref_s / c_s:,.0f}x |")
    print()
    print(f"cost growth: core C is linear in the op count 2·N·M·V; "
          f"{min(per_op) * 1e9:.2f}-{max(per_op) * 1e9:.2f} ns per op "
          f"({min(per_op) * 1e6:.4f}-{max(per_op) * 1e6:.4f} µs/op) over all rows.")
    engine_rows(rng)


def engine_rows(rng: np.random.Generator) -> None:
    """interleaved-1f1b timed as megatron-core runs it (``_core.EngineDAG``, what the search
    uses) next to the paper's DAG, checked against the Python engine model."""
    from poseidon_plugin.simulator.engine import EngineCosts, simulate_engine
    print()
    print("| interleaved (V=2), as megatron-core runs it | N | M | engine C (µs) "
          "| paper DAG C (µs) | ratio | engine.py (ms) |")
    print("|---|---|---|---|---|---|---|")
    for n, m in SIZES:
        p = problem("interleaved-1f1b", n, m, rng)
        x = normalize_inputs(**p)
        # one time per link for both directions (engine.py's convention)
        args = (x.forward_ms, x.backward_ms, x.send_forward_ms, x.send_forward_ms,
                x.allreduce_ms)
        eng = _core.EngineDAG("interleaved-1f1b", n, m, x.virtual_stages)
        paper = _core.PipelineDAG("interleaved-1f1b", n, m, x.virtual_stages)
        reps = max(1000, 2_000_000 // paper.num_ops)
        e_s = per_call_s(lambda: eng.time_ms_repeated(*args, reps), 0.2) / reps
        p_s = per_call_s(lambda: paper.time_ms_repeated(*args, reps), 0.2) / reps
        v = x.virtual_stages
        costs = EngineCosts.from_profiles(x.forward_ms.reshape(v, n), x.backward_ms.reshape(v, n),
                                          x.send_forward_ms, x.allreduce_ms, np.zeros(n))
        py_s = per_call_s(lambda: simulate_engine(costs, m, "interleaved-1f1b", v), 0.1)
        expect = simulate_engine(costs, m, "interleaved-1f1b", v).iteration_time_ms
        got = eng.time_ms(*args)
        assert abs(got - expect) <= 1e-9 * max(1.0, expect), (n, m, got, expect)
        print(f"| | {n} | {m} | {e_s * 1e6:.2f} | {p_s * 1e6:.2f} | {e_s / p_s:.1f}x "
              f"| {py_s * 1e3:.1f} |")


if __name__ == "__main__":
    main()
