"""Time to draw a Gantt chart (``poseidon plan --gantt``), printed as Markdown.

Run: ``.venv/bin/python benchmarks/bench_gantt.py [--repeat R] [--out DIR]``.

Cases: the plans of the paper's settings 1 (llama3-8b) and 6 (288 NPUs, llama3-70b), global
batch 128, sequence 4096, the CLI's default schedules, drawn as the CLI draws them, and synthetic 1f1b / interleaved (V=2) timelines at PP=32,
M=128 (8,192 and 16,384 ops). Each case is drawn ``--repeat`` times to PNG and to SVG; the
column is the best of the repeats (seconds, after one warm-up drawing that imports matplotlib).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def paper_setting(setting: str, model_name: str):
    """(draw function, description) of a paper setting's plan (the CLI's default schedules),
    drawn as ``plan --gantt`` draws it."""
    from poseidon_plugin import cli
    from poseidon_plugin.cluster import load_cluster
    from poseidon_plugin.model import get_model
    from poseidon_plugin.search import SearchOptions, search_plan
    from poseidon_plugin.simulator.schedules import LAUNCHABLE_SCHEDULES

    cluster = load_cluster(os.path.join(ROOT, f"examples/clusters/{setting}.yaml"))
    model = get_model(model_name)
    plan = search_plan(cluster, model, SearchOptions(
        global_batch_size=128, seq_length=4096, schedules=tuple(LAUNCHABLE_SCHEDULES)))

    def draw(path):
        cli._draw_plan_gantt(cluster, model, plan, None, path)

    return draw, f"{setting} {model_name} ({plan.schedule}, PP={plan.pp}, M={plan.num_microbatches})"


def synthetic(n: int, m: int, schedule: str, v: int):
    import numpy as np

    from poseidon_plugin.gantt import draw_gantt
    from poseidon_plugin.simulator import simulate_pipeline

    rng = np.random.default_rng(0)
    f = rng.uniform(5, 10, n)
    links = n if schedule == "interleaved-1f1b" else n - 1
    tl = simulate_pipeline(f, 2 * f, np.full(links, 0.5), np.full(links, 0.5), np.full(n, 3.0),
                           m, schedule, v)

    def draw(path):
        draw_gantt([tl], path, title=f"{schedule} PP={n} M={m}")

    return draw, f"{schedule}{'' if v == 1 else f' V={v}'}, PP={n}, M={m} ({len(tl.op_stage)} ops)"


def best_of(draw, path: str, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        draw(path)
        times.append(time.perf_counter() - t0)
    return min(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=None, help="keep the drawings in this folder")
    args = ap.parse_args(argv)
    out = args.out or tempfile.mkdtemp(prefix="bench_gantt_")
    os.makedirs(out, exist_ok=True)
    import logging
    logging.disable(logging.WARNING)
    sys.stderr = open(os.devnull, "w")   # the CLI helper reports each file it wrote
    cases = [paper_setting("paper-setting1", "llama3-8b"),
             paper_setting("paper-setting6", "llama3-70b"), synthetic(32, 128, "1f1b", 1),
             synthetic(32, 128, "interleaved-1f1b", 2)]
    cases[0][0](os.path.join(out, "warmup.png"))
    print("| case | PNG s | SVG s |\n|---|---:|---:|")
    for i, (draw, name) in enumerate(cases):
        png = best_of(draw, os.path.join(out, f"case{i}.png"), args.repeat)
        svg = best_of(draw, os.path.join(out, f"case{i}.svg"), args.repeat)
        print(f"| {name} | {png:.2f} | {svg:.2f} |", flush=True)
    print(f"\n(drawings in {out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
