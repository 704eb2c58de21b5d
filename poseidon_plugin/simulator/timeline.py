"""The pipeline timeline: one row per executed op, predicted or measured.

``Timeline`` is the one value every producer returns: the paper's DAG
(``pipeline.simulate_pipeline``), the engine-aware model (``engine.simulate_engine``) and the
per-op recorder of a real megatron-core run (``megatron.recorder.timeline_from_records``), so the
Gantt drawing and the fidelity report treat them the same way.

Fields (times in ms from the iteration start):

========================  ===================================================================
``iteration_time_ms``     the iteration time the producer defines: the DAG's longest path
                          (= ``span_ms``); the engine model's end of the slowest optimizer step;
                          a recorded iteration's last stage end (after the optimizer step)
``op_*``                  per op, stage-major, each stage in execution order: ``op_stage``,
                          ``op_chunk``, ``op_microbatch``, ``op_is_backward``, ``op_start_ms``,
                          ``op_finish_ms``, ``op_on_critical_path`` (all False where unknown)
``allreduce_start_ms``,   per stage: the DP all-reduce (gradient finalisation) window; empty
``allreduce_finish_ms``   where not recorded
``critical_path``         the DAG's node labels from start to end -- ``("start",)``,
                          ``("F"|"B", stage, chunk, microbatch)``, ``("R", stage)``,
                          ``("end",)`` -- or ``()`` where the producer has no DAG
``label``                 the caption of a drawing ("predicted", "measured", ...)
========================  ===================================================================

Derived: ``num_stages``, ``span_ms`` (last op or all-reduce finish), ``stage_busy_ms`` (compute +
all-reduce per stage), ``idle_ms()``.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import numpy as np

from poseidon_plugin.errors import PoseidonError

_COLUMNS = ["stage", "chunk", "microbatch", "is_backward", "start_ms", "finish_ms", "critical"]


@dataclass(frozen=True)
class Timeline:
    """Per-op rows (every ``op_*`` array has one entry per op) and per-stage all-reduce windows;
    see the module docstring for each field."""

    iteration_time_ms: float
    op_stage: np.ndarray
    op_chunk: np.ndarray
    op_microbatch: np.ndarray
    op_is_backward: np.ndarray
    op_start_ms: np.ndarray
    op_finish_ms: np.ndarray
    op_on_critical_path: np.ndarray
    allreduce_start_ms: np.ndarray   # per stage (may be empty)
    allreduce_finish_ms: np.ndarray
    critical_path: tuple = ()
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

    @property
    def stage_busy_ms(self) -> np.ndarray:
        """Per stage: compute time + all-reduce time."""
        busy = np.zeros(self.num_stages)
        np.add.at(busy, self.op_stage, self.op_finish_ms - self.op_start_ms)
        if len(self.allreduce_finish_ms):
            busy += self.allreduce_finish_ms - self.allreduce_start_ms
        return busy

    def idle_ms(self) -> np.ndarray:
        """Per stage: span minus busy time (compute + all-reduce)."""
        return self.span_ms - self.stage_busy_ms

    def with_label(self, label: str) -> "Timeline":
        return dataclasses.replace(self, label=label)

    def to_json(self) -> str:
        rows = [
            [int(s), int(c), int(m), int(b), round(float(t0), 6), round(float(t1), 6), bool(k)]
            for s, c, m, b, t0, t1, k in zip(self.op_stage, self.op_chunk, self.op_microbatch,
                                             self.op_is_backward, self.op_start_ms,
                                             self.op_finish_ms, self.op_on_critical_path)
        ]
        return json.dumps({
            "label": self.label,
            "iteration_time_ms": float(self.iteration_time_ms),
            "columns": _COLUMNS,
            "ops": rows,
            "allreduce_start_ms": [float(x) for x in self.allreduce_start_ms],
            "allreduce_finish_ms": [float(x) for x in self.allreduce_finish_ms],
            "critical_path": [list(lab) for lab in self.critical_path],
        }, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, source: str = "<timeline>") -> "Timeline":
        """Read ``to_json``'s output; a file without ``iteration_time_ms`` (written before the
        field existed) gets its span."""
        try:
            data = json.loads(text)
            ops = np.asarray(data["ops"], dtype=float).reshape(-1, 7)
            tl = cls(
                iteration_time_ms=float(data.get("iteration_time_ms", "nan")),
                op_stage=ops[:, 0].astype(np.int64), op_chunk=ops[:, 1].astype(np.int64),
                op_microbatch=ops[:, 2].astype(np.int64), op_is_backward=ops[:, 3].astype(bool),
                op_start_ms=ops[:, 4], op_finish_ms=ops[:, 5],
                op_on_critical_path=ops[:, 6].astype(bool),
                allreduce_start_ms=np.asarray(data.get("allreduce_start_ms", []), dtype=float),
                allreduce_finish_ms=np.asarray(data.get("allreduce_finish_ms", []), dtype=float),
                critical_path=tuple((lab[0], *(int(x) for x in lab[1:]))
                                    for lab in data.get("critical_path", [])),
                label=str(data.get("label", "")),
            )
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            raise PoseidonError(f"{source}: not a timeline file ({exc})") from None
        if np.isnan(tl.iteration_time_ms):
            tl = dataclasses.replace(tl, iteration_time_ms=tl.span_ms)
        return tl
