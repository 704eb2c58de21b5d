"""No plan of the MoE presets on ``examples/clusters/moe-3type-512.yaml`` is over capacity
under the memory model that ``fidelity/memory_check.py`` holds to megatron-core's layers
(issue 36: with the routed copies divided by TP, plans ran out of memory on their first step).

Each plan (``poseidon plan --json``, a bounded search) is re-priced stage by stage here from
what it prints (layer counts, chunks, TP / DP / EP, micro-batches, schedule, training setup),
with ``memory.stage_memory`` on the layers each stage holds (per kind), sequence parallelism
where the flags carry ``--sequence-parallel``, and the stage's device-type reserve: every stage
fits its device and the plan's own figure is that one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from poseidon_plugin import memory
from poseidon_plugin.costs import stage_layer_ranges
from poseidon_plugin.model import get_model
from poseidon_plugin.training import TrainingSetup

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLUSTER = os.path.join(ROOT, "examples", "clusters", "moe-3type-512.yaml")


def _plan(model: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "poseidon_plugin", "plan", "--cluster", CLUSTER, "--model", model,
         "--global-batch-size", "1024", "--seq-length", "4096", "--distributed-optimizer",
         "--time-budget", "20", "--json"],
        capture_output=True, text=True, cwd=ROOT, timeout=600,
        env=dict(os.environ, PYTHONPATH=ROOT))
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["deepseek-v3", "qwen3-235b-a22b", "qwen3-30b-a3b"])
def test_moe_preset_plans_fit_under_the_checked_memory_model(preset):
    plan = _plan(preset)
    model = get_model(preset)
    stages = plan["stages"]
    v = plan["virtual_stages"]
    ranges = stage_layer_ranges([s["layers"] for s in stages], v)
    setup = TrainingSetup.from_dict(plan["training"])
    sp = "--sequence-parallel" in plan["megatron_args"]
    assert sp == (plan["tp"] is not None and plan["tp"] > 1)
    for s, (stage, chunks) in enumerate(zip(stages, ranges)):
        counts = [0] * len(model.layer_kinds)
        for start, stop in chunks:
            for k, c in enumerate(model.kind_counts_in(start, stop)):
                counts[k] += c
        got = memory.stage_memory(
            model, layers=stage["layers"], stage=s, num_stages=len(stages), tp=stage["tp"],
            dp=stage["dp"], micro_batch_size=plan["micro_batch_size"],
            seq_length=plan["seq_length"], num_microbatches=plan["num_microbatches"],
            schedule=plan["schedule"], virtual_stages=v, setup=setup,
            reserve_bytes=stage["memory"]["reserve_bytes"], kind_counts=tuple(counts),
            ep=plan["ep"], sequence_parallel=sp and stage["tp"] > 1)
        assert got.total_bytes <= stage["memory_capacity_bytes"], (preset, s, got)
        assert got.total_bytes == stage["memory_bytes"], (preset, s)
