"""Live calibration: predicted vs measured iteration time of a running job; the stage compute and
the per-iteration overhead fitted to its first iterations, checked against the later ones, and
written back to the profile cache.

API (the ``--poseidon-auto`` runner installs it after the plan is applied, before the script runs)::

    from poseidon_plugin.megatron.calibrate.calibration import install_calibration

    cal = install_calibration(
        plan,                                  # poseidon_plugin.plan.Plan
        model_signature=model.signature(),     # ProfileKey.model_signature of the run's model
        profile_db_path=cache_path,            # JSON ProfileDB; None = do not write back
        device_types=cluster.type_names,       # the overhead record's key (default: the plan's)
        warmup_iterations=1, calibrate_iterations=3, measure_iterations=3)

``install_calibration`` wraps ``megatron.training.training.train_step`` (looked up as a module
global by ``train()`` in megatron-core 0.19, so the wrapper is used; a framework loop that bound
it under its own module, MindSpeed-LLM's, is wrapped there too: :mod:`.train_step_hook`) and installs an
:class:`~poseidon_plugin.megatron.calibrate.recorder.OpRecorder` around megatron-core's ``forward_step`` /
``backward_step``. For a loop that calls megatron-core's ``get_forward_backward_func()`` itself,
call ``cal.begin_iteration()`` / ``cal.end_iteration()`` around each iteration instead (after
``cal.install(wrap_train_step=False)``, or use ``LiveCalibration`` directly).

Iterations, in order: ``warmup`` (not used: allocations, first-call costs), ``calibrate`` (the
fit), ``measure`` (the check); ``calibration_windows(train_iters)`` picks how many are recorded.
The warm-up is the least: :func:`choose_windows` extends it, from the recorded periods, until
they settle (within a band of the later median that widens with their noise), keeping at least
:data:`MIN_WINDOW` calibration and measured iterations; the report line says which iterations
were warm-up and why. At the start of the iteration after them (it closes the last one's
period), ONCE:

* every rank summarises its recorded iterations (:class:`StageTiming`: each iteration's period
  -- from its start to the next one's, so Megatron's work between ``train_step`` calls counts,
  as in its "elapsed time per iteration" -- and its forward and backward time per micro-batch,
  all chunks of the device summed); with ``torch.distributed`` up they are all-gathered so rank
  0 sees every stage; an iteration's measured time is the mean of its ranks' periods;
* rank 0 fits the plan to the *calibration* iterations (:mod:`poseidon_plugin.iteration_fit`:
  each stage's compute measured over planned, and the per-iteration overhead = what the
  iterations take beyond the simulated pipeline with that compute) and compares that
  re-prediction, and the plan's own prediction, with the mean of the *measured* iterations --
  never with the iterations it was fitted to;
* rank 0 logs one line on ``logging.getLogger("poseidon")`` (and returns it from
  :meth:`LiveCalibration.report`)::

      poseidon: calibration: iteration 7: predicted 452.1 ms, measured 590.3 ms (-23.4%) over
      iterations 5-7; re-predicted 583.0 ms (-1.2%) with the stage compute (s0 x1.02/x1.01,
      ...) and a per-iteration overhead of 131.2 ms fitted to iterations 2-4; per stage ...

* rank 0 writes back to the profile DB, fitted to every iteration after the warm-up
  (calibration and measured ones: the most data for the next plan): per-layer ``LayerProfile``
  records (``source="measured"``, ``layer_kind "decoder"``) -- the profiled record of the
  stage's (type, tp) scaled by the stage's measured / planned ratio, preferring stages that hold
  neither the embedding nor the output layer (without a profiled record: the stage's time over
  its layers) -- and the per-iteration overhead (:mod:`poseidon_plugin.overhead`,
  ``source="calibrated"``). Measured records beat estimated ones in ``ProfileDB``'s merge rule,
  and the cost model adds the overhead to every stage's post-pipeline term, so the next plan
  uses both. Activation / parameter bytes are kept from an existing record of the same key (0
  if none).

Nothing here changes the training; a failure inside calibration is logged and swallowed.
"""

from __future__ import annotations

import logging
import statistics
import textwrap
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Sequence

from poseidon_plugin.megatron.calibrate.recorder import OpRecorder

if TYPE_CHECKING:
    from poseidon_plugin.iteration_fit import IterationFit
    from poseidon_plugin.overhead import IterationOverhead
    from poseidon_plugin.plan import Plan
    from poseidon_plugin.profiles import LayerProfile, ProfileDB

