"""Live calibration on synthetic recordings (no training loop needed): the per-rank summary, the
fit to the calibration iterations, the check against the later ones, the write-back."""

from __future__ import annotations

from dataclasses import replace

from types import SimpleNamespace

import pytest

from poseidon_plugin.megatron.calibrate import calibration
from poseidon_plugin.megatron.calibrate.calibration import (CalibrationReport, LiveCalibration,
                                                  StageTiming, iteration_times,
                                                  measured_profiles, stage_timing,
                                                  window_compute)
from poseidon_plugin.megatron.calibrate.recorder import IterationRecord, OpRecorder
from poseidon_plugin.overhead import overhead_key
from poseidon_plugin.plan import Plan, StagePlan
from poseidon_plugin.profiles import LayerProfile, ProfileDB, ProfileKey
from poseidon_plugin.simulator.pipeline import iteration_time_ms


def _plan():
    st = lambda i, t, layers: SimpleNamespace(index=i, device_type=t, tp=1, layers=layers)
    return SimpleNamespace(stages=(st(0, "A", 2), st(1, "A", 4), st(2, "B", 3), st(3, "B", 3)),
                           micro_batch_size=1, seq_length=128, predicted_iteration_time_ms=50.0)


def _stage(i, t, layers, f, b, ar=1.0, opt=0.5):
    return StagePlan(index=i, device_type=t, tp=1, dp=1, layers=layers, forward_ms=f,
                     backward_ms=b, send_forward_ms=0.2 if i == 0 else 0.0,
                     send_backward_ms=0.2 if i == 0 else 0.0, allreduce_ms=ar,
                     memory_bytes=1, memory_capacity_bytes=2, optimizer_ms=opt)


def real_plan(m=4) -> Plan:
    """A two-stage 1f1b plan (stage 0: 3 layers of A, stage 1: 1 layer of B)."""
    stages = (_stage(0, "A", 3, 6.0, 12.0), _stage(1, "B", 1, 4.0, 8.0))
    p = Plan(schedule="1f1b", virtual_stages=1, dp=1, micro_batch_size=1, num_microbatches=m,
             global_batch_size=m, seq_length=128, stages=stages, predicted_iteration_time_ms=0.0)
    return Plan(**{**p.__dict__, "predicted_iteration_time_ms": p.rederived_iteration_time_ms()})


def _fill(rec: OpRecorder, iterations: int, f_s: float, b_s: float, m: int = 4):
    for i in range(iterations):
        t = 10.0 * i
        it = IterationRecord(rec.stage, start_s=t)
        for mb in range(m):
            it.ops.append((0, mb, False, t, t + f_s))
            t += f_s
        for mb in range(m):
            it.ops.append((0, mb, True, t, t + b_s))
            t += b_s
        it.end_s = it.start_s + 0.05
        rec.iterations.append(it)


def test_stage_timing_medians_and_every_iteration():
    rec = OpRecorder(1)
    _fill(rec, 5, 0.004, 0.008)       # iterations start every 10 s and last 50 ms
    t = stage_timing(rec, 1, skip=2, next_start_s=45.0)
    assert t.forward_ms == pytest.approx(4.0) and t.backward_ms == pytest.approx(8.0)
    assert t.iteration_ms == pytest.approx(50.0)
    # every recorded iteration, the skipped ones too: its period (start to the next start; the
    # last one closed by next_start_s), forward / backward per micro-batch
    assert t.periods_ms == pytest.approx((1e4, 1e4, 1e4, 1e4, 5e3))
    assert stage_timing(rec, 1, skip=2).periods_ms[-1] == pytest.approx(50.0)   # wall fallback
    assert t.forward_mb_ms == pytest.approx((4.0,) * 5)
    assert t.backward_mb_ms == pytest.approx((8.0,) * 5)
    assert stage_timing(OpRecorder(0), 0, skip=0) is None


def test_chunks_of_a_device_add_up_per_micro_batch():
    rec = OpRecorder(0)
    it = IterationRecord(0, start_s=0.0, end_s=1.0)
    for chunk in (0, 1):   # interleaved: two chunks, two micro-batches
        for mb in (0, 1):
            it.ops.append((chunk, mb, False, 0.0, 0.003))
            it.ops.append((chunk, mb, True, 0.0, 0.005))
    rec.iterations.append(it)
    t = stage_timing(rec, 0, skip=0)
    assert t.forward_mb_ms == pytest.approx((6.0,)) and t.backward_mb_ms == pytest.approx((10.0,))


