"""Stable profiling: the sampling rule (fake measurements and an injected clock), the turns ranks
of a host take, the 2% time grid, and the same plan from two launches' measurements."""

from __future__ import annotations

import itertools
import math

import pytest

from poseidon_plugin.cluster import load_cluster
from poseidon_plugin.megatron.profile import profile_gather as G
from poseidon_plugin.megatron.profile.profiler import Aggregate
from poseidon_plugin.megatron.profile.sampling import (SamplingPolicy, median_ci, reject_outliers,
                                               rel_half_width, sample)
from poseidon_plugin.model import get_model
from poseidon_plugin.profiles import ProfileDB
from poseidon_plugin.search import SearchOptions, search_plan


class FakeClock:
    """Advances ``step`` seconds per reading."""

    def __init__(self, step: float = 0.0) -> None:
        self.t, self.step = 0.0, step

    def __call__(self) -> float:
        self.t += self.step
        return self.t


def series(values):
    it = iter(values)
    return lambda: next(it)


# --------------------------------------------------------------------------- statistics

def test_reject_outliers_drops_a_far_sample_only():
    xs = [10.0, 10.1, 9.9, 10.05, 9.95, 10.0, 30.0]
    assert reject_outliers(xs) == xs[:-1]
    assert reject_outliers([5.0] * 6 + [9.0]) == [5.0] * 6 + [9.0]   # MAD 0: keep everything


def test_median_ci_order_statistics():
    assert median_ci([1.0] * 5) is None
    xs = list(range(1, 101))
    lo, hi = median_ci(xs)
    assert lo < 50.5 < hi
    assert (lo, hi) == (40, 61)   # x_(j), x_(k): j = floor(50 - 9.8), k = ceil(1 + 50 + 9.8)


def test_sample_stops_as_soon_as_the_ci_is_narrow():
    pol = SamplingPolicy(warmup=2, min_reps=8, max_reps=50, max_seconds=1e9)
    calls = []

    def measure():
        calls.append(1)
        return (10.0, 20.0)

    res = sample(measure, pol, FakeClock())
    assert res.converged and res.samples == 8 and len(calls) == 2 + 8
    assert res.medians == (10.0, 20.0)


def test_sample_keeps_going_while_noisy_then_caps():
    pol = SamplingPolicy(warmup=0, min_reps=8, max_reps=30, max_seconds=1e9)
    noisy = itertools.cycle([(5.0,), (15.0,), (10.0,)])
    res = sample(lambda: next(noisy), pol, FakeClock())
    assert not res.converged and res.samples == 30
    assert res.rel_half_width[0] > pol.rel_ci


def test_sample_stops_at_the_time_cap():
    pol = SamplingPolicy(warmup=0, min_reps=8, max_reps=1000, max_seconds=10.0)
    noisy = itertools.cycle([(5.0,), (15.0,)])
    res = sample(lambda: next(noisy), pol, FakeClock(step=1.0))
    assert not res.converged and res.samples < 20


def test_sample_median_ignores_an_outlier():
    pol = SamplingPolicy(warmup=0, min_reps=9, max_reps=9)
    vals = [(10.0,)] * 4 + [(500.0,)] + [(10.2,)] * 4
    res = sample(series(vals), pol, FakeClock())
    assert res.rejected == (1,) and res.medians[0] == pytest.approx(10.1)


def test_backward_below_forward_is_measured_again():
    from poseidon_plugin.megatron.profile.profiler import sample_until_plausible

    pol = SamplingPolicy(warmup=0, min_reps=6, max_reps=6)
    first = [(10.0, 5.0)] * 6          # backward 0.5 x forward: implausible
    second = [(10.0, 19.0)] * 6
    res, retries = sample_until_plausible(series(first + second), pol, clock=FakeClock())
    assert retries == 1 and res.medians == (10.0, 19.0)
    res, retries = sample_until_plausible(series([(10.0, 5.0)] * 12), pol, clock=FakeClock())
    assert retries == 1 and res.medians == (10.0, 5.0)   # kept after the one retry
    res, retries = sample_until_plausible(series(second), pol, clock=FakeClock())
    assert retries == 0


def test_rel_half_width_undefined_is_infinite():
    assert math.isinf(rel_half_width([1.0, 2.0]))