log = logging.getLogger("poseidon")

FOLD_WIDTH = 100      # the calibration report's lines (rank 0's log): folded at this width,
FOLD_INDENT = "    "  # ... continuations indented so (tests/helpers: unfold) a reader joins them


@dataclass(frozen=True)
class StageTiming:
    stage: int
    forward_ms: float      # per micro-batch, whole device (all chunks): median, measured window
    backward_ms: float
    iteration_ms: float    # mean wall time of the measured iterations on this rank
    tail_ms: float = 0.0   # mean time from the stage's last op to the iteration's end (DP
    #                        all-reduce, optimizer step, per-iteration overheads)
    peak_memory_bytes: int = 0   # the device's peak allocated memory (0: not measurable)
    # every recorded iteration (warm-up included), in order: its period (from its start to the
    # next iteration's start: train_step and Megatron's work between steps, as Megatron's
    # "elapsed time per iteration"), and the forward and backward time per micro-batch (the sum
    # of the iteration's ops over its micro-batches)
    periods_ms: tuple[float, ...] = ()
    forward_mb_ms: tuple[float, ...] = ()
    backward_mb_ms: tuple[float, ...] = ()
    # the device memory this process holds outside PyTorch's allocator (CUDA/CANN context,
    # library workspaces, NCCL/HCCL buffers); 0: not measurable
    runtime_bytes: int = 0
    # what the caching allocator held beyond its peak allocation (max reserved - max allocated):
    # cached blocks it frees and retries with before an out-of-memory error
    cached_bytes: int = 0


@dataclass(frozen=True)
class CalibrationReport:
    iteration: int
    predicted_ms: float
    measured_ms: float
    stages: tuple[StageTiming, ...]
    profiles_written: int
    predicted_memory_bytes: tuple[int, ...] = ()   # the plan's per-stage peak memory
    check: IterationFit | None = None      # fitted to the calibration iterations
    written: IterationFit | None = None    # fitted to every iteration after the warm-up
    windows: tuple[tuple[int, int], ...] = ()   # 1-based (first, last) of calibration, measured
    overhead_written: bool = False
    predicted_reserve_bytes: tuple[int, ...] = ()  # the runtime reserve in each stage's peak
    warmup: WarmupChoice | None = None     # which leading iterations were warm-up, and why

    @property
    def error(self) -> float:
        return (self.predicted_ms - self.measured_ms) / self.measured_ms

    @property
    def repredicted_error(self) -> float | None:
        if self.check is None:
            return None
        return (self.check.predicted_ms - self.measured_ms) / self.measured_ms

    def line(self) -> str:
        per = ", ".join(f"s{t.stage} F {t.forward_ms:.1f}/B {t.backward_ms:.1f}"
                        f"/tail {t.tail_ms:.1f}" for t in self.stages)
        return (f"calibration: iteration {self.iteration}: predicted {self.predicted_ms:.1f} ms, "
                f"measured {self.measured_ms:.1f} ms ({100 * self.error:+.1f}%)"
                f"{self._over(1)}{self.refit_text()}; "
                f"per stage (ms per micro-batch): {per}; {self.memory_text()}; "
                f"{self.written_text()}")

    def folded(self, width: int = FOLD_WIDTH) -> str:
        """``line()`` folded at spaces into lines of at most ``width`` characters, each
        continuation indented by four spaces (``" ".join`` of the stripped lines gives
        ``line()`` back)."""
        return textwrap.fill(self.line(), width=width, subsequent_indent=FOLD_INDENT,
                             break_long_words=False, break_on_hyphens=False)

    def _range(self, i: int) -> str:
        """``iterations 2-4`` of window i (0: calibration, 1: measured); empty if unknown."""
        if len(self.windows) <= i:
            return ""
        a, b = self.windows[i]
        return f"iterations {a}-{b}" if b > a else f"iteration {a}"

    def _over(self, i: int) -> str:
        r = self._range(i)
        return f" over {r}" if r else ""

    def refit_text(self) -> str:
        """The re-prediction from the calibration iterations (empty without one)."""
        c = self.check
        if c is None:
            return ""
        err = self.repredicted_error
        return (f"; re-predicted {c.predicted_ms:.1f} ms ({100 * err:+.1f}%) with the stage "
                f"compute ({c.ratio_text()} of the plan's forward/backward) and a per-iteration "
                f"overhead of {c.overhead_ms:.1f} ms fitted to {self._range(0)}"
                f"{self.warmup_text()}")

    def warmup_text(self) -> str:
        """`` after a warm-up of iterations 1-5 (...)``; empty without a warm-up choice."""
        w = self.warmup
        if w is None or w.iterations <= 0:
            return ""
        r = f"iterations 1-{w.iterations}" if w.iterations > 1 else "iteration 1"
        return f" after a warm-up of {r} ({w.reason})"

    def written_text(self) -> str:
        text = f"{self.profiles_written} measured profile record(s)"
        if self.overhead_written and self.written is not None:
            text += (f" and the per-iteration overhead ({self.written.overhead_ms:.1f} ms, "
                     f"{self.written.iterations} iterations) written")
        else:
            text += " written"
        return text

    def memory_text(self) -> str:
        """Predicted vs measured peak memory per stage, like for like: the allocator's peak (the
        prediction less its runtime reserve vs ``max_memory_allocated``) and, where the device
        says how much it holds, the reserve (stated vs measured) and the device's peak."""
        gib = float(1 << 30)
        parts = []
        for t in self.stages:
            if t.peak_memory_bytes <= 0 or t.stage >= len(self.predicted_memory_bytes):
                continue
            total = self.predicted_memory_bytes[t.stage]
            reserve = (self.predicted_reserve_bytes[t.stage]
                       if t.stage < len(self.predicted_reserve_bytes) else 0)
            alloc, peak = total - reserve, t.peak_memory_bytes
            text = (f"s{t.stage} predicted {alloc / gib:.2f} GiB, measured {peak / gib:.2f} GiB "
                    f"({100 * (alloc - peak) / peak:+.1f}%)")
            if t.runtime_bytes > 0:
                held = peak + t.runtime_bytes
                text += (f", runtime reserve stated {reserve / gib:.2f} GiB, measured "
                         f"{t.runtime_bytes / gib:.2f} GiB outside the allocator (which cached "
                         f"{t.cached_bytes / gib:.2f} GiB more at its peak, freed before an "
                         f"out-of-memory error), on the device predicted {total / gib:.2f} GiB, "
                         f"measured {held / gib:.2f} GiB ({100 * (total - held) / held:+.1f}%)")
            parts.append(text)
        if not parts:
            return "peak memory not measurable on this device"
        return "peak memory allocated " + "; ".join(parts)


