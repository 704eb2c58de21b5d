"""The per-op overheads and per-call p2p costs a launch / ``poseidon profile`` measures
(``megatron/profile/callcost_profile.py``, ``megatron/profile/op_overhead.py``; issue 30, item 5), on their
pure-Python side (no processes; the runs under torchrun are in test_launch_e2e.py and
test_profile_torchrun.py):

* one rank pair per link kind of the launch's topology, the search's message sizes;
* the gathered measurements become ``op_overheads`` (each type's median over its ranks) and
  ``p2p_calls`` records, and a DB holding them all is "cached" (nothing measured again);
* the search charges exactly the stored overheads: a one-device plan (no p2p) of M
  micro-batches is M x (forward + backward overhead) slower, the largest type's, and its JSON
  names the records and re-derives the time;
* a launch's cache with a bad record is refused as a profile DB is (one line).
"""

from __future__ import annotations

import json

import pytest

from poseidon_plugin.callcosts import OpOverhead, P2PCall, engine_calls
from poseidon_plugin.cluster import load_cluster
from poseidon_plugin.errors import ProfileDBError
from poseidon_plugin.megatron.profile.callcost_profile import (activation_messages, engine_cost_records,
                                                       engine_costs_cached, link_pairs)
from poseidon_plugin.megatron.launch.discovery import DeviceInfo, group_nodes
from poseidon_plugin.megatron.profile.op_overhead import engine_overheads
from poseidon_plugin.megatron.calibrate.recorder import IterationRecord
from poseidon_plugin.model import get_model
from poseidon_plugin.plan import Plan
from poseidon_plugin.profiles import ProfileDB
from poseidon_plugin.search import SearchOptions, search_plan

TINY = "examples/models/tiny-gpt.yaml"


def _topo(layout):
    """``layout``: (host, device type) per launch rank."""
    local: dict[str, int] = {}
    infos = []
    for r, (host, t) in enumerate(layout):
        infos.append(DeviceInfo(r, local.get(host, 0), host, t, 0, "emulated"))
        local[host] = local.get(host, 0) + 1
    return group_nodes(infos)


def test_one_pair_per_link_kind_the_launch_has():
    topo = _topo([("h0", "A"), ("h0", "A"), ("h1", "A"), ("h1", "A"),
                  ("h2", "B"), ("h2", "B")])
    pairs = link_pairs(topo)
    kinds = {(link, t) for link, t, _, _ in pairs}
    assert kinds == {("intra-node", "A"), ("intra-node", "B"), ("inter-node", "A"),
                     ("cross-type", "A")}
    for link, t, a, b in pairs:
        ia, ib = topo.infos[a], topo.infos[b]
        assert ia.device_type == t
        assert (ia.host == ib.host) == (link == "intra-node")
        assert (ia.device_type != ib.device_type) == (link == "cross-type")
    # one rank per host and type: no intra-node pair; one type on one host: no link at all
    assert link_pairs(_topo([("h0", "A"), ("h1", "B")])) == [("cross-type", "A", 0, 1)]
    assert link_pairs(_topo([("h0", "A")])) == []


def test_messages_are_the_searchs_activation_bytes():
    from poseidon_plugin.costs import CostModel

    msgs = activation_messages(128, [128, 32], [1, 2])
    assert msgs == {2 * 128 * 128: 128 * 128, 2 * 2 * 128 * 128: 2 * 128 * 128,
                    2 * 32 * 128: 32 * 128, 2 * 2 * 32 * 128: 2 * 32 * 128}
    cm = CostModel(load_cluster("examples/clusters/small-two-type.yaml"), get_model(TINY),
                   seq_length=128)
    assert cm.activation_bytes(2) == 2 * 2 * 128 * get_model(TINY).hidden_size
    assert int(cm.activation_bytes(2)) in activation_messages(get_model(TINY).hidden_size,
                                                              [128], [2])


def test_overheads_are_the_medians_of_the_recorded_ops():
    r = IterationRecord(0, 0.0, 1.0, [(0, 0, False, 0.1, 0.1002), (0, 0, True, 0.2, 0.2004),
                                      (0, 1, False, 0.3, 0.3006), (0, 1, True, 0.4, 0.4008),
                                      (0, 2, False, 0.5, 0.5004)])
    got = engine_overheads([r])
    assert got["forward_ms"] == pytest.approx(0.4)
    assert got["backward_ms"] == pytest.approx(0.6)
    assert engine_overheads([IterationRecord(0)])["forward_ms"] == 0.0


def _gathered():
    # per launch rank: (its op overheads, the call records it measured as a pair's sender)
    return [({"forward_ms": 0.2, "backward_ms": 0.3}, [P2PCall("A", "intra-node", 4096, 0.1,
                                                                 0.2, 0.01)]),
            ({"forward_ms": 0.4, "backward_ms": 0.1}, []),
            ({"forward_ms": 0.3, "backward_ms": 0.2}, [P2PCall("A", "cross-type", 4096, 0.3,
                                                                 0.4, 0.02)]),
            ({"forward_ms": 0.9, "backward_ms": 0.8}, [])]


