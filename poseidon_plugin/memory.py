"""Per-pipeline-stage memory model (weights, gradients, optimizer state, activations).

INTERFACE STUB — the contract other modules code against.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StageMemory:
    weights_bytes: int
    gradients_bytes: int
    optimizer_bytes: int
    activations_bytes: int
    total_bytes: int


def microbatches_in_flight(schedule: str, stage: int, num_stages: int, num_microbatches: int,
                           virtual_stages: int = 1) -> float:
    """Peak number of micro-batches (in units of a whole stage's activations) held by `stage`."""
    ...


def stage_memory(model, *, layers: int, stage: int, num_stages: int, tp: int, dp: int,
                 micro_batch_size: int, seq_length: int, num_microbatches: int,
                 schedule: str = "1f1b", virtual_stages: int = 1,
                 distributed_optimizer: bool = False, recompute: bool = False,
                 sequence_parallel: bool = False) -> StageMemory:
    """Memory of one device of `stage` (embedding on stage 0, output layer + logits on the last)."""
    ...
