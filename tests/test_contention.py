"""Host contention under CPU emulation (``megatron/emulate/contention.py``), with fake steps and clocks:
what the concurrent probe measures, and how a host's share is formed from its ranks'."""

from __future__ import annotations

import pytest

from poseidon_plugin.megatron.emulate.contention import (ContentionSample, host_shares, measure_alone,
                                                 measure_contention, timed_compute)


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def stepper(clock: Clock, walls_cpus):
    """A step taking (wall, cpu) from the list in turn, advancing the clock by its wall."""
    it = iter(walls_cpus)

    def step():
        wall, cpu = next(it)
        clock.t += wall
        return wall, cpu
    return step


def test_ratio_is_the_step_time_together_over_alone_after_a_warm_up():
    clock = Clock()
    slept = []

    def sleep(s):
        slept.append(s)
        clock.t += s
    # warm-up step (ignored), then 3 steps of 12 ms wall (8 ms of CPU) against 8 ms alone
    step = stepper(clock, [(1.0, 0.001)] + [(0.012, 0.008)] * 3)
    got = measure_contention(step, 4.0, 0.008, seconds=0.0, min_steps=3, clock=clock,
                             sleep=sleep)
    assert got == ContentionSample(pytest.approx(1.5), 3)
    # each step is followed by the emulated type's padding: (factor - 1) x its CPU time
    assert slept == pytest.approx([0.024] * 3)
    # cache and memory interference count too: same CPU time, longer wall than alone
    step = stepper(clock, [(1.0, 0.001)] + [(0.010, 0.010)] * 3)
    assert measure_contention(step, 1.0, 0.008, seconds=0.0, clock=clock,
                              sleep=sleep).ratio == pytest.approx(1.25)


def test_alone_is_the_median_step_time_after_a_warm_up():
    clock = Clock()
    step = stepper(clock, [(1.0, 1.0), (0.01, 0.01), (0.02, 0.02), (0.9, 0.9)])
    assert measure_alone(step, seconds=0.0, min_steps=3, clock=clock) == pytest.approx(0.02)


def test_a_few_stalled_steps_do_not_move_the_ratio():
    """The probe's heavy tail (a rank that wakes onto busy cores now and then waits 60-700 ms):
    two stalls among 20 steps of 6 ms leave the ratio at 6 / 4; their mean would read 13x."""
    clock = Clock()
    walls = [(0.006, 0.004)] * 9 + [(0.7, 0.004)] + [(0.006, 0.004)] * 9 + [(0.35, 0.004)]
    step = stepper(clock, [(1.0, 0.001)] + walls)
    got = measure_contention(step, 4.0, 0.004, seconds=0.0, min_steps=20, clock=clock,
                             sleep=lambda s: None)
    assert got.ratio == pytest.approx(1.5)
    assert sum(w for w, _ in walls) / 20 / 0.004 > 13


def test_runs_for_the_window_and_stops_at_max_steps():
    clock = Clock()
    step = stepper(clock, [(0.25, 0.25)] * 1000)
    got = measure_contention(step, 1.0, 0.25, seconds=1.0, min_steps=1, clock=clock,
                             sleep=lambda s: None)
    assert got.steps == 4 and got.ratio == pytest.approx(1.0)   # a 1 s window of 0.25 s steps
    clock = Clock()
    step = stepper(clock, [(0.01, 0.01)] * 1000)
    got = measure_contention(step, 1.0, 0.01, seconds=100.0, max_steps=7, clock=clock,
                             sleep=lambda s: None)
    assert got.steps == 7


def test_never_below_one():
    clock = Clock()
    step = stepper(clock, [(0.001, 0.001)] * 10)   # faster together than alone: noise
    got = measure_contention(step, 1.0, 0.002, seconds=0.0, min_steps=5, clock=clock,
                             sleep=lambda s: None)
    assert got.ratio == 1.0