def test_an_iterations_time_is_its_ranks_mean_period():
    a = StageTiming(0, 1, 1, 1, periods_ms=(10.0, 30.0, 20.0), forward_mb_ms=(1, 2, 3),
                    backward_mb_ms=(2, 4, 6))
    b = StageTiming(1, 1, 1, 1, periods_ms=(12.0, 26.0), forward_mb_ms=(5, 5),
                    backward_mb_ms=(7, 9))
    assert iteration_times([a, b]) == [11.0, 28.0]          # the shorter record bounds the list
    c = StageTiming(0, 1, 1, 1, periods_ms=(10.0, 30.0), forward_mb_ms=(3, 4),
                    backward_mb_ms=(6, 8))
    comp = window_compute([a, b, c], 1, 2)                  # iteration 2, replicas averaged
    assert comp[0] == pytest.approx((3.0, 6.0)) and comp[1] == pytest.approx((5.0, 9.0))


def test_measured_profiles_scale_the_profiled_record_by_the_stage_ratio():
    plan = real_plan()
    db = ProfileDB()
    key_a = ProfileKey("A", "decoder", 1, 1, 128, "sig")
    db.put(LayerProfile(key_a, 1.8, 3.6, 111, 222, "measured", optimizer_ms=0.3))
    # stage 0 ran its forward 1.5x and its backward 0.5x as long as planned (6 / 12 ms)
    profs = {p.key.device_type: p for p in
             measured_profiles(plan, {0: (9.0, 6.0), 1: (8.0, 8.0)}, "sig", db)}
    assert profs["A"].forward_ms == pytest.approx(2.7, rel=0.011)      # 1.8 x 1.5 (2 % grid)
    assert profs["A"].backward_ms == pytest.approx(1.8, rel=0.011)     # 3.6 x 0.5
    assert (profs["A"].activation_bytes, profs["A"].optimizer_ms) == (111, 0.3)
    # no profiled record of B: the stage's time over its layers
    assert profs["B"].forward_ms == pytest.approx(8.0, rel=0.011) and profs["B"].source == "measured"


def test_measured_profiles_prefer_inner_stages():
    comp = {0: (10.0, 20.0), 1: (8.0, 16.0), 2: (9.0, 18.0), 3: (12.0, 24.0)}
    profs = {p.key.device_type: p for p in measured_profiles(_plan(), comp, "sig", ProfileDB())}
    assert profs["A"].forward_ms == pytest.approx(2.0, rel=0.011)      # stage 1: 8 ms / 4 layers
    assert profs["B"].backward_ms == pytest.approx(6.0, rel=0.011)     # stage 2: 18 ms / 3 layers


def _run(cal: LiveCalibration, plan: Plan, per_iteration) -> None:
    """Drive ``cal`` through iterations whose stage compute is planned x ``ratio`` and whose
    wall time is the re-timed plan + ``extra`` ms, per ``per_iteration(i) -> (ratio, extra)``;
    the recorder of stage 0 stands in for every rank (timings of both stages are faked)."""
    from poseidon_plugin.iteration_fit import retimed_ms
    from poseidon_plugin.megatron.calibrate import recorder

    now = [100.0]
    saved = recorder.clock
    recorder.clock = lambda: now[0]
    try:
        for i in range(cal.warmup + cal.calibrate + cal.measure):
            ratio, extra = per_iteration(i)
            cal.begin_iteration()
            it = cal.recorder._current
            t = it.start_s
            for mb in range(plan.num_microbatches):
                it.ops.append((0, mb, False, t, t + ratio * plan.stages[0].forward_ms / 1e3))
                it.ops.append((0, mb, True, t, t + ratio * plan.stages[0].backward_ms / 1e3))
            now[0] += (retimed_ms(plan, (ratio, ratio), (ratio, ratio)) + extra) / 1e3
            cal.end_iteration()
        cal.begin_iteration()         # the next iteration's start closes the last period
    finally:
        recorder.clock = saved


