"""The op recorder on a real GPU / NPU stamps ops with device events (the host runs ahead of the
device, so the host clock around a call times its launches): fake events on a scripted device
clock, a host clock that runs ahead, and megatron-core's schedule functions replaced by stubs."""

from __future__ import annotations

import pytest

from poseidon_plugin.megatron.calibrate import calibration, recorder
from poseidon_plugin.megatron.calibrate.recorder import OpRecorder


class DeviceClock:
    """Device time (ms) advanced by the stub ops; events read it when recorded."""

    def __init__(self) -> None:
        self.ms = 0.0
        self.syncs = 0
        clock = self

        class Event:
            def __init__(self, enable_timing=False):
                assert enable_timing
                self.t = None

            def record(self):
                self.t = clock.ms

            def elapsed_time(self, other):
                assert self.t is not None and other.t is not None
                return other.t - self.t

            def synchronize(self):
                clock.syncs += 1

        self.Event = Event


def run_iterations(rec: OpRecorder, dev: DeviceClock, host: list, n: int, m: int,
                   f_ms: float, b_ms: float, tail_ms: float) -> None:
    """n iterations of m micro-batches (forwards then backwards); the device takes f/b ms per op
    and tail_ms after the last; the host takes 0.1 ms per call (it only launches)."""
    def fwd(step_func, data, model, *a, **k):
        dev.ms += f_ms
        host[0] += 1e-4
        return object()

    def bwd(input_tensor, output_tensor, grad, *a, **k):
        dev.ms += b_ms
        host[0] += 1e-4

    f, b = rec._wrap_forward(fwd), rec._wrap_backward(bwd)
    for _ in range(n):
        rec.begin_iteration()
        outs = [f(None, None, "model") for _ in range(m)]
        for o in outs:
            b(None, o, None)
        dev.ms += tail_ms
        rec.end_iteration()
        host[0] += 1e-3


def test_ops_carry_device_time_after_flush(monkeypatch):
    dev = DeviceClock()
    host = [100.0]
    monkeypatch.setattr(recorder, "clock", lambda: host[0])
    rec = OpRecorder(0, event_class=dev.Event)
    run_iterations(rec, dev, host, n=3, m=2, f_ms=4.0, b_ms=9.0, tail_ms=20.0)
    assert dev.syncs == 0          # nothing waits on the device while training runs
    rec.flush()
    assert dev.syncs == 1          # one synchronisation, when the records are read
    second = rec.iterations[1]
    # device time since the first iteration's start (46 ms per iteration), from the host origin
    assert second.start_s == pytest.approx(100.0 + 0.046)
    assert second.end_s == pytest.approx(100.0 + 0.092)
    durations = [(b, round((t1 - t0) * 1e3, 6)) for _, _, b, t0, t1 in second.ops]
    assert durations == [(False, 4.0), (False, 4.0), (True, 9.0), (True, 9.0)]
    # the same summary the calibration makes: per micro-batch 4 / 9 ms, a 20 ms tail
    t = calibration.stage_timing(rec, 0, skip=1)
    assert (t.forward_ms, t.backward_ms) == (pytest.approx(4.0), pytest.approx(9.0))
    assert t.tail_ms == pytest.approx(20.0) and t.iteration_ms == pytest.approx(46.0)
    rec.flush()
    assert dev.syncs == 1          # nothing left to resolve


def test_the_host_clock_times_launches_without_events(monkeypatch):
    """Without events (the CPU, emulated devices) the host clock is the device's: ops read the
    host's 0.1 ms here, which on a GPU would be the launch time, not the work."""
    dev = DeviceClock()
    host = [100.0]
    monkeypatch.setattr(recorder, "clock", lambda: host[0])
    rec = OpRecorder(0)
    run_iterations(rec, dev, host, n=2, m=2, f_ms=4.0, b_ms=9.0, tail_ms=20.0)
    rec.flush()
    durations = {round((t1 - t0) * 1e3, 6) for _, _, _, t0, t1 in rec.iterations[0].ops}
    assert durations == {0.1}


def test_now_on_the_device_clock_waits_for_the_queued_work(monkeypatch):
    dev = DeviceClock()
    host = [100.0]
    monkeypatch.setattr(recorder, "clock", lambda: host[0])
    rec = OpRecorder(0, event_class=dev.Event)
    assert rec.now_s() == 100.0    # no origin yet: the host clock
    run_iterations(rec, dev, host, n=1, m=1, f_ms=4.0, b_ms=9.0, tail_ms=7.0)
    syncs = dev.syncs
    assert rec.now_s() == pytest.approx(100.0 + 0.020) and dev.syncs == syncs + 1


def test_the_calibration_uses_device_events_only_on_a_real_device(monkeypatch):
    torch = pytest.importorskip("torch")
    from poseidon_plugin.megatron.emulate import emulation

    monkeypatch.setattr(emulation, "shims_installed", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delattr(torch, "npu", raising=False)
    assert calibration._device_event_class() is torch.cuda.Event
    monkeypatch.setattr(emulation, "shims_installed", lambda: True)
    assert calibration._device_event_class() is None
    monkeypatch.setattr(emulation, "shims_installed", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert calibration._device_event_class() is None
