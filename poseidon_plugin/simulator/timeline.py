"""A pipeline timeline: one row per executed op, predicted (from the simulator) or measured.

The simulator's ``SimResult`` and the per-op recorder of a real run both become a ``Timeline``,
so the Gantt drawing and the fidelity report treat them the same way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from poseidon_plugin.errors import PoseidonError


@dataclass(frozen=True)
class Timeline:
    """Per-op rows; all arrays have one entry per op. Times in ms from the iteration start."""

    op_stage: np.ndarray
    op_chunk: np.ndarray
    op_microbatch: np.ndarray
    op_is_backward: np.ndarray
    op_start_ms: np.ndarray
    op_finish_ms: np.ndarray
    allreduce_start_ms: np.ndarray  # per stage (may be empty)
    allreduce_finish_ms: np.ndarray
    critical: np.ndarray            # per op: True if on the critical path (all False if unknown)
    label: str = ""

    @property
    def num_stages(self) -> int:
        return int(self.op_stage.max()) + 1 if len(self.op_stage) else 0

    @property
    def span_ms(self) -> float:
        ends = [float(self.op_finish_ms.max())] if len(self.op_finish_ms) else [0.0]
        if len(self.allreduce_finish_ms):
            ends.append(float(self.allreduce_finish_ms.max()))
        return max(ends)

    def idle_ms(self) -> np.ndarray:
        """Per stage: span minus busy time (compute + all-reduce)."""
        n = self.num_stages
        busy = np.zeros(n)
        np.add.at(busy, self.op_stage, self.op_finish_ms - self.op_start_ms)
        if len(self.allreduce_finish_ms):
            busy += self.allreduce_finish_ms - self.allreduce_start_ms
        return self.span_ms - busy

    def to_json(self) -> str:
        rows = [
            [int(s), int(c), int(m), int(b), round(float(t0), 6), round(float(t1), 6), bool(k)]
            for s, c, m, b, t0, t1, k in zip(self.op_stage, self.op_chunk, self.op_microbatch,
                                             self.op_is_backward, self.op_start_ms,
                                             self.op_finish_ms, self.critical)
        ]
        return json.dumps({
            "label": self.label,
            "columns": ["stage", "chunk", "microbatch", "is_backward", "start_ms", "finish_ms",
                        "critical"],
            "ops": rows,
            "allreduce_start_ms": [float(x) for x in self.allreduce_start_ms],
            "allreduce_finish_ms": [float(x) for x in self.allreduce_finish_ms],
        }, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, source: str = "<timeline>") -> "Timeline":
        try:
            data = json.loads(text)
            ops = np.asarray(data["ops"], dtype=float).reshape(-1, 7)
            return cls(
                op_stage=ops[:, 0].astype(np.int64), op_chunk=ops[:, 1].astype(np.int64),
                op_microbatch=ops[:, 2].astype(np.int64), op_is_backward=ops[:, 3].astype(bool),
                op_start_ms=ops[:, 4], op_finish_ms=ops[:, 5], critical=ops[:, 6].astype(bool),
                allreduce_start_ms=np.asarray(data.get("allreduce_start_ms", []), dtype=float),
                allreduce_finish_ms=np.asarray(data.get("allreduce_finish_ms", []), dtype=float),
                label=str(data.get("label", "")),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise PoseidonError(f"{source}: not a timeline file ({exc})") from None


def timeline_from_sim(result, label: str = "predicted") -> Timeline:
    """Convert a ``simulator.SimResult`` (critical path marked) into a Timeline."""
    on_path = {lab for lab in result.critical_path if lab and lab[0] in ("F", "B")}
    critical = np.array([
        (("B" if b else "F"), int(s), int(c), int(m)) in on_path
        for s, c, m, b in zip(result.op_stage, result.op_chunk, result.op_microbatch,
                              result.op_is_backward)
    ], dtype=bool)
    return Timeline(
        op_stage=np.asarray(result.op_stage), op_chunk=np.asarray(result.op_chunk),
        op_microbatch=np.asarray(result.op_microbatch),
        op_is_backward=np.asarray(result.op_is_backward, dtype=bool),
        op_start_ms=np.asarray(result.op_start_ms, dtype=float),
        op_finish_ms=np.asarray(result.op_finish_ms, dtype=float),
        allreduce_start_ms=np.asarray(result.allreduce_start_ms, dtype=float),
        allreduce_finish_ms=np.asarray(result.allreduce_finish_ms, dtype=float),
        critical=critical, label=label,
    )
