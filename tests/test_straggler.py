"""The straggler line: a rank that stays slower than its stage's plan for K iterations is named
(poseidon_plugin/megatron/calibrate/straggler.py), and its launch options."""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest

from poseidon_plugin.errors import PoseidonError
from poseidon_plugin.megatron.calibrate import recorder as recorder_mod
from poseidon_plugin.megatron.launch.options import extract_options
from poseidon_plugin.megatron.calibrate.straggler import (StageSample, StragglerWatch, find_stragglers,
                                                install_straggler_monitor, straggler_line)

PLANNED = (30.0, 40.0)   # stage 0, stage 1: forward + backward per micro-batch, ms


def _it(*compute_ms: float) -> tuple[StageSample, ...]:
    """One iteration of 4 ranks: ranks 0, 1 in stage 0 (node-a), ranks 2, 3 in stage 1."""
    return tuple(StageSample(r, r // 2, "fast" if r < 2 else "slow",
                             "node-a" if r < 2 else "node-b", c)
                 for r, c in enumerate(compute_ms))


ON_PLAN = _it(30.0, 31.0, 40.0, 41.0)


def test_a_rank_slow_for_k_iterations_is_named_with_its_stage_device_and_node():
    history = [ON_PLAN, _it(30, 31, 40, 60), _it(30, 31, 40, 62), _it(30, 31, 40, 64)]
    found = find_stragglers(history, PLANNED, 15.0, 3)
    assert [(s.rank, s.stage, s.device_type, s.node) for s in found] == [(3, 1, "slow", "node-b")]
    assert found[0].measured_ms == pytest.approx(62.0)
    assert found[0].planned_ms == 40.0
    assert found[0].slower == pytest.approx(0.55)


def test_fewer_than_k_slow_iterations_name_nobody():
    history = [ON_PLAN, ON_PLAN, _it(30, 31, 40, 60), _it(30, 31, 40, 60)]
    assert find_stragglers(history, PLANNED, 15.0, 3) == ()
    assert find_stragglers(history, PLANNED, 15.0, 2)[0].rank == 3


def test_a_streak_broken_by_one_iteration_on_plan_names_nobody():
    history = [_it(30, 31, 40, 60), ON_PLAN, _it(30, 31, 40, 60), _it(30, 31, 40, 60)]
    assert find_stragglers(history[:3], PLANNED, 15.0, 3) == ()
    assert find_stragglers([_it(30, 31, 40, 60), _it(30, 31, 40, 60), ON_PLAN], PLANNED,
                           15.0, 3) == ()


def test_the_threshold_is_strictly_above_planned_plus_pct():
    at = _it(30, 31, 46.0, 41)        # 40 ms x 1.15 = 46 ms: not above
    above = _it(30, 31, 46.5, 41)
    assert find_stragglers([at] * 3, PLANNED, 15.0, 3) == ()
    assert [s.rank for s in find_stragglers([above] * 3, PLANNED, 15.0, 3)] == [2]
    assert find_stragglers([above] * 3, PLANNED, 20.0, 3) == ()


def test_several_stragglers_slowest_first_and_the_line_names_each():
    history = [_it(40, 31, 40, 70)] * 3        # rank 0: +33 %, rank 3: +75 %
    found = find_stragglers(history, PLANNED, 15.0, 3)
    assert [s.rank for s in found] == [3, 0]
    line = straggler_line(found, 9, 3)
    assert line.startswith("straggler: iteration 9: rank 3 (slow on node-b, stage 1) computes "
                           "70.0 ms per micro-batch, planned 40.0 ms (+75%); rank 0 (fast on "
                           "node-a, stage 0)")
    assert line.endswith("over iterations 7-9")


def test_the_watch_logs_once_per_launch():
    watch = StragglerWatch(PLANNED, 15.0, 2)
    lines = [watch.update(it) for it in
             [ON_PLAN, _it(30, 31, 40, 60), _it(30, 31, 40, 60), _it(30, 31, 40, 60),
              _it(50, 50, 60, 60), _it(50, 50, 60, 60)]]
    assert lines[:2] == [None, None]
    assert lines[2] is not None and "rank 3 " in lines[2] and "iteration 3:" in lines[2]
    assert lines[3:] == [None, None, None]


