"""The three predictions of a case's iteration time from its stage profiles (no torch).

(a) the paper's DAG (``simulator.simulate_pipeline``), (b) Eq. (1)
(``simulator.static_estimate_ms``), (c) the engine-aware model (``simulator.engine``). (a) and (c)
return a ``simulator.timeline.Timeline``; (b) a number. The per-stage tail R[s] given to (a) and
(b) is the measured finalize + optimizer time of stage s (what the plugin would profile as the
stage's all-reduce); (c) models the tail as megatron runs it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ..simulator import simulate_pipeline, static_estimate_ms
from ..simulator.engine import EngineCosts, simulate_engine
from ..simulator.timeline import Timeline
from .cases import Case


@dataclass
class StageProfile:
    """What the plugin would profile for one stage (ms)."""

    forward_ms: list[float]          # per chunk
    backward_ms: list[float]         # per chunk
    send_ms: float                   # activation send on the link stage -> next (ring)
    finalize_ms: float               # gradient finalisation (DP all-reduce)
    optimizer_ms: float              # optimizer step (incl. the grad-norm all-reduce)
    # engine overheads (forward_step / backward_step / p2p call costs with zero-time layers)
    overhead: dict[str, float] = field(default_factory=dict)


def _profile_arrays(case: Case, profiles: Sequence[StageProfile]):
    n, v = case.pp, case.virtual_stages
    fwd = np.array([[profiles[s].forward_ms[c] for s in range(n)] for c in range(v)])
    bwd = np.array([[profiles[s].backward_ms[c] for s in range(n)] for c in range(v)])
    links = n if case.schedule == "interleaved-1f1b" else n - 1
    send = np.array([profiles[s].send_ms for s in range(links)])
    tail = np.array([p.finalize_ms + p.optimizer_ms for p in profiles])
    return fwd, bwd, send, tail


def predict_dag(case: Case, profiles: Sequence[StageProfile]) -> Timeline:
    """The paper's DAG (``simulate_pipeline``), labelled "predicted, paper DAG"."""
    fwd, bwd, send, tail = _profile_arrays(case, profiles)
    if case.virtual_stages == 1:
        fwd, bwd = fwd[0], bwd[0]
    tl = simulate_pipeline(fwd, bwd, send, send, tail, case.num_microbatches, case.schedule,
                           case.virtual_stages)
    return tl.with_label("predicted, paper DAG")


def predict_eq1(case: Case, profiles: Sequence[StageProfile]) -> float:
    """Eq. (1) on the per-device totals (for interleaved: the chunks of a device summed)."""
    fwd, bwd, send, tail = _profile_arrays(case, profiles)
    n = case.pp
    return static_estimate_ms(fwd.sum(0), bwd.sum(0), send[:n - 1], send[:n - 1], tail,
                              case.num_microbatches)


def predict_engine(case: Case, profiles: Sequence[StageProfile]) -> Timeline:
    """The engine-aware model (``simulator.engine``), labelled "predicted, engine-aware"."""
    fwd, bwd, send, _ = _profile_arrays(case, profiles)
    costs = EngineCosts.from_profiles(fwd, bwd, send,
                                      [p.finalize_ms for p in profiles],
                                      [p.optimizer_ms for p in profiles],
                                      [p.overhead for p in profiles])
    tl = simulate_engine(costs, case.num_microbatches, case.schedule, case.virtual_stages)
    return tl.with_label("predicted, engine-aware")