# --------------------------------------------------------------------------- turns

def test_ranks_of_a_host_measure_in_turns():
    from poseidon_plugin.megatron.profile.profiler import Turns, _in_turns

    log: list[tuple[int, str]] = []
    for local_rank in range(4):      # four ranks of one host, TP 2: two turns
        ran = []
        _in_turns(Turns(local_rank, 4), 2, "p", lambda n: log.append((local_rank, n)),
                  lambda: ran.append(local_rank))
        assert ran == [local_rank]
    names = [n for r, n in log if r == 0]
    assert names == ["p-turn0", "p-turn1", "p-turns-done"]   # every rank passes every barrier
    assert Turns(3, 4).of(1) == (3, 4) and Turns(3, 4).of(2) == (1, 2)
    assert _in_turns(None, 1, "p", None, lambda: 7) == 7


def test_body_runs_between_its_turns_barriers():
    from poseidon_plugin.megatron.profile.profiler import Turns, _in_turns

    events: list[str] = []
    _in_turns(Turns(1, 2), 1, "p", events.append, lambda: events.append("body"))
    assert events == ["p-turn0", "p-turn1", "body", "p-turns-done"]


# --------------------------------------------------------------------------- the 2% grid

def test_quantize_is_a_geometric_grid():
    q = G.quantize_ms
    assert q(0.0) == 0.0
    for x in (0.013, 1.0, 3.7, 250.0):
        assert abs(q(x) - x) / x <= 0.0101           # within half a step
        assert q(q(x)) == q(x)                         # grid points are fixed
    assert q(1.0) == 1.0 and q(1.02) == 1.02 and q(1.009) == 1.0 and q(1.011) == 1.02


def _aggs(noise: float):
    """Two device types' measured layers; ``noise`` multiplies every time (a second launch)."""
    out = []
    for name, f, b in (("fast", 2.0, 4.0), ("slow", 8.0, 16.0)):
        for tp in (1, 2):
            for mbs in (1, 2):
                scale = mbs / tp * (1 + noise)
                out.append(Aggregate(name, tp, mbs, f * scale, b * scale, 1 << 20, 1 << 20, 2,
                                     optimizer_ms=0.5 * (1 + noise) / tp))
    return out


def _plan(noise: float):
    cluster, model = load_cluster("examples/clusters/small-two-type.yaml"), \
        get_model("examples/models/tiny-gpt.yaml")
    db = ProfileDB(None)
    for rec in G.measured_records(_aggs(noise), 128, model.signature()):
        db.put(rec)
    return search_plan(cluster, model, SearchOptions(global_batch_size=16, seq_length=128,
                                                     workers=1, micro_batch_sizes=(1, 2),
                                                     tp_degrees=(1, 2)), db)


def test_two_launches_plan_the_same():
    """The planning step twice from the same measurements gives the same bytes; measurements
    that differ by less than the grid's half-step (here +-0.4%) give the same plan too."""
    a, b = _plan(0.0), _plan(0.0)
    assert _identity(a) == _identity(b)
    for noise in (-0.004, 0.004):
        assert _identity(_plan(noise)) == _identity(a)


def _identity(plan) -> dict:
    """The plan's JSON without the search statistics (they hold the search's wall time)."""
    d = plan.to_dict()
    d.pop("search")
    return d


def test_measured_records_carry_the_optimizer_step_on_the_grid():
    recs = G.measured_records(_aggs(0.003), 128, "sig")
    assert {r.optimizer_ms for r in recs} == {G.quantize_ms(0.5), G.quantize_ms(0.25)}
    assert all(r.forward_ms == G.quantize_ms(r.forward_ms) for r in recs)


def test_optimizer_ms_round_trips_and_is_optional(tmp_path):
    from poseidon_plugin.profiles import LayerProfile, ProfileKey, profile_to_record

    key = ProfileKey("fast", "decoder", 1, 1, 128, "sig")
    with_opt = LayerProfile(key, 1.0, 2.0, 3, 4, "measured", optimizer_ms=0.75)
    without = LayerProfile(ProfileKey("fast", "decoder", 2, 1, 128, "sig"), 1.0, 2.0, 3, 4,
                           "measured")
    assert "optimizer_ms" not in profile_to_record(without)
    db = ProfileDB(None)
    db.put(with_opt)
    db.put(without)
    path = str(tmp_path / "db.json")
    db.save(path)
    back = ProfileDB.load(path)
    assert back.get(with_opt.key).optimizer_ms == 0.75
    assert back.get(without.key).optimizer_ms == 0.0