@pytest.mark.integration   # torch / megatron-core
@pytest.mark.parametrize("loop", ["megatron", "framework"])
def test_the_monitor_times_each_iteration_through_megatron_core_schedules(monkeypatch, loop):
    """Installed on megatron's own train_step / schedules functions: the ops timed by the
    recorder (a fake clock: every op takes what the test says) give the named compute. The
    ``framework`` loop calls the train_step its own module bound at import (as MindSpeed-LLM's
    ``mindspeed_llm.training.training`` does), before the monitor was installed."""
    import types

    from megatron.core.pipeline_parallel import schedules
    from megatron.training import training

    now = [0.0]
    monkeypatch.setattr(recorder_mod, "clock", lambda: now[0])
    op_s = [0.010]

    def forward_step(forward_step_func, data_iterator, model, *args, **kwargs):
        now[0] += op_s[0]
        return [object()]

    def backward_step(input_tensor, output_tensor, output_tensor_grad, *args, **kwargs):
        now[0] += 2 * op_s[0]
        return None

    def train_step(*args, **kwargs):
        for _ in range(2):   # two micro-batches
            out = schedules.forward_step(None, None, object())
            schedules.backward_step(None, out, None)
        return "stepped"

    monkeypatch.setattr(schedules, "forward_step", forward_step)
    monkeypatch.setattr(schedules, "backward_step", backward_step)
    monkeypatch.setattr(training, "train_step", train_step)
    framework = types.ModuleType("fake_framework_training")
    framework.train_step = train_step              # its `from ... import train_step`
    monkeypatch.setitem(sys.modules, framework.__name__, framework)
    caller = training if loop == "megatron" else framework
    monkeypatch.setenv("POSEIDON_DEVICE_TYPE", "emu-slow")
    plan = SimpleNamespace(stages=[SimpleNamespace(forward_ms=10.0, backward_ms=20.0)])
    lines: list[str] = []
    mon = install_straggler_monitor(plan, 15.0, 2, emit=lines.append)
    try:
        for ms in (10.0, 10.0, 20.0, 20.0, 20.0):   # slowed from the third iteration on
            op_s[0] = ms / 1e3
            assert caller.train_step() == "stepped"
    finally:
        mon.uninstall()
    assert training.train_step is train_step and schedules.forward_step is forward_step
    assert framework.train_step is train_step
    assert len(lines) == 1
    assert lines[0].startswith("straggler: iteration 4: rank 0 (emu-slow on ")
    assert "computes 60.0 ms per micro-batch, planned 30.0 ms (+100%)" in lines[0]


@pytest.mark.parametrize("argv, message", [
    (["--poseidon-straggler-pct", "0"], "--poseidon-straggler-pct: expected a percent > 0"),
    (["--poseidon-straggler-pct", "nan"], "--poseidon-straggler-pct: expected a percent > 0"),
    (["--poseidon-straggler-pct=fast"], "--poseidon-straggler-pct: expected a percent > 0"),
    (["--poseidon-straggler-iters", "0"], "--poseidon-straggler-iters: expected an integer > 0"),
    (["--poseidon-straggler-iters", "2.5"], "--poseidon-straggler-iters: expected an integer"),
])
def test_bad_straggler_options_are_one_error(argv, message):
    with pytest.raises(PoseidonError, match=message):
        extract_options(["--poseidon-auto", *argv])


def test_straggler_options_parse_with_defaults():
    opts, rest = extract_options(["--poseidon-auto", "--poseidon-straggler-pct=25%",
                                  "--poseidon-straggler-iters", "5", "--lr", "1"])
    assert (opts.straggler_pct, opts.straggler_iters, rest) == (25.0, 5, ["--lr", "1"])
    opts, _ = extract_options(["--poseidon-auto"])
    assert (opts.straggler_pct, opts.straggler_iters) == (15.0, 3)


def _two_type_search_setup():
    from dataclasses import replace as dc_replace

    from poseidon_plugin.cluster import cluster_from_dict
    from poseidon_plugin.model import load_model
    from poseidon_plugin.profiles import LAYER_KINDS, ProfileDB, ProfileKey, estimate_profile
    from poseidon_plugin.search import SearchOptions

    cluster = cluster_from_dict({
        "name": "two", "device_types": {
            "fast": {"memory_gib": 16, "peak_tflops": 200, "efficiency": 0.5,
                     "intra_node_gbps": 800},
            "slow": {"memory_gib": 16, "peak_tflops": 100, "efficiency": 0.5,
                     "intra_node_gbps": 400}},
        "nodes": [{"device_type": "fast", "devices_per_node": 1, "count": 1},
                  {"device_type": "slow", "devices_per_node": 1, "count": 1}],
        "links": {"inter_node_gbps": {"fast": 200, "slow": 100}, "cross_type_gbps": 50,
                  "latency_ms": 0.01}})
    model = load_model("examples/models/tiny-gpt.yaml")
    db = ProfileDB()
    for dt in ("fast", "slow"):
        for kind in LAYER_KINDS:
            key = ProfileKey(dt, kind, 1, 1, 128, model.signature())
            db.put(dc_replace(estimate_profile(cluster, model, key), source="measured"))
    options = SearchOptions(global_batch_size=8, seq_length=128, micro_batch_sizes=(1,),
                            tp_degrees=(1,), schedules=("1f1b",))
    return cluster, model, db, options