def test_host_share_is_the_median_of_its_ranks_and_never_below_one():
    ratios = {0: 1.2, 1: 1.4, 2: 3.0, 3: 1.3, 4: 0.9, 5: 0.95}
    hosts = {0: "a", 1: "a", 2: "a", 3: "a", 4: "b", 5: "b"}
    shares = host_shares(ratios, hosts)
    assert shares[0] == shares[2] == pytest.approx(1.35)     # one outlier rank does not rule
    assert shares[4] == shares[5] == 1.0                     # a free host is 1, not below
    # per host and device type
    types = {0: "slow", 1: "slow", 2: "fast", 3: "fast", 4: "slow", 5: "fast"}
    by_type = host_shares(ratios, hosts, types)
    assert by_type[0] == by_type[1] == pytest.approx(1.3)
    assert by_type[2] == by_type[3] == pytest.approx(2.15)
    assert by_type[4] == by_type[5] == 1.0


def test_timed_compute_reads_both_clocks():
    wall = iter([1.0, 1.5])
    cpu = iter([2.0, 2.25])
    ran = []
    assert timed_compute(lambda: ran.append(1), lambda: next(wall), lambda: next(cpu)) == (
        pytest.approx(0.5), pytest.approx(0.25))
    assert ran == [1]


# --------------------------------------------------------------------------- emulated speeds

def _agg(t, tp, mbs, f, b):
    from poseidon_plugin.megatron.profile.profiler import Aggregate

    return Aggregate(t, tp, mbs, f, b, 0, 0, 2)


def test_speed_check_expects_the_speeds_with_the_host_shares():
    """fast: share 1.16, speed 1; slow: share 1.42, speed 0.25 -> (1.42 + 3) / 1.16 = 3.81;
    measured 4.00 / 3.84 (a launch on the 2-core host) are within 10 %, 4.4 is not."""
    from poseidon_plugin.megatron.emulate.contention import emulated_speed_checks

    speeds, shares = {"emu-fast": 1.0, "emu-slow": 0.25}, {"emu-fast": 1.16, "emu-slow": 1.42}
    aggs = [_agg("emu-fast", 1, 1, 27.3, 59.1), _agg("emu-slow", 1, 1, 109.2, 227.2),
            _agg("emu-fast", 2, 1, 30.7, 45.7), _agg("emu-slow", 2, 1, 98.9, 159.1),
            _agg("emu-slow", 1, 2, 999.0, 999.0)]            # no fast mbs-2 record: not used
    (c,) = emulated_speed_checks(aggs, speeds, shares)
    assert (c.device_type, c.reference) == ("emu-slow", "emu-fast")
    assert c.expected == pytest.approx(4.42 / 1.16) and c.configured == pytest.approx(4.0)
    assert c.forward == pytest.approx(109.2 / 27.3) and c.backward == pytest.approx(227.2 / 59.1)
    assert c.ok and "expected x3.81 (x4.00 configured" in c.describe()
    aggs[1] = _agg("emu-slow", 1, 1, 4.4 * 27.3, 227.2)
    (c,) = emulated_speed_checks(aggs, speeds, shares)
    assert not c.ok
    # free cores (no shares measured): the configured ratio itself
    (c,) = emulated_speed_checks(aggs[:2], speeds, {})
    assert c.expected == pytest.approx(4.0)


def test_speed_check_needs_tp1_and_two_types():
    from poseidon_plugin.megatron.emulate.contention import emulated_speed_checks

    speeds = {"a": 1.0, "b": 0.5}
    assert emulated_speed_checks([_agg("a", 2, 1, 1, 1), _agg("b", 2, 1, 2, 2)], speeds, {}) == []
    assert emulated_speed_checks([_agg("a", 1, 1, 1, 1)], speeds, {}) == []


def _speed_ctx(rank, decisions=None):
    """A launch context with what ``_all_ranks_remeasure_off_speeds`` reads: rank 0 decides,
    another rank takes rank 0's decisions (``decisions``) from the fake broadcast."""
    from types import SimpleNamespace as NS

    ns = iter(decisions or [])
    return NS(rank=rank, type_shares={},
              emu=NS(types={"emu-fast": NS(speed=1.0), "emu-slow": NS(speed=0.25)}),
              topo=NS(infos=[NS(rank=0, device_type="emu-fast"),
                             NS(rank=1, device_type="emu-slow")]),
              boot=NS(broadcast_object=lambda obj, name: obj if rank == 0 else next(ns)),
              guarded=lambda phase, fn: fn())