def test_main_grad_hooks_accumulate_like_megatrons_ddp():
    torch = pytest.importorskip("torch")
    from poseidon_plugin.megatron.profile.profiler import attach_main_grads

    layer = torch.nn.Linear(4, 3)
    hooks = attach_main_grads(layer)
    x = torch.ones(2, 4)
    layer(x).sum().backward()
    layer(x).sum().backward()
    assert layer.weight.grad is None and layer.weight.main_grad.dtype == torch.float32
    assert torch.allclose(layer.weight.main_grad, torch.full((3, 4), 4.0))   # 2 passes x 2 rows
    layer.bias.grad_added_to_main_grad = True      # a fused kernel already accumulated
    before = layer.bias.main_grad.clone()
    layer(x).sum().backward()
    assert torch.equal(layer.bias.main_grad, before) and layer.bias.grad_added_to_main_grad is False
    for h in hooks:
        h.remove()


def test_tensor_parallel_ranks_stop_sampling_together():
    """Two ranks of a TP group (simulated in lockstep): one converges at 8 samples, the other is
    noisy; with ``agree`` (any rank stops -> all stop) both take the same number of samples."""
    pol = SamplingPolicy(warmup=0, min_reps=8, max_reps=30, max_seconds=1e9)
    quiet = iter([(10.0,)] * 100)
    noisy = itertools.cycle([(5.0,), (15.0,), (10.0,)])
    votes: list[bool] = []

    def agree(flag: bool) -> bool:       # rank "noisy" asks; rank "quiet" would say stop
        votes.append(flag)
        return flag or len(votes) >= 1   # the quiet rank converged from its 8th sample on

    res = sample(lambda: next(noisy), pol, FakeClock(), agree)
    assert res.samples == 8 and not res.converged
    alone = sample(lambda: next(quiet), pol, FakeClock())
    assert alone.samples == 8


def test_remeasure_decision_is_shared_by_the_group():
    from poseidon_plugin.megatron.profile.profiler import sample_until_plausible

    pol = SamplingPolicy(warmup=0, min_reps=6, max_reps=6)
    plausible = [(10.0, 19.0)] * 12
    # this rank's backward looks fine, another rank of the group asks for a re-measurement
    res, retries = sample_until_plausible(series(plausible), pol, clock=FakeClock(),
                                          agree=lambda flag: True)
    assert retries == 1
    res, retries = sample_until_plausible(series(plausible), pol, clock=FakeClock(),
                                          agree=lambda flag: flag)
    assert retries == 0


def test_emulated_clock_rules():
    from poseidon_plugin.megatron.profile.profiler import EmulatedClock

    # TP 1: the emulated device needs factor x the CPU time (descheduled time does not count)
    assert EmulatedClock(4.0, 1).ms(wall_s=0.009, cpu_s=0.002) == pytest.approx(8.0)
    # TP > 1: the wait in the all-reduces (wall - cpu) is added, not slowed
    assert EmulatedClock(4.0, 2).ms(wall_s=0.005, cpu_s=0.002) == pytest.approx(5.0 + 6.0)
    assert EmulatedClock(1.0, 1).ms(wall_s=0.005, cpu_s=0.002) == pytest.approx(2.0)


def test_timed_step_uses_the_emulated_clock(monkeypatch):
    torch = pytest.importorskip("torch")
    from poseidon_plugin.megatron.profile import profiler

    wall = iter([0.0, 0.010, 0.030])   # forward 10 ms, backward 20 ms of wall time
    cpu = iter([0.0, 0.002, 0.006])    # of which 2 ms and 4 ms on this process's CPU
    monkeypatch.setattr(profiler, "_WALL", lambda: next(wall))
    monkeypatch.setattr(profiler, "_CPU", lambda: next(cpu))

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, hidden_states):
            return self.lin(hidden_states)

    x = torch.ones(2, 4, requires_grad=True)
    f, b = profiler._timed_step(Layer(), x, {}, torch.ones(2, 4), torch.device("cpu"),
                                profiler.EmulatedClock(4.0, 1))
    assert (f, b) == (pytest.approx(8.0), pytest.approx(16.0))


