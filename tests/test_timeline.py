"""Timeline values: from the simulator, from recorded iterations, JSON round trip."""

from __future__ import annotations

import numpy as np
import pytest

from poseidon_plugin.errors import PoseidonError
from poseidon_plugin.megatron.recorder import IterationRecord, timeline_from_records
from poseidon_plugin.simulator.schedules import op_orders
from poseidon_plugin.simulator import simulate_pipeline
from poseidon_plugin.simulator.timeline import Timeline, timeline_from_sim


def test_from_sim_marks_critical_path_and_span():
    n, m = 3, 5
    res = simulate_pipeline([1, 2, 1], [2, 4, 2], [0.1, 0.1], [0.1, 0.1], [0.5] * 3, m)
    tl = timeline_from_sim(res)
    assert tl.num_stages == n and len(tl.op_stage) == 2 * n * m
    assert tl.span_ms == pytest.approx(res.iteration_time_ms)
    assert tl.critical.any()
    assert np.all(tl.idle_ms() >= -1e-9)


def test_json_round_trip_and_bad_file():
    res = simulate_pipeline([1, 2], [2, 4], [0.1], [0.1], [0.5, 0.5], 4)
    tl = timeline_from_sim(res, label="x")
    back = Timeline.from_json(tl.to_json())
    assert back.label == "x" and np.allclose(back.op_start_ms, tl.op_start_ms)
    assert (back.critical == tl.critical).all()
    with pytest.raises(PoseidonError):
        Timeline.from_json("{}", "t.json")


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
    d = recs[1].to_dict()
    assert IterationRecord.from_dict(d) == recs[1]