def test_the_suggestion_searches_with_the_slow_types_layers_scaled():
    """The launch's search entry point with the named type's measured slowdown: the plan moves
    work off it, and the gain is against the current plan timed under the same costs."""
    from poseidon_plugin.megatron.calibrate.straggler import Straggler, scaled_profiles, search_suggester
    from poseidon_plugin.search import search_plan

    cluster, model, db, options = _two_type_search_setup()
    plan = search_plan(cluster, model, options, db)
    slow_type = plan.stages[0].device_type
    calls = []

    def search(o, profiles, previous):
        calls.append((o, profiles))
        return search_plan(cluster, model, o, profiles, previous=previous)

    suggest = search_suggester(plan, search, db, options)
    text = suggest([Straggler(0, 0, slow_type, "node-a", 8.0, 1.0)])   # 8x slower than planned
    o, profiles = calls[0]
    assert o.time_budget_s <= 10.0
    key = next(p.key for p in db if p.key.device_type == slow_type)
    assert profiles.get(key).forward_ms == pytest.approx(8 * db.get(key).forward_ms)
    other = next(p.key for p in db if p.key.device_type != slow_type)
    assert profiles.get(other) == db.get(other)
    moved = search_plan(cluster, model, o, scaled_profiles(db, {slow_type: 8.0}), previous=plan)
    assert [s.device_type for s in moved.stages] != [s.device_type for s in plan.stages] \
        or moved.layers_per_stage != plan.layers_per_stage
    now_ms = moved.search["previous_ms"]
    assert now_ms > plan.predicted_iteration_time_ms          # the current plan, slowed
    assert moved.predicted_iteration_time_ms < now_ms
    gain = 100 * (moved.predicted_iteration_time_ms / now_ms - 1)
    assert text.startswith("with the measured speed the search chooses plan ")
    assert text.endswith(f" ms predicted ({gain:+.0f}%)")


def test_the_emulations_live_slowdown_file_is_re_read_when_it_changes(tmp_path, monkeypatch):
    from poseidon_plugin.megatron.emulate import emulation

    path = tmp_path / "slowdown"
    monkeypatch.setenv(emulation.SLOWDOWN_FILE_ENV, str(path))
    monkeypatch.setenv("POSEIDON_LAUNCH_RANK", "1")
    monkeypatch.setitem(emulation._LIVE, "mtime", None)
    assert emulation.live_factor() == 1.0                 # no file yet
    path.write_text("0 5\n1 3\n")
    os.utime(path, ns=(1_000_000_000, 1_000_000_000))
    assert emulation.live_factor() == 3.0                 # this rank's line
    with emulation.padding_suspended():                   # the profiler times unpadded
        assert emulation.live_factor() == 1.0
    path.write_text("0 5\n")
    os.utime(path, ns=(2_000_000_000, 2_000_000_000))
    assert emulation.live_factor() == 1.0                 # its line gone: back to speed


@pytest.mark.integration   # torch / megatron-core
def test_a_monitor_failure_stops_it_and_the_training_goes_on(monkeypatch):
    from megatron.core.pipeline_parallel import schedules
    from megatron.training import training

    from poseidon_plugin.megatron.calibrate import straggler

    monkeypatch.setattr(training, "train_step", lambda: "stepped")
    monkeypatch.setattr(schedules, "forward_step", lambda *a, **k: [object()])
    monkeypatch.setattr(schedules, "backward_step", lambda *a, **k: None)

    def broken(ops):
        raise RuntimeError("no clock")

    monkeypatch.setattr(straggler, "_compute_ms", broken)
    plan = SimpleNamespace(stages=[SimpleNamespace(forward_ms=10.0, backward_ms=20.0)])
    mon = install_straggler_monitor(plan, 15.0, 1, emit=lambda line: None)
    try:
        assert training.train_step() == "stepped"
        assert mon.recorder is None                   # stopped
        assert training.train_step() == "stepped"     # passes through
    finally:
        mon.uninstall()


def test_a_renumbered_rank_is_named_with_its_launch_rank_and_megatrons_iteration():
    history = [(StageSample(0, 0, "fast", "n", 90.0, launch_rank=2),
                StageSample(1, 1, "slow", "n", 40.0, launch_rank=0))] * 2
    watch = StragglerWatch(PLANNED, 15.0, 2)
    assert watch.update(history[0], 11) is None
    line = watch.update(history[1], 12)
    assert line.startswith("straggler: iteration 12: rank 0 = launch rank 2 (fast on n, "
                           "stage 0) computes 90.0 ms")
    assert line.endswith("over iterations 11-12")