def _per_microbatch(ops, is_bwd: bool) -> float:
    """The iteration's forward (or backward) op time per micro-batch (ms; chunks summed)."""
    sel = [(mb, t1 - t0) for _, mb, b, t0, t1 in ops if b == is_bwd]
    mbs = {mb for mb, _ in sel}
    return 1e3 * sum(d for _, d in sel) / len(mbs) if mbs else 0.0


def stage_timing(recorder: OpRecorder, stage: int, skip: int,
                 next_start_s: float | None = None) -> StageTiming | None:
    """This rank's summary: medians per micro-batch and mean wall / tail of the iterations after
    ``skip``; every recorded iteration's period (``next_start_s``: the start of the iteration
    after the last recorded one; without it the last period is its wall time) and
    per-micro-batch forward / backward time."""
    recorder.flush()
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
    every = recorder.iterations
    starts = [it.start_s for it in every[1:]] + [
        next_start_s if next_start_s is not None else every[-1].end_s]
    peak, runtime, cached = _device_memory()
    return StageTiming(stage, statistics.median(fwd) * 1e3 if fwd else 0.0,
                       statistics.median(bwd) * 1e3 if bwd else 0.0, wall * 1e3,
                       statistics.fmean(tails) * 1e3 if tails else 0.0, peak,
                       tuple(1e3 * (nxt - it.start_s) for it, nxt in zip(every, starts)),
                       tuple(_per_microbatch(it.ops, False) for it in every),
                       tuple(_per_microbatch(it.ops, True) for it in every), runtime, cached)


def _device_event_class() -> Any:
    """The timing events of this rank's real GPU / NPU (None under CPU emulation or without
    one): the recorder stamps the ops with them (see :mod:`.recorder`)."""
    from poseidon_plugin.megatron.emulate import emulation

    if emulation.shims_installed():
        return None
    try:
        import torch

        npu = getattr(torch, "npu", None)
        if npu is not None and npu.is_available():
            return npu.Event
        if torch.cuda.is_available():
            return torch.cuda.Event
    except Exception:  # noqa: BLE001 - no device runtime
        pass
    return None