def test_emulated_clock_scales_the_compute_by_the_host_share(monkeypatch):
    """Ranks profiled in turns train together: their compute shares the host's cores and takes
    ``share`` x as long; the emulation's padding is a sleep (no core needed) and is not scaled."""
    torch = pytest.importorskip("torch")
    from poseidon_plugin.megatron.profile import profiler

    alone = profiler.EmulatedClock(3.0, 1)
    shared = profiler.EmulatedClock(3.0, 1, share=1.5)
    assert alone.ms(0.5, 0.01) == pytest.approx(30.0)                # 3 x 10 ms of CPU
    assert shared.ms(0.5, 0.01) == pytest.approx((1.5 + 2.0) * 10.0)  # compute x1.5 + 2 x padding
    tp2 = profiler.EmulatedClock(3.0, 2, share=1.5)
    assert tp2.ms(0.02, 0.01) == pytest.approx((1.5 * 0.02 + 2.0 * 0.01) * 1e3)
    # the fixed rule (the fallback without a TP-1 layer to measure with)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert profiler.host_share() == pytest.approx(2.0)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert profiler.host_share() == 1.0


class FakeDeviceEvents:
    """A device-event class on a fake device clock: each ``record()`` reads the next time (ms)
    of a shared script; ``synchronize()`` is counted."""

    def __init__(self, times):
        self.times = iter(times)
        self.recorded: list = []
        self.syncs = 0
        outer = self

        class Event:
            def __init__(self, enable_timing=False):
                assert enable_timing
                self.t = None

            def record(self):
                self.t = next(outer.times)
                outer.recorded.append(self)

            def elapsed_time(self, other):
                return other.t - self.t

            def synchronize(self):
                outer.syncs += 1

        self.Event = Event


def tiny_layer(torch, calls):
    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, hidden_states):
            calls.append("f")
            return self.lin(hidden_states)

    return Layer()


def test_device_timing_runs_micro_batches_back_to_back_after_a_lead_one(monkeypatch):
    """On a GPU / NPU a sample is k forward/backward pairs between device events, after one
    untimed micro-batch, synchronised once: per micro-batch forward and backward are the mean
    event gaps."""
    torch = pytest.importorskip("torch")
    from poseidon_plugin.megatron.profile import profiler

    # 3 micro-batches: (fwd, bwd) = (2, 5), (3, 6), (4, 7) ms; the events are contiguous
    times = [0.0, 2.0, 7.0, 7.0, 10.0, 16.0, 16.0, 20.0, 27.0]
    fake = FakeDeviceEvents(times)
    calls: list = []
    x = torch.ones(2, 4, requires_grad=True)
    f, b = profiler._back_to_back_step(tiny_layer(torch, calls), x, {}, torch.ones(2, 4),
                                       torch.device("cpu"), fake.Event, k=3)
    assert (f, b) == (pytest.approx(3.0), pytest.approx(6.0))
    assert len(calls) == 4             # the lead micro-batch + 3 timed, one forward each
    assert len(fake.recorded) == 9 and fake.syncs == 1
    assert x.grad is None              # each backward's input gradient is dropped


def test_time_layer_uses_device_events_on_a_device_and_the_clock_on_the_cpu(monkeypatch):
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace

    from poseidon_plugin.megatron.profile import profiler

    seen = []
    monkeypatch.setattr(profiler, "_layer_inputs", lambda c, v, d: (
        torch.ones(2, 4, requires_grad=True), {}, torch.ones(2, 4)))
    monkeypatch.setattr(profiler, "_activation_bytes", lambda *a: 0)
    monkeypatch.setattr(profiler, "tp_group_any", lambda d: None)
    monkeypatch.setattr(profiler, "_back_to_back_step",
                        lambda *a, **k: seen.append("events") or (1.0, 2.0))
    monkeypatch.setattr(profiler, "_timed_step",
                        lambda *a, **k: seen.append("clock") or (1.0, 2.0))
    vargs = SimpleNamespace(tensor_model_parallel_size=1)
    monkeypatch.setattr(profiler, "device_event_class", lambda d: object)
    profiler.time_layer(None, None, vargs, torch.device("cpu"), 8)
    assert set(seen) == {"events"} and len(seen) >= 8
    seen.clear()
    monkeypatch.setattr(profiler, "device_event_class", lambda d: None)
    profiler.time_layer(None, None, vargs, torch.device("cpu"), 8)
    assert set(seen) == {"clock"}


