"""Per-op timeline recording inside a real megatron-core pipeline run.

``OpRecorder`` wraps megatron-core's ``schedules.forward_step`` and ``schedules.backward_step``
(the module-level functions every pipeline schedule calls) and the config's
``finalize_model_grads_func``; each call is stamped with the wall clock on entry and exit.
Nothing else changes: the schedule, the p2p calls and the model are megatron-core's own.

Identification of an op (no cooperation from the model needed):

- forward: the chunk is ``vp_stage`` when megatron passes it (interleaved), else the position of
  the model in the chunk list given to :meth:`OpRecorder.set_chunks` (else 0); the micro-batch is
  a per-chunk counter -- every schedule runs each chunk's forwards in micro-batch order.
- backward: the output tensor megatron hands to ``backward_step`` is the one the forward returned,
  so ``id(output)`` finds (chunk, micro-batch) of its forward.

Clock: ``time.perf_counter`` which on Linux is ``CLOCK_MONOTONIC``, shared by every process of a
host, so ranks of one host are aligned exactly. On a GPU / NPU (``event_class``:
``torch.cuda.Event``, ``torch.npu.Event``) the host runs ahead of the device, so the host clock
around a call times its kernel launches, not its work (on an H200 a llama3-8b layer's backward
read half its length and the rest landed in the optimizer step's wait): there every mark is a
device event, and :meth:`OpRecorder.flush` (one synchronisation, when the records are read)
turns them into host-clock seconds, ``origin + elapsed since the first iteration's start
event``; :func:`align` subtracts a common origin (the
earliest iteration start over the ranks). Ranks on several hosts would need an offset estimate
(a barrier round); the validate harness only runs on one host.

Usage (one rank)::

    rec = OpRecorder(stage=pp_rank)
    rec.set_chunks(model_chunks)
    with rec.installed(config):
        for it in range(iters):
            rec.begin_iteration()
            forward_backward_func(...)
            optimizer_step()
            rec.end_iteration()
    rec.flush()                       # device events -> seconds (a no-op on the host clock)
    rows = rec.iterations[k]          # IterationRecord: ops, allreduce window, start/end

``timeline_from_records([rank0_iter, rank1_iter, ...])`` turns one iteration of every stage into a
:class:`poseidon_plugin.simulator.timeline.Timeline` (times in ms from the iteration's earliest start).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import numpy as np

from poseidon_plugin.simulator.timeline import Timeline

clock = time.perf_counter


@dataclass
class IterationRecord:
    """One iteration on one stage; times in seconds of the host's monotonic clock."""

    stage: int
    start_s: float = 0.0
    end_s: float = 0.0
    # (chunk, microbatch, is_backward, start_s, finish_s), in execution order
    ops: list[tuple[int, int, bool, float, float]] = field(default_factory=list)
    allreduce_start_s: float = float("nan")
    allreduce_finish_s: float = float("nan")

    def to_dict(self) -> dict:
        return {"stage": self.stage, "start_s": self.start_s, "end_s": self.end_s,
                "ops": [list(o) for o in self.ops],
                "allreduce_start_s": self.allreduce_start_s,
                "allreduce_finish_s": self.allreduce_finish_s}

    @classmethod
    def from_dict(cls, d: dict) -> "IterationRecord":
        return cls(int(d["stage"]), float(d["start_s"]), float(d["end_s"]),
                   [(int(c), int(m), bool(b), float(t0), float(t1)) for c, m, b, t0, t1 in d["ops"]],
                   float(d["allreduce_start_s"]), float(d["allreduce_finish_s"]))


