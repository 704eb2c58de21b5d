"""Timeline values: from both simulators, from recorded iterations, JSON round trip."""

from __future__ import annotations

import numpy as np
import pytest

from poseidon_plugin.errors import PoseidonError
from poseidon_plugin.megatron.calibrate.recorder import IterationRecord, timeline_from_records
from poseidon_plugin.simulator.schedules import op_orders
from poseidon_plugin.simulator import simulate_pipeline
from poseidon_plugin.simulator.engine import EngineCosts, simulate_engine
from poseidon_plugin.simulator.timeline import Timeline


def test_simulate_pipeline_marks_critical_path_and_span():
    n, m = 3, 5
    tl = simulate_pipeline([1, 2, 1], [2, 4, 2], [0.1, 0.1], [0.1, 0.1], [0.5] * 3, m)
    assert isinstance(tl, Timeline) and tl.label == "predicted"
    assert tl.num_stages == n and len(tl.op_stage) == 2 * n * m
    assert tl.span_ms == pytest.approx(tl.iteration_time_ms)
    assert tl.op_on_critical_path.any()
    # the per-op flags are exactly the F/B nodes of the critical path
    on_path = {lab for lab in tl.critical_path if lab[0] in ("F", "B")}
    flagged = {("B" if b else "F", int(s), int(c), int(mb)) for s, c, mb, b, k in zip(
        tl.op_stage, tl.op_chunk, tl.op_microbatch, tl.op_is_backward, tl.op_on_critical_path)
        if k}
    assert flagged == on_path
    assert np.all(tl.idle_ms() >= -1e-9)
    assert tl.idle_ms() == pytest.approx(tl.span_ms - tl.stage_busy_ms)


def test_simulate_engine_returns_a_timeline():
    n, m = 3, 4
    f = np.array([[1.0, 2.0, 1.0]])
    costs = EngineCosts.from_profiles(f, 2 * f, [0.1, 0.1], [0.5] * n, [0.25] * n)
    tl = simulate_engine(costs, m, "1f1b")
    assert isinstance(tl, Timeline) and tl.label == "predicted (engine-aware)"
    assert tl.num_stages == n and len(tl.op_stage) == 2 * n * m
    assert tl.critical_path == () and not tl.op_on_critical_path.any()
    # the iteration ends after the optimizer step, which the span (ops and all-reduce) omits
    assert tl.iteration_time_ms == pytest.approx(tl.span_ms + 0.25)
    # zero overheads and zero optimizer time: the paper's DAG, op for op
    dag = simulate_pipeline(f[0], 2 * f[0], [0.1, 0.1], [0.1, 0.1], [0.5] * n, m)
    costs0 = EngineCosts.from_profiles(f, 2 * f, [0.1, 0.1], [0.5] * n, [0.0] * n)
    eng = simulate_engine(costs0, m, "1f1b")
    assert eng.iteration_time_ms == pytest.approx(dag.iteration_time_ms)
    assert eng.op_start_ms == pytest.approx(dag.op_start_ms)
    assert (eng.op_stage == dag.op_stage).all() and (eng.op_microbatch == dag.op_microbatch).all()


def test_json_round_trip_and_bad_file():
    tl = simulate_pipeline([1, 2], [2, 4], [0.1], [0.1], [0.5, 0.5], 4).with_label("x")
    back = Timeline.from_json(tl.to_json())
    assert back.label == "x" and np.allclose(back.op_start_ms, tl.op_start_ms)
    assert (back.op_on_critical_path == tl.op_on_critical_path).all()
    assert back.critical_path == tl.critical_path
    assert back.iteration_time_ms == pytest.approx(tl.iteration_time_ms)
    with pytest.raises(PoseidonError):
        Timeline.from_json("{}", "t.json")


def test_json_without_iteration_time_gets_the_span():
    import json

    tl = simulate_pipeline([1, 2], [2, 4], [0.1], [0.1], [0.5, 0.5], 4)
    data = json.loads(tl.to_json())
    del data["iteration_time_ms"], data["critical_path"]
    back = Timeline.from_json(json.dumps(data))
    assert back.iteration_time_ms == pytest.approx(tl.span_ms) and back.critical_path == ()