@pytest.fixture
def both_stages(monkeypatch):
    """_gather returns this rank's timing for stage 0 and a copy for stage 1 (same ratios)."""
    from poseidon_plugin.megatron.calibrate import calibration

    def fake_gather(mine):
        plan = real_plan()
        scale = plan.stages[1].forward_ms / plan.stages[0].forward_ms
        bscale = plan.stages[1].backward_ms / plan.stages[0].backward_ms
        other = StageTiming(1, mine.forward_ms * scale, mine.backward_ms * bscale,
                            mine.iteration_ms, periods_ms=mine.periods_ms,
                            forward_mb_ms=tuple(x * scale for x in mine.forward_mb_ms),
                            backward_mb_ms=tuple(x * bscale for x in mine.backward_mb_ms))
        return [mine, other]

    monkeypatch.setattr(calibration, "_gather", fake_gather)


def test_overhead_fitted_to_the_calibration_iterations_predicts_the_later_ones(tmp_path,
                                                                               both_stages):
    plan = real_plan()
    path = str(tmp_path / "profiles.json")
    lines = []
    cal = LiveCalibration(plan, model_signature="sig", profile_db_path=path, warmup_iterations=1,
                          calibrate_iterations=3, measure_iterations=4, stage=0,
                          device_types=["B", "A"], emit=lines.append)
    cal.recorder = OpRecorder(0)     # as install() would, without patching megatron
    # warm-up: 3x slower; afterwards compute 1.2x the plan's and 25 ms of overhead per iteration
    _run(cal, plan, lambda i: (3.0, 200.0) if i == 0 else (1.2, 25.0))
    assert len(lines) == 1
    # logged folded (short lines, continuations indented); unfolded, the one report line
    assert all(len(ln) <= calibration.FOLD_WIDTH for ln in lines[0].splitlines())
    assert len(lines[0].splitlines()) > 1
    lines = [" ".join(ln.strip() for ln in lines[0].splitlines())]
    rep = cal.report()
    assert lines[0] == rep.line()
    assert rep.windows == ((2, 4), (5, 8))
    assert rep.check.fwd_ratio == pytest.approx((1.2, 1.2))
    assert rep.check.overhead_ms == pytest.approx(25.0, abs=1e-6)
    assert rep.check.predicted_ms == pytest.approx(rep.measured_ms, rel=1e-6)
    assert rep.error == pytest.approx(plan.predicted_iteration_time_ms / rep.measured_ms - 1)
    assert "over iterations 5-8" in lines[0] and "fitted to iterations 2-4" in lines[0]
    assert "re-predicted" in lines[0] and "(+0.0%)" in lines[0]
    # written back: the overhead (all iterations after the warm-up) and the measured layers
    db = ProfileDB.load(path)
    over = db.get_overhead(overhead_key("sig", 128, ["A", "B"],
                                        {"dtype": "bf16", "attention": "flash",
                                         "recompute": "none"}))
    assert over.source == "calibrated" and over.overhead_ms == pytest.approx(25.0, abs=1e-6)
    assert "1f1b pp=2 dp=1 tp=1 mbs=1 m=4, iterations 2-8" == over.calibrated_on
    rec = db.get(ProfileKey("A", "decoder", 1, 1, 128, "sig"))
    assert rec.source == "measured" and rec.forward_ms == pytest.approx(2.4, rel=0.011)
    assert rep.profiles_written == 2 and rep.overhead_written
    assert "per-iteration overhead (25.0 ms, 7 iterations) written" in lines[0]


def test_the_check_never_sees_the_measured_iterations(both_stages):
    """The later iterations get 60 ms more overhead: the re-prediction, fitted to iterations
    2-4 only, must miss them by exactly that (a fit that peeked would not)."""
    plan = real_plan()
    cal = LiveCalibration(plan, stage=0, emit=lambda line: None, measure_iterations=4)
    cal.recorder = OpRecorder(0)
    _run(cal, plan, lambda i: (1.0, 10.0 if i < 4 else 70.0))
    rep = cal.report()
    assert rep.check.overhead_ms == pytest.approx(10.0, abs=1e-6)
    assert rep.measured_ms - rep.check.predicted_ms == pytest.approx(60.0, abs=1e-6)
    assert rep.repredicted_error < -0.05