def _device_memory() -> tuple[int, int, int]:
    """(peak allocated, runtime, cached) bytes of this rank's CUDA / NPU device (see
    :class:`StageTiming`); zeros on the CPU, emulated devices included. The runtime bytes are
    the device's used memory (``mem_get_info``) outside the allocator's current reserve (0 when
    the device does not say; another process on the same device would count as this one's)."""
    from poseidon_plugin.megatron.emulate import emulation

    if emulation.shims_installed():
        return 0, 0, 0
    try:
        import torch

        for mod in (getattr(torch, "npu", None), torch.cuda):
            if mod is None or not mod.is_available():
                continue
            peak = int(mod.max_memory_allocated())
            cached = max(0, int(mod.max_memory_reserved()) - peak)
            try:
                free, total = mod.mem_get_info()
                runtime = max(0, (int(total) - int(free)) - int(mod.memory_reserved()))
            except Exception:  # noqa: BLE001 - a runtime without mem_get_info
                runtime = 0
            return peak, runtime, cached
    except Exception:  # noqa: BLE001 - no device runtime
        pass
    return 0, 0, 0


def _resummarise(t: StageTiming, first: int) -> StageTiming:
    """``t`` with its forward / backward (median per micro-batch) and iteration time (mean
    period) over iterations ``first`` on (0-based) of its per-iteration times."""
    f, b, p = t.forward_mb_ms[first:], t.backward_mb_ms[first:], t.periods_ms[first:]
    return replace(t, forward_ms=statistics.median(f) if f else t.forward_ms,
                   backward_ms=statistics.median(b) if b else t.backward_ms,
                   iteration_ms=statistics.fmean(p) if p else t.iteration_ms)


def iteration_times(timings: Sequence[StageTiming]) -> list[float]:
    """Each recorded iteration's measured time: the mean of its ranks' periods (ranks meet in
    every iteration's collectives, so over a window their periods agree; one rank starting an
    iteration late shortens its next one). Iterations some rank did not record are dropped."""
    n = min((len(t.periods_ms) for t in timings), default=0)
    return [statistics.fmean(t.periods_ms[k] for t in timings) for k in range(n)]


def window_compute(timings: Sequence[StageTiming], first: int, stop: int
                   ) -> dict[int, tuple[float, float]]:
    """Per stage: the mean forward and backward time per micro-batch over iterations
    ``[first, stop)`` (0-based) and the stage's DP replicas."""
    acc: dict[int, tuple[list[float], list[float]]] = {}
    for t in timings:
        f, b = acc.setdefault(t.stage, ([], []))
        f.extend(t.forward_mb_ms[first:stop])
        b.extend(t.backward_mb_ms[first:stop])
    return {s: (statistics.fmean(f), statistics.fmean(b)) for s, (f, b) in acc.items() if f and b}


def fit_window(plan: Plan, timings: Sequence[StageTiming], first: int, stop: int
               ) -> IterationFit | None:
    """:func:`poseidon_plugin.iteration_fit.fit_iteration` of iterations ``[first, stop)``; None
    when a stage or the iterations are missing."""
    from poseidon_plugin.iteration_fit import fit_iteration

    comp = window_compute(timings, first, stop)
    walls = iteration_times(timings)[first:stop]
    n = len(plan.stages)
    if not walls or any(s not in comp for s in range(n)):
        return None
    return fit_iteration(plan, [comp[s][0] for s in range(n)], [comp[s][1] for s in range(n)],
                         walls)