@pytest.mark.integration   # torch / megatron-core
def test_replan_on_straggler_sets_megatrons_exit_records_speeds_and_exits_75(monkeypatch):
    from megatron.core.pipeline_parallel import schedules
    from megatron.training import global_vars, training

    from poseidon_plugin.megatron.calibrate import straggler

    now = [0.0]
    monkeypatch.setattr(recorder_mod, "clock", lambda: now[0])
    monkeypatch.setitem(straggler._EXIT, "requested", False)
    args = SimpleNamespace(curr_iteration=0, exit_interval=None)
    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", args)
    op_s = [0.010]

    def forward_step(*a, **k):
        now[0] += op_s[0]
        return [object()]

    def backward_step(input_tensor, output_tensor, *a, **k):
        now[0] += 2 * op_s[0]

    def train_step():
        out = schedules.forward_step(None, None, object())
        schedules.backward_step(None, out, None)

    monkeypatch.setattr(schedules, "forward_step", forward_step)
    monkeypatch.setattr(schedules, "backward_step", backward_step)
    monkeypatch.setattr(training, "train_step", train_step)
    plan = SimpleNamespace(stages=[SimpleNamespace(forward_ms=10.0, backward_ms=20.0)])
    lines, recorded = [], []
    mon = install_straggler_monitor(plan, 15.0, 2, emit=lines.append, replan=True,
                                    record=recorded.append)
    try:
        for done, ms in enumerate((10.0, 10.0, 20.0, 20.0, 20.0), start=40):  # a resumed run
            args.curr_iteration = done
            op_s[0] = ms / 1e3
            training.train_step()
            if args.exit_interval is not None:
                break
    finally:
        mon.uninstall()
    assert args.exit_interval == 44                 # Megatron saves and leaves its loop there
    assert [[s.rank for s in found] for found in recorded] == [[0]]
    assert len(lines) == 1 and lines[0].startswith("straggler: iteration 44: rank 0 ")
    assert "every rank exits with 75 for torchrun to relaunch" in lines[0]
    assert straggler.exit_status(0) == 75 and straggler.exit_status(None) == 75
    assert straggler.exit_status(3) == 3            # a failure stays what it is


def test_the_launched_script_exits_75_after_a_straggler_checkpoint(tmp_path, monkeypatch):
    from poseidon_plugin.megatron.calibrate import straggler
    from poseidon_plugin.megatron.launch.runner import run_script

    script = tmp_path / "train.py"
    script.write_text("import sys\nfrom poseidon_plugin.megatron.calibrate import straggler\n"
                      "straggler._EXIT['requested'] = sys.argv[1] == 'slow'\n"
                      "sys.exit(0) if sys.argv[2] == 'exit' else None\n")
    monkeypatch.setitem(straggler._EXIT, "requested", False)
    monkeypatch.setattr("sys.argv", ["x"])
    monkeypatch.setattr("sys.path", list(__import__("sys").path))
    for argv, code in ((["slow", "exit"], 75), (["slow", "return"], 75),
                       (["fine", "exit"], 0)):
        with pytest.raises(SystemExit) as e:
            run_script(str(script), argv)
            raise SystemExit("returned")
        assert e.value.code == code, argv
    straggler._EXIT["requested"] = False
    run_script(str(script), ["fine", "return"])    # a normal end stays one


def test_the_measured_speed_is_written_to_the_profile_cache(tmp_path):
    from poseidon_plugin.megatron.calibrate.straggler import Straggler, record_measured_speeds
    from poseidon_plugin.profiles import ProfileDB

    _, _, db, _ = _two_type_search_setup()
    cache = tmp_path / "profiles.json"
    record_measured_speeds(str(cache), db, [Straggler(1, 0, "fast", "n", 30.0, 10.0)])
    written = ProfileDB(str(cache))
    fast = [p for p in db if p.key.device_type == "fast"]
    assert fast and all(written.get(p.key).forward_ms == pytest.approx(3 * p.forward_ms)
                        and written.get(p.key).source == "measured" for p in fast)
    assert not any(p.key.device_type == "slow" for p in written)


def test_replan_on_straggler_option():
    opts, _ = extract_options(["--poseidon-auto", "--poseidon-replan-on-straggler"])
    assert opts.replan_on_straggler
    assert not extract_options(["--poseidon-auto"])[0].replan_on_straggler
    with pytest.raises(PoseidonError, match="takes no value"):
        extract_options(["--poseidon-replan-on-straggler=1"])