def test_a_failed_calibration_reports_nan_and_uninstalls(monkeypatch):
    from poseidon_plugin.megatron.calibrate import calibration

    def boom(_):
        raise RuntimeError("gather failed")

    monkeypatch.setattr(calibration, "_gather", boom)
    cal = LiveCalibration(real_plan(), stage=0, warmup_iterations=0, calibrate_iterations=1,
                          measure_iterations=1, emit=lambda line: None)
    cal.recorder = OpRecorder(0)
    for _ in range(3):
        cal.begin_iteration()
        if cal.recorder._current is not None:
            cal.recorder._current.ops.append((0, 0, False, 0.0, 0.001))
        cal.end_iteration()
    assert cal.report().measured_ms != cal.report().measured_ms   # nan
    assert not cal._undo


def test_report_line_compares_peak_memory_per_stage():
    gib = 1 << 30
    rep = CalibrationReport(8, 100.0, 110.0, (StageTiming(0, 1.0, 2.0, 110.0, 5.0, 2 * gib),
                                              StageTiming(1, 1.0, 2.0, 110.0, 5.0, 0)),
                            1, (int(1.9 * gib), gib))
    line = rep.line()
    assert "allocated s0 predicted 1.90 GiB, measured 2.00 GiB (-5.0%)" in line
    assert "s1 predicted" not in line          # not measured there
    assert "tail 5.0" in line and "(-9.1%)" in line
    assert "re-predicted" not in line          # no calibration window
    cpu = CalibrationReport(8, 100.0, 100.0, (StageTiming(0, 1.0, 2.0, 100.0),), 0, (gib,))
    assert "peak memory not measurable" in cpu.line()


def test_peak_memory_is_compared_like_for_like():
    """The prediction's runtime reserve is not in ``max_memory_allocated``: the allocator's peak
    is compared with the prediction less the reserve, and the device's peak (allocated plus the
    measured runtime bytes) with the whole prediction."""
    gib = 1 << 30
    st = StageTiming(0, 1.0, 2.0, 110.0, 5.0, int(23.5 * gib), runtime_bytes=int(1.5 * gib),
                     cached_bytes=6 * gib)
    rep = CalibrationReport(8, 100.0, 110.0, (st,), 1, (25 * gib,),
                            predicted_reserve_bytes=(2 * gib,))
    text = rep.memory_text()
    assert text.startswith("peak memory allocated s0 predicted 23.00 GiB, measured 23.50 GiB "
                           "(-2.1%)")
    assert ("runtime reserve stated 2.00 GiB, measured 1.50 GiB outside the allocator (which "
            "cached 6.00 GiB more at its peak, freed before an out-of-memory error), on the "
            "device predicted 25.00 GiB, measured 25.00 GiB (+0.0%)") in text
    # without a device reading of the runtime bytes: the allocated comparison alone
    bare = CalibrationReport(8, 100.0, 110.0, (replace(st, runtime_bytes=0),), 1, (25 * gib,),
                             predicted_reserve_bytes=(2 * gib,))
    assert "runtime reserve" not in bare.memory_text() and "(-2.1%)" in bare.memory_text()


def test_device_memory_reads_the_allocator_and_the_device(monkeypatch):
    torch = pytest.importorskip("torch")
    from poseidon_plugin.megatron.calibrate import calibration
    from poseidon_plugin.megatron.emulate import emulation

    gib = 1 << 30
    monkeypatch.setattr(emulation, "shims_installed", lambda: False)
    monkeypatch.delattr(torch, "npu", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 20 * gib)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda *a: 21 * gib)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: 19 * gib)
    # 80 GiB device, 59.5 free: 20.5 used, of which 19 in the allocator's reserve
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (int(59.5 * gib), 80 * gib))
    # outside the allocator 1.5 GiB; cached beyond the peak allocation 1 GiB
    assert calibration._device_memory() == (20 * gib, int(1.5 * gib), gib)
    monkeypatch.setattr(emulation, "shims_installed", lambda: True)
    assert calibration._device_memory() == (0, 0, 0)


