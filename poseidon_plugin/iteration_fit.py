"""Fit a plan's costs to measured iterations: the stage compute and the per-iteration overhead.

Given a plan and, for a window of iterations of the run that executes it, each stage's measured
forward / backward time per micro-batch and each iteration's measured time:

* per stage s, ``fwd_ratio[s]`` = measured forward / the plan's forward (``bwd_ratio`` alike):
  how far the stage's compute in training is from the profiled one (host contention, data
  loading in the first stage's forward, the loss in the last one's);
* the plan re-timed with that compute (every chunk of s scaled by s's ratios; sends and each
  stage's DP all-reduce + optimizer step as planned, the plan's own overhead left out):
  ``pipeline_ms``;
* ``overhead_ms`` = the median over the window of (measured iteration - ``pipeline_ms``), at
  least 0: what the iteration takes beyond the simulated pipeline (``overhead.py``);
* ``predicted_ms`` = ``pipeline_ms + overhead_ms``: the plan's time with the fitted costs, the
  number to compare with *later* iterations (the window's own are fitted, not predicted).

Median, not mean, over the window: a few iterations, and a one-off stall in one of them (another
job on the host) should not become the overhead of every later plan.

Torch-free; the simulator is the search's (``simulator.pipeline.iteration_time_ms``, engine
timing as ``plan.TIMING_MODEL``).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .errors import PoseidonError


@dataclass(frozen=True)
class IterationFit:
    fwd_ratio: tuple[float, ...]     # per stage: measured / planned forward
    bwd_ratio: tuple[float, ...]
    pipeline_ms: float               # the plan re-timed with the measured compute, no overhead
    overhead_ms: float               # per-iteration overhead fitted to the window
    iterations: int                  # measured iterations in the window

    @property
    def predicted_ms(self) -> float:
        return self.pipeline_ms + self.overhead_ms

    def ratio_text(self) -> str:
        """``s0 x1.05/x0.97, s1 x1.10/x1.02`` (forward / backward, measured over planned)."""
        return ", ".join(f"s{i} x{f:.2f}/x{b:.2f}"
                         for i, (f, b) in enumerate(zip(self.fwd_ratio, self.bwd_ratio)))


def _ratio(measured: float, planned: float) -> float:
    return measured / planned if planned > 0.0 and measured > 0.0 else 1.0


def retimed_ms(plan, fwd_ratio: Sequence[float], bwd_ratio: Sequence[float]) -> float:
    """The plan's iteration with stage s's forward / backward scaled by its ratios and without
    the plan's per-iteration overhead (the simulator and timing model the search used)."""
    from .plan import TIMING_MODEL
    from .simulator.pipeline import iteration_time_ms

    F, B, Pf, Pb, R = plan.simulator_inputs()
    fr, br = np.asarray(fwd_ratio, dtype=float), np.asarray(bwd_ratio, dtype=float)
    R = R - np.array([float(getattr(s, "overhead_ms", 0.0)) for s in plan.stages])
    return iteration_time_ms(F * fr, B * br, Pf, Pb, np.maximum(R, 0.0), plan.num_microbatches,
                             plan.schedule, plan.virtual_stages, engine=TIMING_MODEL == "engine",
                             calls=tuple(getattr(plan, "engine_calls", (0.0,) * 4)))


def fit_iteration(plan, stage_forward_ms: Sequence[float], stage_backward_ms: Sequence[float],
                  iteration_ms: Sequence[float]) -> IterationFit:
    """See the module docstring. ``stage_*_ms[s]``: stage s's measured time per micro-batch
    (all its chunks); ``iteration_ms``: the measured iterations of the window."""
    n = len(plan.stages)
    if len(stage_forward_ms) != n or len(stage_backward_ms) != n:
        raise PoseidonError(f"iteration fit: expected one forward and backward time per stage "
                            f"({n}), got {len(stage_forward_ms)} and {len(stage_backward_ms)}")
    walls = [float(x) for x in iteration_ms if x == x and x > 0.0]
    if not walls:
        raise PoseidonError("iteration fit: no measured iteration in the window")
    fr = tuple(_ratio(float(m), s.forward_ms) for m, s in zip(stage_forward_ms, plan.stages))
    br = tuple(_ratio(float(m), s.backward_ms) for m, s in zip(stage_backward_ms, plan.stages))
    pipe = retimed_ms(plan, fr, br)
    over = max(0.0, statistics.median(w - pipe for w in walls))
    return IterationFit(fr, br, pipe, over, len(walls))
