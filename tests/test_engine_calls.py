"""Megatron's per-op and per-p2p-call costs in the search's own timing model (issue 30, item 5),
and backward sends timed on their own.

* ``_core.get_dag(..., engine=True, calls=...)`` (the C sweep the search uses) gives exactly
  ``engine.simulate_engine``'s time with the same uniform costs (1f1b and interleaved);
* the costs live in the profile DB (``op_overheads`` / ``p2p_calls``), older DBs load unchanged,
  bad records are one-line errors; ``callcosts.engine_calls`` picks and interpolates them;
* a search with such a DB charges them, and the plan's JSON names them in ``timing_model`` so
  its time re-derives from the JSON alone; a DB without them plans exactly as before;
* ``send_backward_ms`` reaches the simulator (asymmetric sends time with both).
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from poseidon_plugin.callcosts import EngineCalls, OpOverhead, P2PCall, engine_calls
from poseidon_plugin.cluster import load_cluster
from poseidon_plugin.costs import simulator_arrays
from poseidon_plugin.errors import PoseidonError, ProfileDBError
from poseidon_plugin.model import get_model
from poseidon_plugin.plan import Plan
from poseidon_plugin.profiles import ProfileDB
from poseidon_plugin.search import SearchOptions, search_plan
from poseidon_plugin.simulator import iteration_time_ms
from poseidon_plugin._core import get_dag
from poseidon_plugin.simulator.engine import EngineCosts, simulate_engine

SMALL = "examples/clusters/small-two-type.yaml"
TINY = "examples/models/tiny-gpt.yaml"


# --------------------------------------------------------------------------- the C model

@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 100_000),
       schedule=st.sampled_from(["1f1b", "interleaved-1f1b", "eager-1f1b", "gpipe"]),
       n=st.integers(2, 5), k=st.integers(1, 3))
def test_engine_dag_with_calls_equals_the_engine_model(seed, schedule, n, k):
    rng = np.random.default_rng(seed)
    interleaved = schedule == "interleaved-1f1b"
    v = k + 1 if interleaved else 1
    m = n * k if interleaved else int(rng.integers(1, 9))
    links = n if interleaved else n - 1
    F, B = rng.uniform(1, 10, (v, n)), rng.uniform(1, 20, (v, n))
    P, R = rng.uniform(0, 2, links), rng.uniform(0, 5, n)
    calls = tuple(float(x) for x in rng.uniform(0.0, 1.0, 4))
    got = get_dag(schedule, n, m, v, True, calls).time_ms(
        F.reshape(-1).copy(), B.reshape(-1).copy(), P, P.copy(), R)
    fo, bo, sc, rr = calls
    ref = simulate_engine(EngineCosts(F, B, P, R, np.zeros(n), np.full(n, sc), np.full(n, rr),
                                      np.full(n, fo), np.full(n, bo)), m, schedule, v)
    assert got == pytest.approx(ref.iteration_time_ms, rel=1e-12, abs=1e-9)
    bare = get_dag(schedule, n, m, v, True).time_ms(
        F.reshape(-1).copy(), B.reshape(-1).copy(), P, P.copy(), R)
    assert got > bare      # every op and call is charged: never faster, here slower


@pytest.mark.parametrize("which", range(4))
def test_each_call_cost_adds_time(which):
    n, m = 3, 6
    F, B, P, R = np.full(n, 2.0), np.full(n, 4.0), np.full(n - 1, 0.1), np.zeros(n)
    calls = [0.0] * 4
    calls[which] = 0.5
    base = iteration_time_ms(F, B, P, P, R, m, "1f1b", 1, engine=True)
    assert iteration_time_ms(F, B, P, P, R, m, "1f1b", 1, engine=True,
                             calls=tuple(calls)) > base + 0.5


def test_zero_calls_keep_the_old_dags_and_bad_calls_are_refused():
    assert type(get_dag("1f1b", 3, 4, 1, True, (0.0, 0.0, 0.0, 0.0))).__name__ == "PipelineDAG"
    assert type(get_dag("1f1b", 3, 4, 1, True, (0.1, 0.0, 0.0, 0.0))).__name__ == "EngineDAG"
    # eager-1f1b / gpipe (not run by megatron-core) pay one blocking call per message
    assert type(get_dag("gpipe", 3, 4, 1, True, (0.1, 0.1, 0.1, 0.1))).__name__ == "EngineDAG"
    assert type(get_dag("gpipe", 3, 4, 1, True)).__name__ == "PipelineDAG"
    d = get_dag("1f1b", 3, 4, 1, True, (0.1, 0.2, 0.3, 0.4))
    c = d.copy()
    args = (np.ones(3), np.ones(3), np.ones(2), np.ones(2), np.zeros(3))
    assert c.calls == (0.1, 0.2, 0.3, 0.4) and c.time_ms(*args) == d.time_ms(*args)
    for bad in ((0.1, 0.2, 0.3), (-1.0, 0.0, 0.0, 0.0), (float("nan"), 0.0, 0.0, 0.0)):
        with pytest.raises(PoseidonError, match="engine call costs"):
            get_dag("1f1b", 3, 4, 1, True, bad)


# --------------------------------------------------------------------------- asymmetric sends

def test_backward_sends_are_timed_on_their_own():
    n, m = 3, 6
    F, B, R = np.full(n, 2.0), np.full(n, 4.0), np.zeros(n)
    Pf = np.full(n - 1, 0.5)
    same = iteration_time_ms(F, B, Pf, Pf, R, m, "1f1b", 1, engine=True)
    slow_back = iteration_time_ms(F, B, Pf, Pf + 3.0, R, m, "1f1b", 1, engine=True)
    assert slow_back > same


def _plan(**search):
    db = search.pop("profiles", None)
    return search_plan(load_cluster(SMALL), get_model(TINY), SearchOptions(
        global_batch_size=16, seq_length=128, workers=1, warmup_samples=10, **search), db)


@pytest.fixture(scope="module")
def base_plan():
    return _plan()


def test_plan_with_asymmetric_sends_is_timed_with_both(base_plan):
    p = base_plan
    assert p.pp >= 2
    F, B, Pf, Pb, R = p.simulator_inputs()
    assert list(Pb) == [s.send_backward_ms for s in p.stages[:-1]]
    t = p.rederived_iteration_time_ms()
    slow_back = dataclasses.replace(p, stages=tuple(
        dataclasses.replace(s, send_backward_ms=s.send_backward_ms + 20.0) if i < p.pp - 1
        else s for i, s in enumerate(p.stages)))
    slow_fwd = dataclasses.replace(p, stages=tuple(
        dataclasses.replace(s, send_forward_ms=s.send_forward_ms + 20.0) if i < p.pp - 1
        else s for i, s in enumerate(p.stages)))
    tb = Plan.from_json(slow_back.to_json()).rederived_iteration_time_ms()
    tf = Plan.from_json(slow_fwd.to_json()).rederived_iteration_time_ms()
    assert tb > t + 1.0 and tf > t + 1.0
    # and simulator_arrays keeps them apart (not a copy of the forward sends)
    _, _, Pf2, Pb2, _ = simulator_arrays(slow_back.stages, 1)
    assert np.all(Pb2 == Pf2 + 20.0)


# --------------------------------------------------------------------------- profile DB

def _db_with_calls(path=None):
    db = ProfileDB(path)
    for t in ("fast", "slow"):
        db.put_op_overhead(OpOverhead(t, 0.4, 0.6))
        db.put_p2p_call(P2PCall(t, "intra-node", 1 << 10, 0.2, 0.3, 0.05))
        db.put_p2p_call(P2PCall(t, "intra-node", 1 << 20, 0.4, 0.5, 0.05))
    return db


def test_db_round_trip_and_old_dbs(tmp_path):
    path = str(tmp_path / "db.json")
    db = _db_with_calls(path)
    db.save()
    back = ProfileDB.load(path)
    assert back.op_overheads() == db.op_overheads() and back.p2p_calls() == db.p2p_calls()
    assert json.loads(back.to_json()) == json.loads(db.to_json())
    old = ProfileDB.from_json('{"version": 1, "records": []}')
    assert old.op_overheads() == [] and old.p2p_calls() == []
    assert "op_overheads" not in old.to_json() and "p2p_calls" not in old.to_json()


@pytest.mark.parametrize("payload, field", [
    ({"op_overheads": [{"device_type": "x", "forward_ms": -1, "backward_ms": 0}]},
     "forward_ms"),
    ({"op_overheads": [{"device_type": "x", "forward_ms": 0}]}, "backward_ms"),
    ({"p2p_calls": [{"device_type": "x", "link": "wifi", "message_bytes": 8,
                     "send_call_ms": 0, "recv_ready_ms": 0}]}, "link"),
    ({"p2p_calls": [{"device_type": "x", "link": "intra-node", "message_bytes": 0,
                     "send_call_ms": 0, "recv_ready_ms": 0}]}, "message_bytes"),
    ({"p2p_calls": {"a": 1}}, "p2p_calls"),
])
def test_bad_call_records_are_one_line_errors(payload, field):
    text = json.dumps({"version": 1, "records": [], **payload})
    with pytest.raises(ProfileDBError, match=field) as exc:
        ProfileDB.from_json(text)
    assert "\n" not in str(exc.value)


def test_engine_calls_pick_and_interpolate():
    db = _db_with_calls()
    db.put_op_overhead(OpOverhead("slow", 0.9, 0.1))
    mid = ((1 << 10) + (1 << 20)) // 2
    got = engine_calls(db, ("fast", "slow"), mid)
    frac = (mid - (1 << 10)) / ((1 << 20) - (1 << 10))
    assert got.op_forward_ms == 0.9 and got.op_backward_ms == 0.6      # the largest type's
    assert got.send_call_ms == pytest.approx(0.2 + 0.2 * frac)
    assert got.recv_ready_ms == pytest.approx(0.3 + 0.2 * frac)
    assert engine_calls(db, ("fast",), 1 << 30).send_call_ms == 0.4    # beyond: the nearest
    assert engine_calls(db, ("fast",), 1).recv_ready_ms == 0.3
    assert not engine_calls(db, ("other",), 1 << 10)                   # no record: zeros
    assert not engine_calls(None, ("fast",), 1 << 10)


# --------------------------------------------------------------------------- the search

def test_search_charges_the_calls_and_the_json_names_them(base_plan):
    db = _db_with_calls()
    p = _plan(profiles=db)
    d = json.loads(p.to_json())
    tm = d["timing_model"]
    assert tm["name"] == "engine" and tm["source"].startswith("measured")
    want = engine_calls(db, ("fast", "slow"), 2 * p.micro_batch_size * 128
                        * get_model(TINY).hidden_size)
    assert (tm["op_forward_ms"], tm["op_backward_ms"], tm["send_call_ms"],
            tm["recv_ready_ms"]) == pytest.approx(want.as_tuple(), abs=1e-6)
    q = Plan.from_json(p.to_json())
    assert q.rederived_iteration_time_ms() == pytest.approx(p.predicted_iteration_time_ms,
                                                            rel=1e-6, abs=1e-4)
    # without the costs the same plan's numbers give a shorter time: they were charged
    bare = dataclasses.replace(q, engine_calls=(0.0, 0.0, 0.0, 0.0))
    # (at least one forward and one backward: op overheads 0.4 + 0.6 ms)
    assert q.rederived_iteration_time_ms() - bare.rederived_iteration_time_ms() >= 1.0 - 1e-5
    # a DB without such records plans as before (the timing of older DBs)
    tb = json.loads(base_plan.to_json())["timing_model"]
    assert tb["source"] == "none" and tb["send_call_ms"] == 0.0
    assert base_plan.rederived_iteration_time_ms() == pytest.approx(
        base_plan.predicted_iteration_time_ms, rel=1e-6, abs=1e-4)


def test_old_plan_json_with_a_bare_timing_model_still_loads(base_plan):
    d = json.loads(base_plan.to_json())
    d["timing_model"] = "engine"
    q = Plan.from_json(json.dumps(d))
    assert q.engine_calls == (0.0, 0.0, 0.0, 0.0)
    assert q.rederived_iteration_time_ms() == pytest.approx(
        base_plan.predicted_iteration_time_ms, rel=1e-6, abs=1e-4)
    d["timing_model"] = {"name": "paper"}
    with pytest.raises(PoseidonError, match="timing_model"):
        Plan.from_json(json.dumps(d))
