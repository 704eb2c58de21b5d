"""Live calibration on synthetic recordings (no training loop needed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from poseidon_plugin.megatron.calibration import (LiveCalibration, measured_profiles,
                                                  stage_timing)
from poseidon_plugin.megatron.recorder import IterationRecord, OpRecorder
from poseidon_plugin.profiles import LayerProfile, ProfileDB, ProfileKey


def _plan():
    st = lambda i, t, layers: SimpleNamespace(index=i, device_type=t, tp=1, layers=layers)
    return SimpleNamespace(stages=(st(0, "A", 2), st(1, "A", 4), st(2, "B", 3), st(3, "B", 3)),
                           micro_batch_size=1, seq_length=128, predicted_iteration_time_ms=50.0)


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


def test_stage_timing_medians():
    rec = OpRecorder(1)
    _fill(rec, 5, 0.004, 0.008)
    t = stage_timing(rec, 1, skip=2)
    assert t.forward_ms == pytest.approx(4.0) and t.backward_ms == pytest.approx(8.0)
    assert t.iteration_ms == pytest.approx(50.0)
    assert stage_timing(OpRecorder(0), 0, skip=0) is None


def test_measured_profiles_prefer_inner_stages():
    from poseidon_plugin.megatron.calibration import StageTiming

    timings = [StageTiming(0, 10.0, 20.0, 50), StageTiming(1, 8.0, 16.0, 50),
               StageTiming(2, 9.0, 18.0, 50), StageTiming(3, 12.0, 24.0, 50)]
    old = ProfileDB()
    key_a = ProfileKey("A", "decoder", 1, 1, 128, "sig")
    old.put(LayerProfile(key_a, 1.0, 2.0, 111, 222, "estimated"))
    profs = {p.key.device_type: p for p in measured_profiles(_plan(), timings, "sig", old)}
    assert profs["A"].forward_ms == pytest.approx(2.0)          # stage 1: 8 ms / 4 layers
    assert profs["B"].backward_ms == pytest.approx(6.0)         # stage 2: 18 ms / 3 layers
    assert profs["A"].activation_bytes == 111 and profs["A"].source == "measured"


def test_live_calibration_reports_once_and_writes_db(tmp_path):
    path = str(tmp_path / "profiles.json")
    lines = []
    cal = LiveCalibration(_plan(), model_signature="sig", profile_db_path=path,
                          warmup_iterations=2, measure_iterations=3, stage=1, emit=lines.append)
    cal.recorder = OpRecorder(1)      # as install() would, without patching megatron
    _fill(cal.recorder, 0, 0, 0)
    for i in range(7):
        cal.begin_iteration()
        it = cal.recorder._current
        if it is None:                # done after warm-up + measured iterations
            cal.end_iteration()
            continue
        it.start_s -= 0.06           # a 60 ms iteration
        it.ops += [(0, 0, False, it.start_s, it.start_s + 0.004),
                   (0, 0, True, it.start_s + 0.004, it.start_s + 0.012)]
        cal.end_iteration()
    assert len(lines) == 1
    rep = cal.report()
    assert rep.measured_ms == pytest.approx(60.0, rel=0.05)
    assert rep.error == pytest.approx(50.0 / rep.measured_ms - 1)
    assert "predicted 50.0 ms" in lines[0] and "measured" in lines[0]
    db = ProfileDB.load(path)
    rec = db.get(ProfileKey("A", "decoder", 1, 1, 128, "sig"))
    assert rec.source == "measured" and rec.forward_ms == pytest.approx(1.0)
    assert rep.profiles_written == 1


def test_report_line_compares_peak_memory_per_stage():
    from poseidon_plugin.megatron.calibration import CalibrationReport, StageTiming

    gib = 1 << 30
    rep = CalibrationReport(8, 100.0, 110.0, (StageTiming(0, 1.0, 2.0, 110.0, 5.0, 2 * gib),
                                              StageTiming(1, 1.0, 2.0, 110.0, 5.0, 0)),
                            1, (int(1.9 * gib), gib))
    line = rep.line()
    assert "s0 predicted 1.90 GiB, measured 2.00 GiB (-5.0%)" in line
    assert "s1 predicted" not in line          # not measured there
    assert "tail 5.0" in line and "(-9.1%)" in line
    cpu = CalibrationReport(8, 100.0, 100.0, (StageTiming(0, 1.0, 2.0, 100.0),), 0, (gib,))
    assert "peak memory not measurable" in cpu.line()
