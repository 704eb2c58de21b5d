"""Per-stage op orders (poseidon_plugin.simulator.schedules) against hand-written tables."""

from __future__ import annotations

import pytest

from poseidon_plugin.errors import PoseidonError
from poseidon_plugin.simulator.schedules import (SCHEDULES, interleaved_table, op_orders, stage_op_order,
                                       validate_schedule)


def fmt(ops) -> list[str]:
    """Compact form: 'F3' / 'B0' for one chunk, 'F1.3' (chunk.microbatch) for several."""
    multi = any(op.chunk for op in ops)
    return [("B" if op.is_backward else "F") + (f"{op.chunk}.{op.microbatch}" if multi
                                                else str(op.microbatch)) for op in ops]


def test_gpipe_order():
    assert fmt(stage_op_order("gpipe", 3, 3, 1)) == ["F0", "F1", "F2", "B0", "B1", "B2"]


def test_1f1b_orders_by_hand():
    # N=3, M=4: warm-up N-1-s forwards, then (F, B) pairs, then the remaining backwards.
    assert fmt(stage_op_order("1f1b", 3, 4, 0)) == ["F0", "F1", "F2", "B0", "F3", "B1", "B2",
                                                    "B3"]
    assert fmt(stage_op_order("1f1b", 3, 4, 1)) == ["F0", "F1", "B0", "F2", "B1", "F3", "B2",
                                                    "B3"]
    assert fmt(stage_op_order("1f1b", 3, 4, 2)) == ["F0", "B0", "F1", "B1", "F2", "B2", "F3",
                                                    "B3"]


def test_1f1b_warmup_capped_at_m():
    assert fmt(stage_op_order("1f1b", 4, 2, 0)) == ["F0", "F1", "B0", "B1"]


def test_eager_1f1b_orders_by_hand():
    # N=2, M=4: stage 0 warms up with 2(N-1-0)+1 = 3 forwards, stage 1 with 1; steady (B, F).
    assert fmt(stage_op_order("eager-1f1b", 2, 4, 0)) == ["F0", "F1", "F2", "B0", "F3", "B1",
                                                          "B2", "B3"]
    assert fmt(stage_op_order("eager-1f1b", 2, 4, 1)) == ["F0", "B0", "F1", "B1", "F2", "B2",
                                                          "F3", "B3"]
    # capped: 3 warm-up forwards wanted, only 2 micro-batches
    assert fmt(stage_op_order("eager-1f1b", 2, 2, 0)) == ["F0", "F1", "B0", "B1"]


def test_megatron_table_example():
    # the example in megatron-core's schedules.py comment: PP2, M=5, group size 3, VP2
    table = interleaved_table(5, 2, 3)
    assert [mb for mb, _ in table] == [0, 1, 2, 0, 1, 2, 3, 4, 3, 4]
    assert [c for _, c in table] == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]


def test_interleaved_by_hand_n2_m2_v2():
    # table: (mb, chunk) = (0,0) (1,0) (0,1) (1,1); device 0 warms up 2*1 + 1*2 = 4 (all F),
    # device 1 warms up 2; backward k runs chunk V-1-chunk[k] on mb[k].
    assert fmt(stage_op_order("interleaved-1f1b", 2, 2, 0, 2)) == [
        "F0.0", "F0.1", "F1.0", "F1.1", "B1.0", "B1.1", "B0.0", "B0.1"]
    assert fmt(stage_op_order("interleaved-1f1b", 2, 2, 1, 2)) == [
        "F0.0", "F0.1", "F1.0", "B1.0", "F1.1", "B1.1", "B0.0", "B0.1"]


def test_interleaved_v1_is_1f1b():
    assert op_orders("interleaved-1f1b", 4, 7, 1) == op_orders("1f1b", 4, 7, 1)


@pytest.mark.parametrize("schedule,n,m,v", [
    ("gpipe", 3, 5, 1), ("1f1b", 4, 3, 1), ("1f1b", 5, 9, 1), ("eager-1f1b", 4, 9, 1),
    ("eager-1f1b", 4, 2, 1), ("interleaved-1f1b", 2, 4, 3), ("interleaved-1f1b", 4, 8, 2),
    ("interleaved-1f1b", 3, 3, 2),
])
def test_every_op_exactly_once_and_forward_before_backward(schedule, n, m, v):
    for s, ops in enumerate(op_orders(schedule, n, m, v)):
        assert len(ops) == 2 * m * v
        assert sorted(ops) == sorted({(b, c, k) for b in (False, True) for c in range(v)
                                      for k in range(m)})
        seen_f = set()
        for op in ops:
            if op.is_backward:
                assert (op.chunk, op.microbatch) in seen_f, (s, op)
            else:
                seen_f.add((op.chunk, op.microbatch))


@pytest.mark.parametrize("args,match", [
    (("pipedream", 2, 2, 1), "schedule"),
    (("1f1b", 0, 2, 1), "num_stages"),
    (("1f1b", 2, 0, 1), "num_microbatches"),
    (("1f1b", 2, 2.0, 1), "num_microbatches"),
    (("1f1b", 2, True, 1), "num_microbatches"),
    (("1f1b", 2, 4, 2), "virtual_stages"),
    (("interleaved-1f1b", 2, 4, 0), "virtual_stages"),
    (("interleaved-1f1b", 1, 4, 2), "num_stages"),
    (("interleaved-1f1b", 4, 6, 2), "multiple of 4"),
    (("interleaved-1f1b", 4, 2, 2), "M >= 4"),
])
def test_invalid_requests(args, match):
    with pytest.raises(PoseidonError, match=match):
        validate_schedule(*args)


def test_stage_out_of_range():
    with pytest.raises(PoseidonError, match="stage"):
        stage_op_order("1f1b", 2, 2, 2)