def test_retimed_plan_without_its_overhead_matches_the_simulator():
    from poseidon_plugin.iteration_fit import fit_iteration, retimed_ms

    plan = real_plan(m=6)
    F, B, Pf, Pb, R = plan.simulator_inputs()
    want = iteration_time_ms(F * [2.0, 1.0], B * [1.0, 3.0], Pf, Pb, R, 6, "1f1b", 1)
    assert retimed_ms(plan, (2.0, 1.0), (1.0, 3.0)) == pytest.approx(want)
    fit = fit_iteration(plan, [12.0, 4.0], [12.0, 24.0], [want + 5.0, want + 9.0, want + 7.0])
    assert fit.fwd_ratio == pytest.approx((2.0, 1.0)) and fit.bwd_ratio == pytest.approx((1.0, 3.0))
    assert fit.overhead_ms == pytest.approx(7.0) and fit.predicted_ms == pytest.approx(want + 7)
    # a plan that already carries an overhead is re-timed without it
    with_over = Plan(**{**plan.__dict__, "stages": tuple(
        StagePlan(**{**s.__dict__, "overhead_ms": 40.0}) for s in plan.stages)})
    assert retimed_ms(with_over, (2.0, 1.0), (1.0, 3.0)) == pytest.approx(want)


def test_fit_refuses_missing_stages_and_iterations():
    from poseidon_plugin.errors import PoseidonError
    from poseidon_plugin.iteration_fit import fit_iteration

    with pytest.raises(PoseidonError, match="one forward and backward time per stage"):
        fit_iteration(real_plan(), [1.0], [1.0], [10.0])
    with pytest.raises(PoseidonError, match="no measured iteration"):
        fit_iteration(real_plan(), [1.0, 1.0], [1.0, 1.0], [])


def test_overhead_never_negative():
    from poseidon_plugin.iteration_fit import fit_iteration

    plan = real_plan()
    fit = fit_iteration(plan, [6.0, 4.0], [12.0, 8.0], [1.0, 2.0])   # faster than simulated
    assert fit.overhead_ms == 0.0


def test_windows_follow_the_run_length():
    from poseidon_plugin.megatron.calibrate.calibration import calibration_windows

    # one warm-up; the last iteration's start closes the measured periods
    assert calibration_windows(8) == (1, 3, 3)        # fit 2-4, check 5-7, report at 8's start
    assert calibration_windows(16) == (1, 7, 7)
    assert calibration_windows(100000) == (1, 10, 10)
    assert calibration_windows(None) == calibration_windows(3) == (1, 3, 3)


# -- the adaptive warm-up ----------------------------------------------------------------------
# the H100 MoE run of docs/fidelity.md (run.log, "elapsed time per iteration", iterations 1-19)
MOE_H100_PERIODS = [2911.3, 1947.8, 922.4, 857.3, 771.7, 647.2, 729.5, 582.6, 644.8, 493.4,
                    477.6, 556.5, 604.9, 648.3, 594.0, 623.3, 550.7, 710.8, 545.4]


def test_a_steady_run_keeps_the_configured_windows():
    from poseidon_plugin.megatron.calibrate.calibration import choose_windows

    w, c, m, why = choose_windows([900.0] + [100.0, 101.0, 99.0] * 6, 1, 9, 9)
    assert (w, c, m) == (1, 9, 9) and why.iterations == 1 and "as configured" in why.reason


def test_the_long_decaying_warm_up_of_the_h100_moe_run_is_skipped():
    from poseidon_plugin.megatron.calibrate.calibration import choose_windows

    w, c, m, why = choose_windows(MOE_H100_PERIODS, 1, 9, 9)
    # iterations 1-5 (2911 .. 772 ms) are warm-up; 6-10 calibrate; the measured 11-19 stay
    assert (w, c, m) == (5, 5, 9) and why.iterations == 5
    assert "adaptive" in why.reason and "from iteration 6" in why.reason


def test_a_noisy_steady_state_does_not_push_the_warm_up_on():
    """Periods as noisy as the MoE run's steady state (477-711 ms), a spike late in the run and
    a fast outlier inside it: only the first (slow) iteration is warm-up."""
    from poseidon_plugin.megatron.calibrate.calibration import choose_windows

    steady = [600.0, 480.0, 700.0, 550.0, 711.0, 477.0, 640.0, 590.0, 520.0, 300.0,
              610.0, 560.0, 1500.0, 600.0, 530.0, 650.0, 580.0, 620.0]
    w, c, m, why = choose_windows([2500.0] + steady, 1, 9, 9)
    assert (w, c, m) == (1, 9, 9)
    # one fast iteration inside a slow warm-up does not end it
    w, _, _, _ = choose_windows([2500.0, 1500.0, 500.0, 1400.0, 1300.0] + steady[:14], 1, 9, 9)
    assert w == 5