def test_device_event_class_is_none_on_the_cpu():
    torch = pytest.importorskip("torch")
    from poseidon_plugin.megatron.profile import profiler

    assert profiler.device_event_class(torch.device("cpu")) is None


def test_the_optimizer_step_runs_megatrons_own_norm_clip_and_copy(monkeypatch):
    """With megatron-core's multi-tensor functions the timed step is Megatron's sequence:
    l2 norm of the fp32 grads, clipping by that norm (max 1), Adam, the copy back to the bf16
    parameters."""
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace

    from poseidon_plugin.megatron.profile import profiler

    calls = []

    def applier(op, buf, lists, *args):
        return op(buf, lists, *args)

    def l2(buf, lists, per_tensor):
        calls.append(("norm", len(lists[0])))
        return torch.sqrt(sum((g.float() ** 2).sum() for g in lists[0])).reshape(1), None

    def clip(params, max_norm, total):
        calls.append(("clip", max_norm, round(float(total), 6)))

    def copy(this, that, overflow_buf):
        calls.append(("copy", len(this), this[0].dtype, that[0].dtype))
        for a, b in zip(this, that):
            b.copy_(a)

    fake = SimpleNamespace(multi_tensor_applier=applier, l2_norm_impl=l2,
                           clip_grad_by_total_norm_fp32=clip, multi_tensor_scale_tensor_impl=None)
    monkeypatch.setattr(profiler, "megatron_step_functions", lambda: (fake, copy))

    class Adam(torch.optim.AdamW):
        def step(self, closure=None):
            calls.append(("adam",))
            return super().step(closure)

    monkeypatch.setattr(profiler, "_megatron_adam", lambda: Adam)
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 8).to(torch.bfloat16)
    res = profiler.time_optimizer_step(layer, torch.device("cpu"), 8)
    assert res.samples >= 8
    first = calls[:4]
    assert [c[0] for c in first] == ["norm", "clip", "adam", "copy"]
    assert first[0] == ("norm", 2)                        # weight and bias
    assert first[1][1] == 1.0 and first[1][2] > 0         # clipped by the norm just computed
    assert first[3] == ("copy", 2, torch.float32, torch.bfloat16)


def test_an_early_megatron_copy_without_the_multi_tensor_kernel_is_not_used(monkeypatch):
    """Early megatron-core copied main to model parameters in a plain loop
    (``_multi_tensor_copy_this_to_that(this, that)``): the profiler then times plain torch ops."""
    pytest.importorskip("megatron.core")
    import megatron.core.optimizer.optimizer as opt_mod

    from poseidon_plugin.megatron.profile import profiler

    assert profiler.megatron_step_functions() is not None     # 0.19: the kernel path
    monkeypatch.setattr(opt_mod, "_multi_tensor_copy_this_to_that",
                        lambda this, that: None)
    assert profiler.megatron_step_functions() is None


# --------------------------------------------------------------------------- device warm-up
def test_settle_stops_when_two_consecutive_readings_agree():
    from poseidon_plugin.megatron.profile.sampling import settle

    # falling first readings (one-time costs), then two within 5 %: 4 untimed calls
    readings = [(9.0, 3.0), (5.0, 4.0), (3.6, 4.6), (3.5, 4.7), (3.5, 4.7)]
    calls = []
    res = settle(lambda: calls.append(1) or readings[len(calls) - 1], 0.05, 40, 10.0,
                 clock=FakeClock())
    assert res.readings == 4 == len(calls) and res.agreed and res.last == (3.5, 4.7)
    # every quantity must agree: a backward still moving keeps it going
    res = settle(series([(3.5, 9.0), (3.5, 6.0), (3.5, 5.0), (3.5, 5.1)]), 0.05, 40, 10.0,
                 clock=FakeClock())
    assert res.readings == 4 and res.agreed