def test_from_records_aligns_on_earliest_start():
    orders = op_orders("1f1b", 2, 3)
    recs = []
    for s in range(2):
        t = 100.0 + s * 0.001
        ops = []
        for op in orders[s]:
            ops.append((op.chunk, op.microbatch, op.is_backward, t, t + 0.002))
            t += 0.003
        recs.append(IterationRecord(s, 100.0 + s * 0.0005, t, ops, t, t + 0.001))
    tl = timeline_from_records(recs)
    assert tl.num_stages == 2 and len(tl.op_stage) == 12
    assert tl.op_start_ms.min() == pytest.approx(0.0)
    assert tl.op_start_ms[6] == pytest.approx(1.0)   # stage 1 starts 1 ms later
    assert tl.allreduce_finish_ms.shape == (2,)
    assert tl.iteration_time_ms == pytest.approx((recs[1].end_s - 100.0) * 1e3)
    assert not tl.op_on_critical_path.any() and tl.critical_path == ()
    d = recs[1].to_dict()
    assert IterationRecord.from_dict(d) == recs[1]


# --------------------------------------------------------------------------- critical_chain

def _random_timeline(schedule, seed, sends=True):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 7))
    v = 2 if schedule == "interleaved-1f1b" else 1
    m = n * int(rng.integers(1, 3)) if v > 1 else int(rng.integers(n, 3 * n))
    links = n if v > 1 else n - 1
    f = rng.uniform(1, 10, n)
    send = (lambda: rng.uniform(0, 1, links)) if sends else (lambda: np.zeros(links))
    return simulate_pipeline(f, rng.uniform(1.5, 3, n) * f, send(), send(),
                             rng.uniform(0, 5, n), m, schedule, v)


def _check_chain(tl, max_gap=0.0):
    chain = tl.critical_chain()
    assert len(chain) >= tl.num_stages
    assert tl.op_start_ms[chain[0]] == 0.0                       # starts the iteration
    gaps = tl.op_start_ms[chain[1:]] - tl.op_finish_ms[chain[:-1]]
    assert np.all(gaps >= -1e-9) and np.all(gaps <= max_gap + 1e-9)
    last = chain[-1]
    if len(tl.allreduce_finish_ms):   # the chain ends in the all-reduce that finishes last
        s = int(np.argmax(tl.allreduce_finish_ms))
        assert tl.op_stage[last] == s
        assert tl.op_finish_ms[last] == tl.op_finish_ms[tl.op_stage == s].max()
        assert tl.allreduce_finish_ms[s] == pytest.approx(tl.span_ms)
    else:
        assert tl.op_finish_ms[last] == pytest.approx(tl.span_ms)
    return chain


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "eager-1f1b", "interleaved-1f1b"])
def test_critical_chain_is_the_dags_critical_path_without_sends(schedule):
    """Zero send times: each op on the chain starts exactly when its predecessor ends, and the
    chain read off the times alone is the simulator's own critical path (ties broken the same
    way: towards the cross-stage dependency)."""
    for seed in range(25):
        tl = _random_timeline(schedule, seed, sends=False)
        chain = _check_chain(tl)
        mine = np.zeros(len(tl.op_stage), dtype=bool)
        mine[chain] = True
        assert (mine == tl.op_on_critical_path).all(), seed


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved-1f1b"])
def test_critical_chain_with_sends_and_for_engine_timelines(schedule):
    """With sends the chain still runs from time 0 to the end without overlaps; each gap is at
    most one send. The engine model (no DAG, no flags) gets a chain too."""
    for seed in range(10):
        _check_chain(_random_timeline(schedule, seed), max_gap=1.0)
    n, m, v = 4, 8, 2 if schedule == "interleaved-1f1b" else 1
    f = np.tile(np.array([1.0, 2.0, 1.5, 1.0]), (v, 1))
    eng = simulate_engine(EngineCosts.from_profiles(f, 2 * f, [0.2] * (n if v > 1 else n - 1),
                                                    [0.5] * n, [0.0] * n), m, schedule, v)
    assert not eng.op_on_critical_path.any()
    _check_chain(eng, max_gap=0.2 + 1e-6)


def test_critical_chain_of_a_recorded_iteration_and_an_empty_timeline():
    orders = op_orders("1f1b", 2, 3)
    recs, t = [], 0.0
    for s in range(2):
        ops = []
        t = 0.001 * s
        for op in orders[s]:
            ops.append((op.chunk, op.microbatch, op.is_backward, t, t + 0.001))
            t += 0.001
        recs.append(IterationRecord(s, 0.0, t, ops, t, t))
    tl = timeline_from_records(recs)
    chain = tl.critical_chain()
    assert len(chain) and tl.op_start_ms[chain[0]] == 0.0
    empty = Timeline(0.0, *(np.zeros(0) for _ in range(9)))
    assert len(empty.critical_chain()) == 0