def test_a_warm_up_that_never_settles_keeps_minimum_windows():
    from poseidon_plugin.megatron.calibrate.calibration import MIN_WINDOW, choose_windows

    # still slow when the latest warm-up that leaves both windows is reached
    w, c, m, why = choose_windows([1000.0, 900.0, 800.0, 700.0, 150.0, 100.0, 100.0], 1, 3, 3)
    assert (w, c, m) == (7 - 2 * MIN_WINDOW, MIN_WINDOW, MIN_WINDOW)
    assert "cut short" in why.reason
    # still falling steadily: the band widens with the later half's spread; both windows kept
    w, c, m, why = choose_windows([1000.0 - 40.0 * i for i in range(19)], 1, 9, 9)
    assert w + c + m == 19 and min(c, m) >= MIN_WINDOW and 1 < w < 19 - 2 * MIN_WINDOW
    # a warm-up past the configured calibration start: what follows it split in two
    w, c, m, _ = choose_windows([900.0, 800.0, 700.0, 100.0, 100.0, 101.0, 100.0], 1, 3, 3)
    assert (w, c, m) == (3, 2, 2)


def test_a_run_too_short_to_adapt_keeps_the_configured_windows():
    from poseidon_plugin.megatron.calibrate.calibration import choose_windows

    assert choose_windows([900.0, 100.0, 100.0], 1, 1, 1)[:3] == (1, 1, 1)
    w, c, m, why = choose_windows([900.0, 800.0, 700.0, 100.0], 1, 3, 3)   # too few recorded
    assert (w, c, m) == (1, 3, 3) and "fixed" in why.reason


def test_the_report_line_names_the_warm_up(both_stages):
    """A 3-iteration warm-up (far slower) inside a configured (1, 3, 4): the fit skips it and the
    line says which iterations were warm-up; the rest split: calibration 4-5, measured 6-8."""
    plan = real_plan()
    lines = []
    cal = LiveCalibration(plan, stage=0, emit=lines.append, warmup_iterations=1,
                          calibrate_iterations=3, measure_iterations=4)
    cal.recorder = OpRecorder(0)
    _run(cal, plan, lambda i: (3.0, 400.0 - 100.0 * i) if i < 3 else (1.2, 25.0))
    rep = cal.report()
    assert rep.windows == ((4, 5), (6, 8)) and rep.warmup.iterations == 3
    assert rep.check.overhead_ms == pytest.approx(25.0, abs=1e-6)
    assert rep.written.overhead_ms == pytest.approx(25.0, abs=1e-6)
    assert "fitted to iterations 4-5 after a warm-up of iterations 1-3 (adaptive" in unfold(lines[0])


def unfold(text: str) -> str:
    """The calibration report's one line from its folded log lines."""
    return " ".join(ln.strip() for ln in text.splitlines())


def test_report_is_folded_into_short_lines_that_join_back():
    """The calibration report (600+ characters in the demo) is logged folded: every line at
    most FOLD_WIDTH characters, continuations indented, and joined back it is ``line()``."""
    gib = 1 << 30
    rep = CalibrationReport(15, 646.5, 2976.7, (StageTiming(0, 3.6, 3.21, 179.8, 277.9, 2 * gib),
                                                StageTiming(1, 0.74, 0.67, 20.6, 516.7, 0)),
                            2, (int(1.9 * gib), gib))
    assert len(rep.line()) > 2 * calibration.FOLD_WIDTH
    lines = rep.folded().splitlines()
    assert len(lines) >= 3 and all(len(ln) <= calibration.FOLD_WIDTH for ln in lines)
    assert lines[0].startswith("calibration: iteration 15: predicted 646.5 ms")
    assert all(ln.startswith(calibration.FOLD_INDENT) for ln in lines[1:])
    assert " ".join(ln.strip() for ln in lines) == rep.line()