def measured_profiles(plan: Plan, stage_compute: dict[int, tuple[float, float]],
                      model_signature: str, existing: ProfileDB | None = None
                      ) -> list[LayerProfile]:
    """Per-layer measured ``LayerProfile``s, one per (device type, tp) of the plan, from each
    stage's measured forward / backward per micro-batch (``stage_compute[s]``): the existing
    decoder record scaled by the stage's measured / planned ratio where the DB has one and the
    plan its stage time, else the stage's time over its layers; stages holding neither the
    embedding nor the output layer preferred."""
    from poseidon_plugin.profiles import LayerProfile, ProfileKey
    from poseidon_plugin.training import TrainingSetup
    from poseidon_plugin.megatron.profile.profile_gather import quantize_ms

    setup = TrainingSetup.from_dict(getattr(plan, "training", None)).profile_fields
    n = len(plan.stages)
    # a CP plan's records are a CP rank's: seq / CP (the launch profiles them so)
    seq = int(plan.seq_length) // int(getattr(plan, "cp", 1) or 1)
    groups: dict[tuple[str, int], list[tuple[bool, float, float]]] = {}
    for i, st in enumerate(plan.stages):
        if i not in stage_compute or st.layers <= 0:
            continue
        f_meas, b_meas = stage_compute[i]
        key = ProfileKey(st.device_type, "decoder", int(st.tp), int(plan.micro_batch_size),
                         seq, model_signature, **setup)
        old = existing.get(key) if existing is not None else None
        f_plan, b_plan = getattr(st, "forward_ms", 0.0), getattr(st, "backward_ms", 0.0)
        if old is not None and f_plan > 0 and b_plan > 0:
            f, b = old.forward_ms * f_meas / f_plan, old.backward_ms * b_meas / b_plan
        else:
            f, b = f_meas / st.layers, b_meas / st.layers
        groups.setdefault((st.device_type, int(st.tp)), []).append((0 < i < n - 1, f, b))
    out = []
    for (dtype, tp), rows in sorted(groups.items()):
        pick = [r for r in rows if r[0]] or rows
        key = ProfileKey(dtype, "decoder", tp, int(plan.micro_batch_size), seq,
                         model_signature, **setup)
        old = existing.get(key) if existing is not None else None
        out.append(LayerProfile(
            key, quantize_ms(statistics.median(r[1] for r in pick)),
            quantize_ms(statistics.median(r[2] for r in pick)),
            old.activation_bytes if old else 0, old.param_bytes if old else 0, "measured",
            old.env if old else (), old.optimizer_ms if old else 0.0))
    return out


def overhead_record(plan: Plan, fit: IterationFit, model_signature: str,
                    device_types: Sequence[str], first: int, last: int) -> IterationOverhead:
    """The fitted per-iteration overhead as a ``calibrated`` record (iterations 1-based)."""
    from poseidon_plugin.overhead import IterationOverhead, overhead_key
    from poseidon_plugin.training import TrainingSetup

    setup = TrainingSetup.from_dict(getattr(plan, "training", None)).profile_fields
    tps = sorted({int(s.tp) for s in plan.stages})
    on = (f"{plan.schedule}" + (f" V={plan.virtual_stages}" if plan.virtual_stages > 1 else "")
          + f" pp={len(plan.stages)} dp={plan.dp} tp={','.join(map(str, tps))} "
          f"mbs={plan.micro_batch_size} m={plan.num_microbatches}, iterations {first}-{last}")
    return IterationOverhead(overhead_key(model_signature, int(plan.seq_length), device_types,
                                          setup), round(fit.overhead_ms, 3), "calibrated", on)


