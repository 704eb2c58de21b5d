"""Thin Python API over the Cython DAG simulator (`_core`).

INTERFACE STUB — the contract other modules code against.

Semantics: ../shared/DESIGN.md "The simulator's semantics". One pipeline of N stages (devices),
M micro-batches; per-stage forward_ms[s], backward_ms[s], allreduce_ms[s]; send_forward_ms[s] is
the activation send s -> s+1 and send_backward_ms[s] the gradient send s+1 -> s (length N-1; for
interleaved-1f1b length N, the last entry being the wrap-around link device N-1 -> device 0).
For interleaved-1f1b with V chunks each chunk costs forward_ms[s] / V unless per-chunk arrays
(shape (V, N)) are passed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SCHEDULES = ("gpipe", "1f1b", "eager-1f1b", "interleaved-1f1b")


@dataclass(frozen=True)
class SimResult:
    iteration_time_ms: float
    # one row per op: (stage, chunk, microbatch, is_backward) in each stage's execution order
    op_stage: np.ndarray
    op_chunk: np.ndarray
    op_microbatch: np.ndarray
    op_is_backward: np.ndarray
    op_start_ms: np.ndarray
    op_finish_ms: np.ndarray
    allreduce_start_ms: np.ndarray   # per stage
    allreduce_finish_ms: np.ndarray  # per stage
    stage_busy_ms: np.ndarray        # per stage, compute + all-reduce time
    critical_path: tuple             # node labels from start to end, e.g. ("F", s, c, m), ("R", s)


def simulate_pipeline(forward_ms, backward_ms, send_forward_ms, send_backward_ms, allreduce_ms,
                      num_microbatches: int, schedule: str = "1f1b",
                      virtual_stages: int = 1) -> SimResult: ...


def iteration_time_ms(forward_ms, backward_ms, send_forward_ms, send_backward_ms, allreduce_ms,
                      num_microbatches: int, schedule: str = "1f1b",
                      virtual_stages: int = 1) -> float:
    """Fast path: the longest-path length only (no per-op arrays, no critical path)."""
    ...


def static_estimate_ms(forward_ms, backward_ms, send_forward_ms, send_backward_ms, allreduce_ms,
                       num_microbatches: int) -> float:
    """Eq. (1) of the paper (Metis and others): sum t_s + (M-1) max t_s + DP all-reduce."""
    ...