def test_gathered_measurements_become_records_and_a_full_db_is_cached():
    ops, calls = engine_cost_records(_gathered(), {0: "A", 1: "A", 2: "A", 3: "B"})
    assert ops == [OpOverhead("A", 0.3, 0.2), OpOverhead("B", 0.9, 0.8)]
    assert [c.key for c in calls] == [("A", "intra-node", 4096), ("A", "cross-type", 4096)]
    assert all(o.source == "measured" for o in ops) and all(c.source == "measured" for c in calls)
    db = ProfileDB(None)
    pairs = [("intra-node", "A", 0, 1), ("cross-type", "A", 0, 3)]
    assert not engine_costs_cached(db, ["A", "B"], pairs, {4096: 2048})
    for o in ops:
        db.put_op_overhead(o)
    assert not engine_costs_cached(db, ["A", "B"], pairs, {4096: 2048})   # no calls yet
    for c in calls:
        db.put_p2p_call(c)
    assert engine_costs_cached(db, ["A", "B"], pairs, {4096: 2048})
    assert not engine_costs_cached(db, ["A", "B"], pairs, {4096: 2048, 8192: 4096})
    assert not engine_costs_cached(db, ["A", "B", "C"], pairs, {4096: 2048})
    # written and read back as a launch's cache file is
    back = ProfileDB.from_json(db.to_json())
    assert back.op_overheads() == db.op_overheads() and back.p2p_calls() == db.p2p_calls()


ONE_DEVICE = """name: one
device_types:
  A: {memory_gib: 16, peak_tflops: 100, efficiency: 0.5, intra_node_gbps: 100}
  B: {memory_gib: 16, peak_tflops: 100, efficiency: 0.5, intra_node_gbps: 100}
nodes:
  - {device_type: A, devices_per_node: 1}
links: {inter_node_gbps: 10, cross_type_gbps: 10}
"""


def _one_device_plan(tmp_path, db):
    path = tmp_path / "one.yaml"
    path.write_text(ONE_DEVICE)
    return search_plan(load_cluster(str(path)), get_model(TINY), SearchOptions(
        global_batch_size=4, seq_length=128, micro_batch_sizes=(1,), tp_degrees=(1,),
        workers=1, warmup_samples=10), db)


def test_the_search_charges_the_stored_overheads_exactly(tmp_path):
    bare = _one_device_plan(tmp_path, ProfileDB(None))
    assert (bare.pp, bare.num_microbatches) == (1, 4)
    db = ProfileDB(None)
    ops, calls = engine_cost_records(_gathered(), {0: "A", 1: "A", 2: "A", 3: "B"})
    for o in ops:
        db.put_op_overhead(o)
    for c in calls:
        db.put_p2p_call(c)
    charged = _one_device_plan(tmp_path, db)
    # the cluster has type A only: A's records are charged (B's larger ones are not)
    assert charged.predicted_iteration_time_ms - bare.predicted_iteration_time_ms == \
        pytest.approx(4 * (0.3 + 0.2), abs=1e-4)
    tm = json.loads(charged.to_json())["timing_model"]
    assert (tm["op_forward_ms"], tm["op_backward_ms"]) == pytest.approx((0.3, 0.2))
    assert tm["source"] == engine_calls(db, ["A"], 2 * 128 * get_model(TINY).hidden_size).source
    assert tm["source"].startswith("measured: op_overheads A (forward), A (backward); "
                                   "p2p_calls A cross-type at 4096 B (send call)"), tm
    q = Plan.from_json(charged.to_json())
    assert q.rederived_iteration_time_ms() == pytest.approx(
        charged.predicted_iteration_time_ms, rel=1e-6, abs=1e-4)


@pytest.mark.parametrize("record, field", [
    ({"op_overheads": [{"device_type": "A", "forward_ms": float("inf"), "backward_ms": 0}]},
     "forward_ms"),
    ({"p2p_calls": [{"device_type": "A", "link": "intra-node", "message_bytes": 4096,
                     "send_call_ms": 0.1, "recv_ready_ms": -0.2}]}, "recv_ready_ms"),
])
def test_a_launch_cache_with_a_bad_record_is_set_aside(tmp_path, record, field):
    from poseidon_plugin.megatron.profile.profile_gather import load_cache

    path = tmp_path / "profiles-x.json"
    path.write_text(json.dumps({"version": 1, "records": [], **record}))
    with pytest.raises(ProfileDBError, match=field):
        ProfileDB.load(str(path))
    db = load_cache(str(path), reprofile=False)   # the launch re-measures, old file kept
    assert db.op_overheads() == [] and db.p2p_calls() == []
    assert not path.exists() and list(tmp_path.glob("profiles-x.json.corrupt-*"))