class LiveCalibration:
    """Times iterations, reports once, writes measured profiles (see the module docstring)."""

    def __init__(self, plan: Plan, *, model_signature: str = "", profile_db_path: str | None = None,
                 warmup_iterations: int = 1, calibrate_iterations: int = 3,
                 measure_iterations: int = 3, stage: int | None = None,
                 device_types: Sequence[str] | None = None,
                 emit: Callable[[str], None] | None = None, layer_records: bool = True) -> None:
        self.plan = plan
        self.model_signature = model_signature
        # a model of several layer kinds: a stage's time mixes the kinds, and its per-kind
        # records (keyed by each kind's signature) are the launch's measurements; no per-layer
        # write-back under the whole model's signature
        self.layer_records = bool(layer_records)
        self.profile_db_path = profile_db_path
        self.warmup = int(warmup_iterations)
        self.calibrate = int(calibrate_iterations)
        self.measure = int(measure_iterations)
        self.device_types = tuple(device_types) if device_types else tuple(
            sorted({s.device_type for s in plan.stages}))
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
        self.recorder = OpRecorder(stage, event_class=_device_event_class())
        self._rec_ctx = self.recorder.installed(None)
        self._rec_ctx.__enter__()
        self._undo.append(lambda: self._rec_ctx.__exit__(None, None, None))
        if wrap_train_step:
            from poseidon_plugin.megatron.calibrate.train_step_hook import wrap_train_step as wrap

            self._undo.append(wrap(self.begin_iteration, lambda _: self.end_iteration()))
        return self

    def uninstall(self) -> None:
        while self._undo:
            self._undo.pop()()

    # -- per iteration -------------------------------------------------------------------------
    def begin_iteration(self) -> None:
        if self.result is not None or self.recorder is None:
            return
        if self._iteration >= self.warmup + self.calibrate + self.measure:
            # the start of the next iteration closes the last one's period: report now
            try:
                self._finish(self.recorder.now_s())
            except Exception as exc:  # never break the training
                log.warning("calibration failed: %s", exc)
                self.result = CalibrationReport(self._iteration, self.predicted_ms, float("nan"),
                                                (), 0)
            finally:
                self.uninstall()
            return
        if self.stage is None:  # Megatron's parallel state exists once training runs
            self.recorder.stage = _pp_rank()
        self.recorder.begin_iteration()

    def end_iteration(self) -> None:
        if self.result is not None or self.recorder is None \
                or self.recorder._current is None:
            return
        self.recorder.end_iteration()
        self._iteration += 1

    def report(self) -> CalibrationReport | None:
        return self.result

    # -- the one-time report -------------------------------------------------------------------
    def _finish(self, next_start_s: float) -> None:
        mine = stage_timing(self.recorder, self.recorder.stage, self.warmup + self.calibrate,
                            next_start_s)
        timings = _gather(mine)
        rank0 = _rank() == 0
        walls = iteration_times(timings)
        # the warm-up adapts to the recorded periods (every rank gathered the same ones)
        w, c, _, choice = choose_windows(walls, self.warmup, self.calibrate, self.measure)
        measured = statistics.fmean(walls[w + c:]) if walls[w + c:] else float("nan")
        if w + c != self.warmup + self.calibrate:
            # the measured window moved: the per-stage summary over it, from the per-iteration
            # times (the tail stays the configured window's)
            timings = [_resummarise(t, w + c) for t in timings]
        # one timing per stage (DP replicas of a stage: keep the first)
        per_stage: dict[int, StageTiming] = {}
        for t in timings:
            kept = per_stage.setdefault(t.stage, t)
            if t.peak_memory_bytes > kept.peak_memory_bytes:  # the stage's largest replica
                per_stage[t.stage] = replace(kept, peak_memory_bytes=t.peak_memory_bytes,
                                             runtime_bytes=t.runtime_bytes,
                                             cached_bytes=t.cached_bytes)
        stages = tuple(per_stage[s] for s in sorted(per_stage))
        check = written = None
        profiles_written, overhead_written = 0, False
        if rank0 and c > 0:
            check = fit_window(self.plan, timings, w, w + c)
            written = fit_window(self.plan, timings, w, len(walls))
        if rank0 and self.profile_db_path:
            from poseidon_plugin.profiles import ProfileDB

            db = ProfileDB(self.profile_db_path)
            comp = window_compute(timings, w, len(walls))
            for prof in (measured_profiles(self.plan, comp, self.model_signature, db)
                         if self.layer_records else ()):
                profiles_written += bool(db.put(prof))
            if written is not None:
                overhead_written = db.put_overhead(overhead_record(
                    self.plan, written, self.model_signature, self.device_types, w + 1,
                    len(walls)))
            db.save()
        self.result = CalibrationReport(
            self._iteration, self.predicted_ms, measured, stages, profiles_written,
            tuple(int(getattr(s, "memory_bytes", 0)) for s in self.plan.stages), check, written,
            ((w + 1, w + c), (w + c + 1, len(walls))), overhead_written,
            tuple(int(dict(getattr(s, "memory_parts", ())).get("reserve_bytes", 0) or 0)
                  for s in self.plan.stages), choice)
        if rank0:
            (self._emit or log.warning)(self.result.folded())


MAX_WINDOW = 10   # calibration / measured iterations at most (a long run reports early)

# The adaptive warm-up (see :func:`choose_windows`).
MIN_WINDOW = 2        # calibration and measured iterations at least, after any warm-up
WARMUP_BAND = 0.10    # a settled period is at most the later median x (1 + this) ...
WARMUP_SIGMAS = 2.0   # ... or the later median + this many robust deviations, the larger
WARMUP_CONFIRM = 3    # the warm-up ends where this many periods' median is settled too


@dataclass(frozen=True)
class WarmupChoice:
    """The warm-up :func:`choose_windows` picked: ``iterations`` leading ones (1-based 1..n)."""
    iterations: int
    reason: str