def test_settle_is_bounded_in_count_and_time():
    from poseidon_plugin.megatron.profile.sampling import settle

    alternating = itertools.cycle([(1.0, 2.0), (2.0, 1.0)])
    res = settle(lambda: next(alternating), 0.05, 7, 1e9, clock=FakeClock())
    assert res.readings == 7 and not res.agreed
    res = settle(lambda: next(alternating), 0.05, 1000, 10.0, clock=FakeClock(step=1.0))
    # the clock advances 1 s per reading: the first read starts it, the 10th call sees 10 s
    assert res.readings == 10 and not res.agreed
    # the ranks of a group stop together: another rank's stop ends this rank's warm-up
    votes = []
    res = settle(lambda: next(alternating), 0.05, 1000, 1e9, clock=FakeClock(),
                 agree=lambda stop: votes.append(stop) or len(votes) >= 3)
    assert res.readings == 3 and votes == [False, False, False]


def test_the_first_configuration_gets_the_longer_device_warm_up(monkeypatch):
    from poseidon_plugin.megatron.profile import profiler

    monkeypatch.setattr(profiler, "_settled_devices", set())
    never = itertools.cycle([(1.0, 2.0), (2.0, 1.0)])
    first = profiler.settle_device(lambda: next(never), "cuda:0", clock=FakeClock())
    later = profiler.settle_device(lambda: next(never), "cuda:0", clock=FakeClock())
    other = profiler.settle_device(lambda: next(never), "cuda:1", clock=FakeClock())
    assert first.readings == profiler.SETTLE_FIRST[0] == other.readings
    assert later.readings == profiler.SETTLE_LATER[0] < first.readings


def test_the_first_configuration_is_measured_again_last_on_a_device():
    from poseidon_plugin.megatron.profile.profiler import measurement_order

    assert measurement_order([1, 2], ["dense", "moe"], True) == [
        (1, "dense", False), (1, "moe", False), (2, "dense", False), (2, "moe", False),
        (1, "dense", True)]
    assert measurement_order([1, 2], ["dense"], False) == [(1, "dense", False),
                                                           (2, "dense", False)]
    assert measurement_order([1], ["dense"], True) == [(1, "dense", False)]   # nothing between


def test_the_later_reading_of_the_first_configuration_is_kept():
    from poseidon_plugin.megatron.profile.profiler import LayerTiming, keep_later

    first = LayerTiming(1, 1, 3.55, 3.28, 490, 116, optimizer_ms=3.0, samples=40,
                        converged=False, kind="dense", ep=1)
    again = LayerTiming(1, 1, 1.30, 2.60, 480, 0, optimizer_ms=2.9, samples=12, converged=True)
    kept = keep_later(first, again)
    assert (kept.forward_ms, kept.backward_ms, kept.optimizer_ms) == (1.30, 2.60, 2.9)
    assert kept.converged and kept.samples == 12 and kept.activation_bytes == 480
    assert (kept.kind, kept.ep, kept.param_bytes) == ("dense", 1, 116)


def test_no_device_warm_up_or_re_measurement_on_the_cpu(monkeypatch):
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace

    from poseidon_plugin.megatron.profile import profiler

    assert not profiler.remeasure_first(torch.device("cpu"))
    settled = []
    monkeypatch.setattr(profiler, "settle_device", lambda *a, **k: settled.append(a))
    monkeypatch.setattr(profiler, "_layer_inputs", lambda c, v, d: (
        torch.ones(2, 4, requires_grad=True), {}, torch.ones(2, 4)))
    monkeypatch.setattr(profiler, "_activation_bytes", lambda *a: 0)
    monkeypatch.setattr(profiler, "tp_group_any", lambda d: None)
    monkeypatch.setattr(profiler, "_timed_step", lambda *a, **k: (1.0, 2.0))
    monkeypatch.setattr(profiler, "_back_to_back_step", lambda *a, **k: (1.0, 2.0))
    vargs = SimpleNamespace(tensor_model_parallel_size=1)
    monkeypatch.setattr(profiler, "device_event_class", lambda d: None)
    profiler.time_layer(None, None, vargs, torch.device("cpu"), 8)
    assert settled == []
    monkeypatch.setattr(profiler, "device_event_class", lambda d: object)
    profiler.time_layer(None, None, vargs, torch.device("cpu"), 8)
    assert len(settled) == 1          # on a device: once, before the timed samples