class OpRecorder:
    """Record the start/finish of every forward and backward a megatron-core schedule runs."""

    def __init__(self, stage: int, event_class: Any = None) -> None:
        self.stage = int(stage)
        self.iterations: list[IterationRecord] = []
        self._current: IterationRecord | None = None
        self._chunk_of: dict[int, int] = {}
        self._fwd_count: dict[int, int] = {}
        self._producer: dict[int, tuple[int, int]] = {}
        self._event_class = event_class
        self._origin: tuple[float, Any] | None = None   # (host seconds, its device event)
        self._marks: dict[str, Any] = {}                 # the current iteration's events
        self._pending: list[tuple[IterationRecord, dict[str, Any]]] = []

    # -- clocks --------------------------------------------------------------------------------
    def _mark(self) -> Any:
        """A time mark: host seconds, or a recorded device event."""
        if self._event_class is None:
            return clock()
        ev = self._event_class(enable_timing=True)
        ev.record()
        return ev

    def _seconds(self, mark: Any) -> float:
        if self._event_class is None:
            return float(mark)
        host, ev0 = self._origin  # type: ignore[misc]
        return host + ev0.elapsed_time(mark) / 1e3

    def flush(self) -> None:
        """Device events of the recorded iterations -> host-clock seconds (one synchronisation
        on the last event); a no-op on the host clock."""
        if not self._pending:
            return
        self._pending[-1][1]["end"].synchronize()
        for rec, marks in self._pending:
            rec.start_s, rec.end_s = self._seconds(marks["start"]), self._seconds(marks["end"])
            rec.ops = [(c, m, b, self._seconds(e0), self._seconds(e1))
                       for (c, m, b, _, _), (e0, e1) in zip(rec.ops, marks["ops"])]
            if "allreduce" in marks:
                e0, e1 = marks["allreduce"]
                rec.allreduce_start_s, rec.allreduce_finish_s = self._seconds(e0), self._seconds(e1)
        self._pending.clear()

    def now_s(self) -> float:
        """The current time on this recorder's clock (on a device: once its queued work is done,
        in the same host-clock seconds as the flushed records)."""
        if self._event_class is None or self._origin is None:
            return clock()
        ev = self._mark()
        ev.synchronize()
        return self._seconds(ev)

    def _op(self, chunk: int, mb: int, is_bwd: bool, m0: Any, m1: Any) -> None:
        if self._current is None:
            return
        if self._event_class is None:
            self._current.ops.append((chunk, mb, is_bwd, m0, m1))
        else:
            self._current.ops.append((chunk, mb, is_bwd, float("nan"), float("nan")))
            self._marks["ops"].append((m0, m1))

    def set_chunks(self, chunks: Sequence[Any]) -> None:
        self._chunk_of = {id(m): i for i, m in enumerate(chunks)}

    # -- iteration markers -------------------------------------------------------------------
    def begin_iteration(self) -> None:
        host = clock()
        if self._event_class is not None:
            start = self._mark()
            if self._origin is None:
                self._origin = (host, start)
            self._marks = {"start": start, "ops": []}
        self._current = IterationRecord(self.stage, start_s=host)
        self._fwd_count.clear()
        self._producer.clear()

    def end_iteration(self) -> IterationRecord:
        rec = self._current
        if rec is None:
            raise RuntimeError("end_iteration without begin_iteration")
        end = self._mark()
        if self._event_class is None:
            rec.end_s = end
        else:   # times filled in by flush()
            rec.end_s = clock()
            self._marks["end"] = end
            self._pending.append((rec, self._marks))
            self._marks = {}
        self.iterations.append(rec)
        self._current = None
        return rec

    # -- wrappers ----------------------------------------------------------------------------
    def _chunk(self, model: Any, vp_stage: Any) -> int:
        if vp_stage is not None:
            return int(vp_stage)
        return self._chunk_of.get(id(model), 0)

    def _wrap_forward(self, orig):
        def forward_step(forward_step_func, data_iterator, model, *args, **kwargs):
            t0 = self._mark()
            out = orig(forward_step_func, data_iterator, model, *args, **kwargs)
            t1 = self._mark()
            chunk = self._chunk(model, kwargs.get("vp_stage"))
            mb = self._fwd_count.get(chunk, 0)
            self._fwd_count[chunk] = mb + 1
            tensor = out[0] if isinstance(out, tuple) else out
            key = tensor[0] if isinstance(tensor, list) and tensor else tensor
            self._producer[id(key)] = (chunk, mb)
            self._op(chunk, mb, False, t0, t1)
            return out
        forward_step.__wrapped__ = orig  # type: ignore[attr-defined]
        return forward_step

    def _wrap_backward(self, orig):
        def backward_step(input_tensor, output_tensor, output_tensor_grad, *args, **kwargs):
            key = output_tensor[0] if isinstance(output_tensor, list) and output_tensor \
                else output_tensor
            chunk, mb = self._producer.pop(id(key), (-1, -1))
            t0 = self._mark()
            out = orig(input_tensor, output_tensor, output_tensor_grad, *args, **kwargs)
            t1 = self._mark()
            self._op(chunk, mb, True, t0, t1)
            return out
        backward_step.__wrapped__ = orig  # type: ignore[attr-defined]
        return backward_step

    def _wrap_finalize(self, orig):
        def finalize(*args, **kwargs):
            t0 = self._mark()
            out = orig(*args, **kwargs)
            t1 = self._mark()
            if self._current is not None:
                if self._event_class is None:
                    self._current.allreduce_start_s, self._current.allreduce_finish_s = t0, t1
                else:
                    self._marks["allreduce"] = (t0, t1)
            return out
        finalize.__wrapped__ = orig  # type: ignore[attr-defined]
        return finalize

    @contextlib.contextmanager
    def installed(self, config: Any = None) -> Iterator["OpRecorder"]:
        """Patch megatron-core's schedules module (and ``config.finalize_model_grads_func``)."""
        from megatron.core.pipeline_parallel import schedules

        saved = (schedules.forward_step, schedules.backward_step)
        schedules.forward_step = self._wrap_forward(saved[0])
        schedules.backward_step = self._wrap_backward(saved[1])
        saved_fin = getattr(config, "finalize_model_grads_func", None) if config is not None else None
        if saved_fin is not None:
            config.finalize_model_grads_func = self._wrap_finalize(saved_fin)
        try:
            yield self
        finally:
            schedules.forward_step, schedules.backward_step = saved
            if saved_fin is not None:
                config.finalize_model_grads_func = saved_fin


