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
all-reduce per stage), ``idle_ms()``, ``critical_chain()`` (a critical path read off the op
times alone, for every producer: see its docstring).
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

    def critical_chain(self) -> np.ndarray:
        """Op indices of one critical path, first op to last, read off the op times alone (so it
        works for measured and engine timelines, which carry no DAG).

        It ends at the last op of the stage whose all-reduce finishes last (without all-reduce
        windows: the op finishing last) and walks back: an op's predecessors are the previous op
        on its stage and its data dependency (the same micro-batch's forward on the previous
        virtual stage, model order ``chunk * N + stage``; a backward's on the next virtual
        stage, or its own forward on the last). The one finishing exactly when the op starts
        wins (the dependency on a tie). Otherwise the op waited for a message, and its
        predecessor is the op finishing last by then on a neighbouring stage (the stages
        around it; across the wrap too when the schedule is interleaved): the dependency when
        sends are shorter than ops, and in the engine model the op after which a blocking,
        bundled p2p call sent the message it waited for. So the chain is exact for the DAG
        with zero sends and a heuristic otherwise; every gap on it is a wait for a message."""
        if not len(self.op_stage):
            return np.zeros(0, dtype=np.int64)
        prev = _previous_on_stage(self.op_stage, self.op_start_ms, self.op_finish_ms)
        dep = _DataDependency(self)
        start, finish = self.op_start_ms, self.op_finish_ms
        tol = 1e-9 * max(1.0, self.span_ms)
        i, chain = self._last_op(), []
        while i >= 0 and len(chain) < len(start):
            chain.append(i)
            p, d = int(prev[i]), dep(i)
            exact = [k for k in (d, p) if k >= 0 and abs(start[i] - finish[k]) <= tol]
            senders = [k for k in (dep.last_finished(st, start[i] + tol)
                                   for st in dep.neighbours(int(self.op_stage[i]))) if k >= 0]
            i = exact[0] if exact else max(senders, key=lambda k: finish[k]) if senders else p
        return np.asarray(chain[::-1], dtype=np.int64)

    def _last_op(self) -> int:
        finish = self.op_finish_ms
        if len(self.allreduce_finish_ms):
            s = int(np.argmax(self.allreduce_finish_ms))
            on_stage = np.flatnonzero(self.op_stage == s)
            if len(on_stage):
                return int(on_stage[np.argmax(finish[on_stage])])
        return int(np.argmax(finish))

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


def _previous_on_stage(stage: np.ndarray, start: np.ndarray, finish: np.ndarray) -> np.ndarray:
    """Per op: the op before it on its stage in time order, or -1."""
    order = np.lexsort((finish, start, stage))
    prev = np.full(len(stage), -1, dtype=np.int64)
    same = stage[order[1:]] == stage[order[:-1]]
    prev[order[1:][same]] = order[:-1][same]
    return prev


class _DataDependency:
    """Op index -> the op it takes its input from (-1 if none): see ``critical_chain``."""

    def __init__(self, tl: Timeline):
        self.n = tl.num_stages
        self.q_last = (int(tl.op_chunk.max()) + 1) * self.n - 1
        self.key = {k: i for i, k in enumerate(zip(
            tl.op_stage.tolist(), tl.op_chunk.tolist(), tl.op_microbatch.tolist(),
            tl.op_is_backward.tolist()))}
        self.tl = tl
        order = np.lexsort((tl.op_finish_ms, tl.op_stage))     # per stage, by finish
        self.by_finish = order
        self.stage_lo = np.searchsorted(tl.op_stage[order], np.arange(self.n + 1))

    def neighbours(self, stage: int) -> set[int]:
        """The stages that send to ``stage`` (0 and N-1 wrap when chunks > 1)."""
        near = {stage - 1, stage + 1}
        if self.q_last >= 2 * self.n - 1:
            return {x % self.n for x in near} - {stage}
        return {x for x in near if 0 <= x < self.n}

    def last_finished(self, stage: int, t: float) -> int:
        """The op of ``stage`` finishing last at or before ``t`` (-1 if none)."""
        lo, hi = self.stage_lo[stage], self.stage_lo[stage + 1]
        ops = self.by_finish[lo:hi]
        k = int(np.searchsorted(self.tl.op_finish_ms[ops], t, side="right"))
        return int(ops[k - 1]) if k else -1

    def __call__(self, i: int) -> int:
        tl, n = self.tl, self.n
        s, c, m = int(tl.op_stage[i]), int(tl.op_chunk[i]), int(tl.op_microbatch[i])
        q = c * n + s
        if not tl.op_is_backward[i]:
            want = (q - 1, False) if q > 0 else None
        else:
            want = (q, False) if q == self.q_last else (q + 1, True)
        if want is None:
            return -1
        return self.key.get((want[0] % n, want[0] // n, m, want[1]), -1)