def choose_windows(periods: Sequence[float], warmup: int, calibrate: int, measure: int
                   ) -> tuple[int, int, int, WarmupChoice]:
    """(warm-up, calibration, measured) iteration counts for the recorded ``periods`` (ms, in
    order; ``warmup + calibrate + measure`` of them as configured), and why.

    The configured warm-up is the least. The reference is the median of the later half of the
    periods after it, and a period is *settled* when it is at most that median plus a band: the
    larger of :data:`WARMUP_BAND` of the median and :data:`WARMUP_SIGMAS` robust deviations
    (1.4826 x the median absolute deviation) of the later half, so a noisy steady state widens
    the band instead of pushing the warm-up on. The warm-up ends at the first iteration that is
    settled and whose next :data:`WARMUP_CONFIRM` periods have a settled median (one faster
    iteration inside a slow warm-up does not end it; a single slow one later does not extend
    it). Faster-than-steady iterations never count as warm-up (one-sided band). The warm-up
    leaves at least :data:`MIN_WINDOW` calibration and measured iterations. The measured window
    stays the configured one (the last ``measure``) while the calibration window keeps at least
    :data:`MIN_WINDOW` iterations; otherwise what follows the warm-up is split in two, the
    measured half the larger. A run too short to adapt keeps the configured windows."""
    n = len(periods)
    w0, c0, m0 = int(warmup), int(calibrate), int(measure)
    if n < w0 + c0 + m0 or c0 <= 0 or m0 <= 0:
        return w0, c0, m0, WarmupChoice(w0, "fixed: too few iterations recorded")
    latest = n - 2 * MIN_WINDOW     # the longest warm-up that keeps both windows
    after = [float(p) for p in periods[w0:]]
    later = after[len(after) // 2:]
    if latest <= w0 or len(later) < 3:
        return w0, c0, m0, WarmupChoice(w0, "fixed: too few iterations to adapt")
    ref = statistics.median(later)
    mad = statistics.median(abs(p - ref) for p in later)
    band = max(WARMUP_BAND * ref, WARMUP_SIGMAS * 1.4826 * mad)
    top = ref + band
    k = w0
    while k < latest:
        nxt = [float(p) for p in periods[k:k + WARMUP_CONFIRM]]
        if float(periods[k]) <= top and statistics.median(nxt) <= top:
            break
        k += 1
    settled = (f"periods settle at or below {top:.1f} ms: the later median {ref:.1f} ms "
               f"+ {100 * band / ref:.0f}%")
    if k == w0:
        reason = f"as configured; {settled} from iteration {k + 1}"
    elif k < latest or float(periods[k]) <= top:
        reason = f"adaptive: {settled} from iteration {k + 1}"
    else:
        reason = (f"adaptive, cut short: not settled at or below {top:.1f} ms by iteration "
                  f"{k}, the latest that leaves {MIN_WINDOW} calibration and measured ones")
    if n - m0 - k >= MIN_WINDOW:      # the measured window stays the configured one
        return k, n - m0 - k, m0, WarmupChoice(k, reason)
    c = (n - k) // 2
    return k, c, n - k - c, WarmupChoice(k, reason)


def calibration_windows(train_iters: int | None) -> tuple[int, int, int]:
    """(warm-up, calibration, measured) iterations for a run of ``train_iters``: one warm-up,
    then all but the last iteration (whose start closes the measured ones' periods) split in
    two (the measured half the larger), each at most :data:`MAX_WINDOW`; (1, 3, 3) when the
    count is unknown or below 4."""
    if not train_iters or train_iters < 4:
        return 1, 3, 3
    rest = min(int(train_iters) - 2, 2 * MAX_WINDOW)
    return 1, rest // 2, rest - rest // 2


def install_calibration(plan: Plan, *, model_signature: str = "",
                        profile_db_path: str | None = None, warmup_iterations: int = 1,
                        calibrate_iterations: int = 3, measure_iterations: int = 3,
                        device_types: Sequence[str] | None = None, wrap_train_step: bool = True,
                        emit: Callable[[str], None] | None = None,
                        layer_records: bool = True) -> LiveCalibration:
    """Create and install a :class:`LiveCalibration` (see the module docstring)."""
    return LiveCalibration(plan, model_signature=model_signature,
                           profile_db_path=profile_db_path, warmup_iterations=warmup_iterations,
                           calibrate_iterations=calibrate_iterations,
                           measure_iterations=measure_iterations, device_types=device_types,
                           emit=emit, layer_records=layer_records).install(wrap_train_step)


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