def timeline_from_records(records: Sequence[IterationRecord], label: str = "measured",
                          origin_s: float | None = None) -> Timeline:
    """One iteration of every stage (``records[s]`` for stage s) -> Timeline in ms.

    ``origin_s`` defaults to the earliest iteration start over the stages (host clock)."""
    if origin_s is None:
        origin_s = min(r.start_s for r in records)
    rows = [(r.stage, c, m, b, t0, t1) for r in records for c, m, b, t0, t1 in r.ops]
    arr = np.array(rows, dtype=float).reshape(-1, 6)
    recs = sorted(records, key=lambda r: r.stage)
    ar0 = np.array([r.allreduce_start_s for r in recs], dtype=float)
    ar1 = np.array([r.allreduce_finish_s for r in recs], dtype=float)
    if np.isnan(ar0).any():
        ar0 = ar1 = np.zeros(0)
    return Timeline(
        iteration_time_ms=(max(r.end_s for r in records) - origin_s) * 1e3,
        op_stage=arr[:, 0].astype(np.int64), op_chunk=arr[:, 1].astype(np.int64),
        op_microbatch=arr[:, 2].astype(np.int64), op_is_backward=arr[:, 3].astype(bool),
        op_start_ms=(arr[:, 4] - origin_s) * 1e3, op_finish_ms=(arr[:, 5] - origin_s) * 1e3,
        op_on_critical_path=np.zeros(len(arr), dtype=bool),
        allreduce_start_ms=(ar0 - origin_s) * 1e3 if len(ar0) else ar0,
        allreduce_finish_ms=(ar1 - origin_s) * 1e3 if len(ar1) else ar1, label=label)
