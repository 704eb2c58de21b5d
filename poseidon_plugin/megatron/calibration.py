"""Live calibration: predicted vs measured iteration time of a running job, and measured per-stage
timings written back to the profile cache.

API (the ``--poseidon-auto`` runner installs it after the plan is applied, before the script runs)::

    from poseidon_plugin.megatron.calibration import install_calibration

    cal = install_calibration(
        plan,                                  # poseidon_plugin.plan.Plan (read: stages[i].layers/
                                               #   .device_type/.tp, micro_batch_size, seq_length,
                                               #   predicted_iteration_time_ms)
        model_signature=model.signature(),     # ProfileKey.model_signature of the run's model
        profile_db_path=cache_path,            # JSON ProfileDB; None = do not write back
        warmup_iterations=3, measure_iterations=5)

``install_calibration`` wraps ``megatron.training.training.train_step`` (looked up as a module
global by ``train()`` in megatron-core 0.19, so the wrapper is used) and installs an
:class:`~poseidon_plugin.megatron.recorder.OpRecorder` around megatron-core's ``forward_step`` /
``backward_step``. For a loop that calls megatron-core's ``get_forward_backward_func()`` itself,
call ``cal.begin_iteration()`` / ``cal.end_iteration()`` around each iteration instead (after
``cal.install(wrap_train_step=False)``, or use ``LiveCalibration`` directly).

After ``warmup_iterations + measure_iterations`` iterations, ONCE:

* every rank computes the mean wall time of the measured iterations and the median forward and
  backward op time of its stage (all micro-batches, all chunks of a device summed per
  micro-batch); with ``torch.distributed`` up they are all-gathered so rank 0 sees every stage;
* rank 0 logs one line on ``logging.getLogger("poseidon")`` (and returns it from
  :meth:`LiveCalibration.report`)::

      poseidon: calibration: iteration 8: predicted 812.4 ms, measured 829.0 ms (+2.0%); ...

* rank 0 writes per-layer ``LayerProfile`` records (``source="measured"``, ``layer_kind
  "decoder"``) to the profile DB: for each device type, the stage op time divided by the stage's
  layer count, preferring stages that hold neither the embedding nor the output layer (their
  times include those). Measured records beat estimated ones in ``ProfileDB``'s merge rule, so
  the next plan uses them. Activation / parameter bytes are kept from an existing record of the
  same key (0 if none).

Nothing here changes the training; a failure inside calibration is logged and swallowed.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable

from .recorder import OpRecorder

if TYPE_CHECKING:
    from ..plan import Plan
    from ..profiles import LayerProfile, ProfileDB

log = logging.getLogger("poseidon")


@dataclass(frozen=True)
class StageTiming:
    stage: int
    forward_ms: float      # per micro-batch, whole device (all chunks)
    backward_ms: float
    iteration_ms: float    # mean wall time of the measured iterations on this rank
    tail_ms: float = 0.0   # mean time from the stage's last op to the iteration's end (DP
    #                        all-reduce, optimizer step, per-iteration overheads)
    peak_memory_bytes: int = 0   # the device's peak allocated memory (0: not measurable)


@dataclass(frozen=True)
class CalibrationReport:
    iteration: int
    predicted_ms: float
    measured_ms: float
    stages: tuple[StageTiming, ...]
    profiles_written: int
    predicted_memory_bytes: tuple[int, ...] = ()   # the plan's per-stage peak memory

    @property
    def error(self) -> float:
        return (self.predicted_ms - self.measured_ms) / self.measured_ms

    def line(self) -> str:
        per = ", ".join(f"s{t.stage} F {t.forward_ms:.1f}/B {t.backward_ms:.1f}"
                        f"/tail {t.tail_ms:.1f}" for t in self.stages)
        return (f"calibration: iteration {self.iteration}: predicted {self.predicted_ms:.1f} ms, "
                f"measured {self.measured_ms:.1f} ms ({100 * self.error:+.1f}%); "
                f"per stage (ms per micro-batch): {per}; {self.memory_text()}; "
                f"{self.profiles_written} measured profile record(s) written")

    def memory_text(self) -> str:
        """Predicted vs measured peak memory per stage (the device's max allocated bytes)."""
        pairs = [(t.stage, self.predicted_memory_bytes[t.stage], t.peak_memory_bytes)
                 for t in self.stages
                 if t.peak_memory_bytes > 0 and t.stage < len(self.predicted_memory_bytes)]
        if not pairs:
            return "peak memory not measurable on this device"
        gib = float(1 << 30)
        return "peak memory " + ", ".join(
            f"s{s} predicted {p / gib:.2f} GiB, measured {m / gib:.2f} GiB "
            f"({100 * (p - m) / m:+.1f}%)" for s, p, m in pairs)


def stage_timing(recorder: OpRecorder, stage: int, skip: int) -> StageTiming | None:
    """Median per-micro-batch forward / backward time of one rank's recorded iterations."""
    its = recorder.iterations[skip:]
    if not its:
        return None
    fwd: list[float] = []
    bwd: list[float] = []
    for it in its:
        per_mb_f: dict[int, float] = {}
        per_mb_b: dict[int, float] = {}
        for _, mb, is_bwd, t0, t1 in it.ops:
            d = per_mb_b if is_bwd else per_mb_f
            d[mb] = d.get(mb, 0.0) + (t1 - t0)
        fwd.extend(per_mb_f.values())
        bwd.extend(per_mb_b.values())
    wall = statistics.fmean(it.end_s - it.start_s for it in its)
    tails = [it.end_s - max(op[4] for op in it.ops) for it in its if it.ops]
    return StageTiming(stage, statistics.median(fwd) * 1e3 if fwd else 0.0,
                       statistics.median(bwd) * 1e3 if bwd else 0.0, wall * 1e3,
                       statistics.fmean(tails) * 1e3 if tails else 0.0, _peak_memory_bytes())


def _peak_memory_bytes() -> int:
    """``max_memory_allocated`` of this rank's CUDA / NPU device; 0 on CPU (emulation)."""
    try:
        import torch

        for mod in (getattr(torch, "npu", None), torch.cuda):
            if mod is not None and mod.is_available():
                return int(mod.max_memory_allocated())
    except Exception:  # noqa: BLE001 - no device runtime
        pass
    return 0


def measured_profiles(plan: Plan, timings: list[StageTiming], model_signature: str,
                      existing: ProfileDB | None = None) -> list[LayerProfile]:
    """Per-layer measured ``LayerProfile``s, one per (device type, tp) of the plan."""
    from ..profiles import LayerProfile, ProfileKey
    from ..training import TrainingSetup

    setup = TrainingSetup.from_dict(getattr(plan, "training", None)).profile_fields
    n = len(plan.stages)
    by_stage = {t.stage: t for t in timings}
    groups: dict[tuple[str, int], list[tuple[bool, float, float]]] = {}
    for i, st in enumerate(plan.stages):
        t = by_stage.get(i)
        if t is None or st.layers <= 0:
            continue
        inner = 0 < i < n - 1
        groups.setdefault((st.device_type, int(st.tp)), []).append(
            (inner, t.forward_ms / st.layers, t.backward_ms / st.layers))
    out = []
    for (dtype, tp), rows in sorted(groups.items()):
        pick = [r for r in rows if r[0]] or rows
        key = ProfileKey(dtype, "decoder", tp, int(plan.micro_batch_size), int(plan.seq_length),
                         model_signature, **setup)
        old = existing.get(key) if existing is not None else None
        out.append(LayerProfile(
            key, statistics.median(r[1] for r in pick), statistics.median(r[2] for r in pick),
            old.activation_bytes if old else 0, old.param_bytes if old else 0, "measured"))
    return out


class LiveCalibration:
    """Times iterations, reports once, writes measured profiles (see the module docstring)."""

    def __init__(self, plan: Plan, *, model_signature: str = "", profile_db_path: str | None = None,
                 warmup_iterations: int = 3, measure_iterations: int = 5, stage: int | None = None,
                 emit: Callable[[str], None] | None = None) -> None:
        self.plan = plan
        self.model_signature = model_signature
        self.profile_db_path = profile_db_path
        self.warmup = int(warmup_iterations)
        self.measure = int(measure_iterations)
        self.predicted_ms = float(plan.predicted_iteration_time_ms)
        self.stage = stage
        self.recorder: OpRecorder | None = None
        self.result: CalibrationReport | None = None
        self._emit = emit
        self._iteration = 0
        self._undo: list[Callable[[], None]] = []
        self._rec_ctx = None

    # -- installation --------------------------------------------------------------------------
    def install(self, wrap_train_step: bool = True) -> "LiveCalibration":
        stage = self.stage if self.stage is not None else _pp_rank()
        self.recorder = OpRecorder(stage)
        self._rec_ctx = self.recorder.installed(None)
        self._rec_ctx.__enter__()
        self._undo.append(lambda: self._rec_ctx.__exit__(None, None, None))
        if wrap_train_step:
            from megatron.training import training

            orig = training.train_step

            def train_step(*args, **kwargs):
                self.begin_iteration()
                try:
                    return orig(*args, **kwargs)
                finally:
                    self.end_iteration()

            train_step.__wrapped__ = orig  # type: ignore[attr-defined]
            training.train_step = train_step
            self._undo.append(lambda: setattr(training, "train_step", orig))
        return self

    def uninstall(self) -> None:
        while self._undo:
            self._undo.pop()()

    # -- per iteration -------------------------------------------------------------------------
    def begin_iteration(self) -> None:
        if self.result is None and self.recorder is not None:
            if self.stage is None:  # Megatron's parallel state exists once training runs
                self.recorder.stage = _pp_rank()
            self.recorder.begin_iteration()

    def end_iteration(self) -> None:
        if self.result is not None or self.recorder is None:
            return
        self.recorder.end_iteration()
        self._iteration += 1
        if self._iteration >= self.warmup + self.measure:
            try:
                self._finish()
            except Exception as exc:  # never break the training
                log.warning("calibration failed: %s", exc)
                self.result = CalibrationReport(self._iteration, self.predicted_ms, float("nan"),
                                                (), 0)
            finally:
                self.uninstall()

    def report(self) -> CalibrationReport | None:
        return self.result

    # -- the one-time report -------------------------------------------------------------------
    def _finish(self) -> None:
        mine = stage_timing(self.recorder, self.recorder.stage, self.warmup)
        timings = _gather(mine)
        rank0 = _rank() == 0
        measured = max((t.iteration_ms for t in timings), default=float("nan"))
        # one timing per stage (DP replicas of a stage: keep the first)
        per_stage: dict[int, StageTiming] = {}
        for t in timings:
            kept = per_stage.setdefault(t.stage, t)
            if t.peak_memory_bytes > kept.peak_memory_bytes:  # the stage's largest replica
                per_stage[t.stage] = replace(kept, peak_memory_bytes=t.peak_memory_bytes)
        stages = tuple(per_stage[s] for s in sorted(per_stage))
        written = 0
        if rank0 and self.profile_db_path:
            from ..profiles import ProfileDB

            db = ProfileDB(self.profile_db_path)
            for prof in measured_profiles(self.plan, list(stages), self.model_signature, db):
                written += bool(db.put(prof))
            db.save()
        self.result = CalibrationReport(self._iteration, self.predicted_ms, measured, stages,
                                        written, tuple(int(getattr(s, "memory_bytes", 0))
                                                       for s in self.plan.stages))
        if rank0:
            line = self.result.line()
            (self._emit or log.warning)(line)


def install_calibration(plan: Plan, *, model_signature: str = "",
                        profile_db_path: str | None = None, warmup_iterations: int = 3,
                        measure_iterations: int = 5, wrap_train_step: bool = True,
                        emit: Callable[[str], None] | None = None) -> LiveCalibration:
    """Create and install a :class:`LiveCalibration` (see the module docstring)."""
    return LiveCalibration(plan, model_signature=model_signature,
                           profile_db_path=profile_db_path, warmup_iterations=warmup_iterations,
                           measure_iterations=measure_iterations, emit=emit
                           ).install(wrap_train_step)


def _rank() -> int:
    try:
        import torch.distributed as dist

        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    except ImportError:
        return 0


def _pp_rank() -> int:
    try:
        from megatron.core import parallel_state as ps

        return ps.get_pipeline_model_parallel_rank()
    except Exception:
        return 0


def _gather(mine: StageTiming | None) -> list[StageTiming]:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            out: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(out, mine)
            return [t for t in out if t is not None]
    except ImportError:
        pass
    return [mine] if mine is not None else []