def _attempts(monkeypatch, ctx, slow_fwd: dict[str, float]):
    """Each attempt's gathered timings are a token; the fake aggregate turns a token into the
    slow type's forward over the fast one's (expected x4: free cores, no shares); each new
    attempt also measures new host shares, as the contention probe does."""
    from poseidon_plugin.megatron.launch import runner

    def aggregate(gathered, types):
        tok = gathered[0][0]
        return [_agg("emu-fast", 1, 1, 10.0, 20.0),
                _agg("emu-slow", 1, 1, 10.0 * slow_fwd[tok], 80.0)], []

    later = iter([t for t in slow_fwd][1:])
    calls = []

    def measure(c):
        tok = next(later)
        calls.append(tok)
        c.type_shares = {"seen": tok}
        return [[tok]]

    monkeypatch.setattr(runner.profiler, "aggregate", aggregate)
    monkeypatch.setattr(runner, "_all_ranks_measure", measure)
    return calls


def test_an_off_speed_is_profiled_again_until_within_10_percent(monkeypatch, caplog):
    from poseidon_plugin.megatron.launch import runner

    ctx = _speed_ctx(0)
    calls = _attempts(monkeypatch, ctx, {"a": 5.0, "b": 4.2, "c": 4.0})   # 25 %, then 5 %
    with caplog.at_level("INFO", logger="poseidon"):
        got = runner._all_ranks_remeasure_off_speeds(ctx, [["a"]])
    assert got == [["b"]] and calls == ["b"]
    assert ctx.type_shares == {"seen": "b"}
    text = caplog.text
    assert "off by 25% (more than 10%): profiling again (attempt 2 of 3)" in text
    assert "kept the attempt that missed least (5%) of 2" in text


def test_within_10_percent_profiles_once(monkeypatch):
    from poseidon_plugin.megatron.launch import runner

    ctx = _speed_ctx(0)
    calls = _attempts(monkeypatch, ctx, {"a": 4.3, "b": 4.0})
    assert runner._all_ranks_remeasure_off_speeds(ctx, [["a"]]) == [["a"]]
    assert calls == []


def test_at_most_three_attempts_and_the_closest_is_kept(monkeypatch):
    from poseidon_plugin.megatron.launch import runner
    from poseidon_plugin.megatron.emulate.contention import SPEED_ATTEMPTS

    assert SPEED_ATTEMPTS == 3
    ctx = _speed_ctx(0)
    calls = _attempts(monkeypatch, ctx, {"a": 5.0, "b": 6.0, "c": 5.6, "d": 4.0})
    got = runner._all_ranks_remeasure_off_speeds(ctx, [["a"]])
    assert calls == ["b", "c"]                  # three attempts in all, never "d"
    assert got == [["a"]]                       # 25 % < 40 %, 50 %
    assert ctx.type_shares == {}                # the first attempt's shares (none measured)


def test_other_ranks_follow_rank_0s_decisions(monkeypatch):
    from poseidon_plugin.megatron.launch import runner

    ctx = _speed_ctx(1, decisions=[True, False])
    calls = _attempts(monkeypatch, ctx, {"x": 1.0, "y": 1.0, "z": 1.0})
    assert runner._all_ranks_remeasure_off_speeds(ctx, [["x"]]) == [["y"]]
    assert calls == ["y"]


def test_speed_error_is_the_largest_miss():
    from poseidon_plugin.megatron.emulate.contention import emulated_speed_checks, speed_error

    speeds = {"a": 1.0, "b": 0.5}
    assert speed_error([]) == 0.0
    checks = emulated_speed_checks([_agg("a", 1, 1, 10, 10), _agg("b", 1, 1, 18, 23)], speeds, {})
    assert speed_error(checks) == pytest.approx(0.15)     # backward x2.3 against x2
