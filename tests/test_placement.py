"""Placement: pools in cluster order, deterministic packing, TP groups inside one node, no device
used twice, unused devices reported, and the link rules (intra / inter-node of a type / cross-type).

Expected values are written out by hand from the rule in ``placement.py``'s docstring, never by
calling the code under test a second way.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from poseidon_plugin.cluster import cluster_from_dict, load_cluster
from poseidon_plugin.errors import PoseidonError
from poseidon_plugin.model import get_model
from poseidon_plugin.placement import (aligned_start, place_stages, ring_gbps, send_link_gbps,
                                       type_pools)
from poseidon_plugin.search import SearchOptions, search_plan

SMALL = "examples/clusters/small-two-type.yaml"   # 2 x 4 fast, 2 x 4 slow


def two_type_cluster(fast_nodes=2, fast_per_node=4, slow_nodes=2, slow_per_node=4,
                     interleave=False):
    nodes = [{"device_type": "fast", "devices_per_node": fast_per_node, "count": fast_nodes},
             {"device_type": "slow", "devices_per_node": slow_per_node, "count": slow_nodes}]
    if interleave:  # fast, slow, fast, slow: pools must still be per type, in file order
        nodes = [{"device_type": "fast", "devices_per_node": fast_per_node},
                 {"device_type": "slow", "devices_per_node": slow_per_node},
                 {"device_type": "fast", "devices_per_node": fast_per_node},
                 {"device_type": "slow", "devices_per_node": slow_per_node}]
    return cluster_from_dict({
        "name": "t",
        "device_types": {"fast": {"memory_gib": 16, "peak_tflops": 200, "intra_node_gbps": 800},
                         "slow": {"memory_gib": 8, "peak_tflops": 100, "intra_node_gbps": 400}},
        "nodes": nodes,
        "links": {"inter_node_gbps": {"fast": 200, "slow": 100}, "cross_type_gbps": 50,
                  "latency_ms": 0.01}})


# --------------------------------------------------------------------------- pools

def test_pools_follow_cluster_order():
    pools = type_pools(load_cluster(SMALL))
    assert [p.device_type for p in pools] == ["fast", "slow"]
    assert pools[0].node_of == (0, 0, 0, 0, 1, 1, 1, 1)
    assert pools[0].local_of == (0, 1, 2, 3, 0, 1, 2, 3)
    assert pools[1].node_of == (2, 2, 2, 2, 3, 3, 3, 3)
    assert pools[1].local_of == (0, 1, 2, 3, 0, 1, 2, 3)


def test_pools_of_interleaved_node_file():
    pools = type_pools(two_type_cluster(interleave=True))
    assert pools[0].node_of == (0, 0, 0, 0, 2, 2, 2, 2)
    assert pools[1].node_of == (1, 1, 1, 1, 3, 3, 3, 3)


# --------------------------------------------------------------------------- packing by hand

def test_packing_by_hand():
    pools = type_pools(load_cluster(SMALL))
    # stage 0: fast tp2 dp2; stage 1: fast tp1 dp2; stage 2: slow tp4 dp2
    placements, unused = place_stages(pools, [0, 0, 1], [2, 1, 4], 2)
    assert placements[0].slots == (((0, 0), (0, 1)), ((0, 2), (0, 3)))
    assert placements[1].slots == (((1, 0),), ((1, 1),))
    assert placements[2].slots == (((2, 0), (2, 1), (2, 2), (2, 3)),
                                   ((3, 0), (3, 1), (3, 2), (3, 3)))
    assert [p.start for p in placements] == [0, 4, 0]
    assert unused == ((1, 2), (1, 3))


def test_alignment_skips_devices_and_reports_them_unused():
    pools = type_pools(load_cluster(SMALL))
    # fast tp1 dp1 takes (0,0); fast tp2 dp1 must start at an even local index: (0,2),(0,3);
    # (0,1) is skipped; a following fast tp4 dp1 cannot start at local 0 of node 0 -> node 1.
    placements, unused = place_stages(pools, [0, 0, 0], [1, 2, 4], 1)
    assert placements[0].slots == (((0, 0),),)
    assert placements[1].slots == (((0, 2), (0, 3)),)
    assert placements[2].slots == (((1, 0), (1, 1), (1, 2), (1, 3)),)
    assert unused == ((0, 1),) + tuple((n, d) for n in (2, 3) for d in range(4))


def test_aligned_start_rule():
    pool = type_pools(load_cluster(SMALL))[0]
    assert aligned_start(pool, 0, 4) == 0
    assert aligned_start(pool, 1, 2) == 2
    assert aligned_start(pool, 1, 4) == 4   # next node
    assert aligned_start(pool, 5, 4) == 8   # past the pool: caller reports "not enough"
    assert aligned_start(pool, 8, 2) == 8   # at the end: unchanged


def test_not_enough_devices_is_a_user_error():
    pools = type_pools(load_cluster(SMALL))
    with pytest.raises(PoseidonError, match="not enough slow devices"):
        place_stages(pools, [1, 1], [4, 1], 2)   # slow: 8 + 2 > 8


def test_packing_is_deterministic():
    pools = type_pools(load_cluster(SMALL))
    a = place_stages(pools, [0, 1, 0, 1], [2, 1, 1, 2], 1)
    b = place_stages(type_pools(load_cluster(SMALL)), [0, 1, 0, 1], [2, 1, 1, 2], 1)
    assert a == b


# --------------------------------------------------------------------------- invariants

cluster_st = st.tuples(st.integers(1, 3), st.sampled_from([1, 2, 4, 8]),
                       st.integers(1, 3), st.sampled_from([2, 4, 8]), st.booleans())


@st.composite
def layouts(draw):
    fn, fper, sn, sper, inter = draw(cluster_st)
    cluster = two_type_cluster(fn, fper, sn, sper, interleave=inter)
    pools = type_pools(cluster)
    dp = draw(st.sampled_from([1, 2, 4]))
    nstages = draw(st.integers(1, 6))
    types, tps = [], []
    for _ in range(nstages):
        k = draw(st.integers(0, 1))
        node_size = max(pools[k].local_of) + 1
        tp = draw(st.sampled_from([t for t in (1, 2, 4, 8) if node_size % t == 0]))
        types.append(k)
        tps.append(tp)
    return cluster, pools, types, tps, dp


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(layouts())
def test_placement_invariants(layout):
    cluster, pools, types, tps, dp = layout
    try:
        placements, unused = place_stages(pools, types, tps, dp)
    except PoseidonError:
        # only when some type really runs out: recompute the demand by hand (with alignment)
        need = {0: 0, 1: 0}
        for k, t in zip(types, tps):
            per_node = max(pools[k].local_of) + 1
            cur = need[k]
            if cur % per_node % t:
                cur += t - cur % per_node % t
            need[k] = cur + dp * t
        assert any(need[k] > pools[k].size for k in need)
        return
    all_slots = {(n.index, d) for n in cluster.nodes for d in range(n.num_devices)}
    used = [slot for p in placements for grp in p.slots for slot in grp]
    assert len(used) == len(set(used)), "a device is used twice"
    assert len(used) == dp * sum(tps)
    assert set(used) | set(unused) == all_slots
    assert not set(used) & set(unused)
    assert list(unused) == sorted(unused)
    for p, k, t in zip(placements, types, tps):
        assert len(p.slots) == dp
        for grp in p.slots:
            assert len(grp) == t
            assert len({n for n, _ in grp}) == 1, "TP group spans nodes"
            assert all(cluster.nodes[n].device_type == pools[k].device_type for n, _ in grp)
            locals_ = [d for _, d in grp]
            assert locals_ == list(range(locals_[0], locals_[0] + t))
            assert locals_[0] % t == 0
    assert place_stages(pools, types, tps, dp) == (placements, unused)


# --------------------------------------------------------------------------- links

def test_send_link_same_node_same_type_cross_type():
    cluster = load_cluster(SMALL)
    pools = type_pools(cluster)
    # fast(0,0) -> fast(0,1): same node
    p, _ = place_stages(pools, [0, 0], [1, 1], 1)
    assert send_link_gbps(cluster, p[0], p[1]) == 800
    # fast node 0 (4 devices) -> fast node 1: same type, other node
    p, _ = place_stages(pools, [0, 0], [4, 1], 1)
    assert p[1].slots == (((1, 0),),)
    assert send_link_gbps(cluster, p[0], p[1]) == 200
    # slow -> slow across nodes uses the slow type's inter-node link
    p, _ = place_stages(pools, [1, 1], [4, 4], 1)
    assert send_link_gbps(cluster, p[0], p[1]) == 100
    # fast -> slow: cross-type
    p, _ = place_stages(pools, [0, 1], [1, 1], 1)
    assert send_link_gbps(cluster, p[0], p[1]) == 50


def test_send_link_is_slowest_replica_pair():
    cluster = load_cluster(SMALL)
    pools = type_pools(cluster)
    # stage 0: fast dp3 at (0,0),(0,1),(0,2); stage 1: fast dp3 at (0,3),(1,0),(1,1)
    p, _ = place_stages(pools, [0, 0], [1, 1], 3)
    assert [g[0] for g in p[1].slots] == [(0, 3), (1, 0), (1, 1)]
    assert send_link_gbps(cluster, p[0], p[1]) == 200    # replica 0 intra (800), 1 and 2 inter


def test_ring_link():
    cluster = load_cluster(SMALL)
    pools = type_pools(cluster)
    p, _ = place_stages(pools, [0], [1], 4)          # one fast node: intra
    assert ring_gbps(cluster, p[0]) == 800
    p, _ = place_stages(pools, [0], [2], 4)          # both fast nodes: fast inter-node
    assert ring_gbps(cluster, p[0]) == 200
    p, _ = place_stages(pools, [1], [1], 8)          # both slow nodes: slow inter-node
    assert ring_gbps(cluster, p[0]) == 100
    p, _ = place_stages(pools, [1, 1], [1, 1], 3)    # stage 1 at (2,3),(3,0),(3,1): spans
    assert ring_gbps(cluster, p[1]) == 100


# --------------------------------------------------------------------------- the search's plans

@pytest.mark.parametrize("tp_mode", ["uniform", "per-stage"])
def test_search_plans_use_the_documented_placement(tp_mode):
    """The Cython search places stages itself; its plan must match ``place_stages``."""
    cluster = load_cluster(SMALL)
    model = get_model("examples/models/tiny-gpt.yaml")
    plan = search_plan(cluster, model, SearchOptions(
        global_batch_size=16, seq_length=128, workers=1, tp_mode=tp_mode, warmup_samples=20))
    pools = type_pools(cluster)
    types = [cluster.type_names.index(s.device_type) for s in plan.stages]
    placements, unused = place_stages(pools, types, [s.tp for s in plan.stages], plan.dp)
    for s, p in zip(plan.stages, placements):
        assert tuple(tuple((d.node, d.local_device) for d in grp) for grp in s.devices) == p.slots
    assert tuple((d.node, d.local_device) for d in plan.unused_devices) == unused
    assert plan.world_size + len(plan.unused_devices) == cluster.total_devices


def test_tp_group_never_spans_nodes():
    """2 nodes x 6 devices, tp=4, dp=2: replica 1 would take (0,4),(0,5),(1,0),(1,1)."""
    cluster = two_type_cluster(fast_nodes=2, fast_per_node=6)
    pools = type_pools(cluster)
    with pytest.raises(PoseidonError, match="span nodes"):
        place_stages(pools, [0], [4], 2)
    # one replica fits in node 0 (devices 0..3); the second stage's group would span again
    with pytest.raises(PoseidonError, match="span nodes"):
        place_stages(pools, [0, 0], [4, 4], 1)
    # tp dividing the node size still packs across nodes, one group per node part
    placements, _ = place_stages(pools, [0], [2], 4)
    assert placements[0].slots == (((0, 0), (0, 1)), ((0, 2), (0, 3)), ((0, 4), (0, 5)),
                                   ((1, 0), (1, 1)))
