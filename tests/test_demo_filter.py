"""The demo's log filter (``examples/demo_log_filter.ere``, applied by
``examples/run_emulated.sh`` unless ``-v``): Megatron's own long lines are dropped, the plan, the
Poseidon log and the training iterations are kept (issue 38, item 13: the demo printed Megatron
lines of 1,400-1,700 characters).

The long lines are made by megatron-core itself: its argument table (``_print_args`` on the
parsed arguments of a real command line) and the DDP / optimizer config lines, formatted as
megatron-core logs them."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILTER = os.path.join(ROOT, "examples", "demo_log_filter.ere")
LONG = 300   # a line a user reads at a glance in a terminal is well under this

pytestmark = pytest.mark.integration   # megatron-core's own lines


def _megatron_lines() -> list[str]:
    """Lines megatron-core 0.19 prints during the demo's launch, made by its own code."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.training.arguments import _print_args

    from poseidon_plugin.megatron.profile.profiler import parse_megatron_args

    argv = ["--num-layers", "8", "--hidden-size", "128", "--num-attention-heads", "4",
            "--seq-length", "128", "--max-position-embeddings", "128", "--micro-batch-size", "1",
            "--global-batch-size", "16", "--train-iters", "16", "--lr", "2e-3",
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512"]
    args = parse_megatron_args(os.path.join(ROOT, "examples", "pretrain_gpt.py"), argv)
    table = io.StringIO()
    import megatron.training.utils as mtu
    with contextlib.redirect_stdout(table), _rank0(mtu):
        _print_args("arguments", args)
    return [*table.getvalue().splitlines(),
            f"Setting up DistributedDataParallel with config {DistributedDataParallelConfig()}",
            f"Setting up optimizer with config {OptimizerConfig()}"]


@contextlib.contextmanager
def _rank0(mtu):
    saved = mtu.is_rank0
    mtu.is_rank0 = lambda: True
    try:
        yield
    finally:
        mtu.is_rank0 = saved


def _filtered(lines: list[str]) -> list[str]:
    grep = shutil.which("grep")
    assert grep, "grep is needed (run_emulated.sh uses it)"
    out = subprocess.run([grep, "-v", "-E", "-f", FILTER], input="\n".join(lines) + "\n",
                         capture_output=True, text=True, timeout=60)
    assert out.returncode in (0, 1), out.stderr
    return out.stdout.splitlines()


def test_megatrons_long_lines_are_dropped_and_the_plan_and_iterations_kept():
    megatron = _megatron_lines()
    assert max(len(l) for l in megatron) > 1000, "megatron-core's config lines are long"
    assert sum(1 for l in megatron if " ...." in l) > 100, "the argument table"
    ours = ["poseidon: plan 1f1b pp=2 dp=2 tp=1 mbs=1: 2 stages, 406.2 ms predicted",
            "  stage 0  emu-fast  tp1  6 layers",
            "[rank0]: INFO poseidon: calibration: measured 412.0 ms per iteration (+1.4 %)",
            " [2026-12-01 21:00:00] iteration        5/      16 | consumed samples:           80 "
            "| elapsed time per iteration (ms): 410.2 | learning rate: 2.000000E-03 | "
            "global batch size:    16 | lm loss: 6.201845E+00 | loss scale: 1.0 |"]
    kept = _filtered(megatron + ours)
    assert kept[-len(ours):] == ours, kept[-10:]
    long = [l for l in kept if len(l) > LONG]
    assert not long, f"{len(long)} line(s) over {LONG} characters kept, e.g. {long[0][:200]!r}"
    # the table's title lines may stay; none of its ~500 argument rows does
    assert len(kept) - len(ours) <= 2, kept[:5]


def test_the_demo_script_applies_the_filter():
    text = open(os.path.join(ROOT, "examples", "run_emulated.sh"), encoding="utf-8").read()
    assert "grep --line-buffered -v -E -f examples/demo_log_filter.ere" in text
