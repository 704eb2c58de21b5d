"""Stage costs, checked by hand against the per-layer profiles and the link rules.

* F / B of a stage = layers x one layer's profile (+ embedding on stage 0, + output layer on the
  last; interleaved: per chunk, embedding on chunk 0 of stage 0, output on chunk V-1 of the last);
* activation send = 2 * b * S * h bytes / link bandwidth + latency, the link being intra-node,
  the type's inter-node link, or the cross-type link;
* DP all-reduce = 2(d-1)/d * gradient bytes / slowest ring link + 2(d-1) latency, gradient bytes =
  the stage's bf16 parameters on one device;
* the numbers a searched plan reports are the same hand-computed numbers.

Bandwidths are Gbit/s: bytes / (gbps * 1e9 / 8) s = bytes / (gbps * 125_000) ms.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from poseidon_plugin import comm, costs, memory, profiles
from poseidon_plugin.cluster import cluster_from_dict, load_cluster
from poseidon_plugin.comm import allreduce_ms, send_ms
from poseidon_plugin.costs import CostModel, chunk_layers, simulator_arrays
from poseidon_plugin.model import get_model
from poseidon_plugin.profiles import ProfileKey, lookup_profile
from poseidon_plugin.search import SearchOptions, search_plan

SMALL = "examples/clusters/small-two-type.yaml"   # fast: 2 x 4 (800 intra, 200 inter), slow:
TINY = "examples/models/tiny-gpt.yaml"             # 2 x 4 (400, 100), cross 50, latency 0.01
SEQ = 128
LAT = 0.01


def bytes_per_ms(gbps: float) -> float:
    return gbps * 125_000.0


@pytest.fixture(scope="module")
def cm():
    return CostModel(load_cluster(SMALL), get_model(TINY), None, seq_length=SEQ)


def prof(cm, type_name, kind, tp, b):
    return lookup_profile(None, cm.cluster, cm.model,
                          ProfileKey(type_name, kind, tp, b, SEQ, cm.model.signature()))


# --------------------------------------------------------------------------- formulas

def test_send_formula_by_hand():
    assert send_ms(1_000_000, 100, 0.0) == pytest.approx(1_000_000 / 12_500_000)   # 0.08 ms
    assert send_ms(1_000_000, 100, 0.5) == pytest.approx(0.58)
    # the documented rule (comm.py): 0 bytes -> 0 ms, no latency either (no message is sent)
    assert send_ms(0, 100, 0.5) == 0.0


def test_allreduce_formula_by_hand():
    assert allreduce_ms(1e9, 1, 100, 0.01) == 0.0
    # d = 2: 2 * 1/2 * 1e9 B / 12.5e6 B/ms = 80 ms, + 2 latencies
    assert allreduce_ms(1e9, 2, 100, 0.01) == pytest.approx(80.0 + 0.02)
    # d = 4: 2 * 3/4 * 1e9 / 12.5e6 = 120 ms, + 6 latencies
    assert allreduce_ms(1e9, 4, 100, 0.01) == pytest.approx(120.0 + 0.06)


# One definition per formula (comm.send_ms, comm.allreduce_ms, costs.chunk_layers): every Python
# caller uses it, and its floating-point arithmetic is the one the Cython search repeats, so the
# values are pinned bit for bit, not approximately.

SEND_CASES = [(1_000_000.0, 100.0, 0.0), (1_000_000.0, 100.0, 0.5), (3 * 2**20, 75.0, 0.01),
              (2.0 * 4 * 4096 * 8192, 1400.0, 0.003), (1.0, 0.1, 0.0), (123_456.789, 37.5, 1e-4)]


@pytest.mark.parametrize("num_bytes,gbps,latency", SEND_CASES)
def test_send_ms_arithmetic_is_pinned(num_bytes, gbps, latency):
    assert send_ms(num_bytes, gbps, latency) == num_bytes * 8.0 / (gbps * 1e6) + latency


def test_send_ms_zero_bytes_is_zero():
    for latency in (0.0, 0.01, 5.0):
        assert send_ms(0, 100, latency) == 0.0
        assert send_ms(0.0, 0.5, latency) == 0.0
        assert send_ms(-1.0, 100, latency) == 0.0


@pytest.mark.parametrize("num_bytes,gbps,latency", SEND_CASES)
@pytest.mark.parametrize("ranks", [2, 3, 4, 7, 8, 96])
def test_allreduce_ms_arithmetic_is_pinned(num_bytes, gbps, latency, ranks):
    want = (2.0 * (ranks - 1) * latency
            + 2.0 * (ranks - 1) / ranks * num_bytes * 8.0 / (gbps * 1e6))
    assert allreduce_ms(num_bytes, ranks, gbps, latency) == want


def test_allreduce_ms_one_rank_or_zero_bytes_is_zero():
    for ranks in (0, 1):
        assert allreduce_ms(1e9, ranks, 100, 0.01) == 0.0
        assert allreduce_ms(1e9, ranks, 100, 0.0) == 0.0
    for ranks in (2, 8):
        assert allreduce_ms(0, ranks, 100, 0.01) == 0.0   # nothing to reduce: no latency either
        assert allreduce_ms(-5.0, ranks, 100, 0.01) == 0.0


def test_allreduce_ms_is_two_sends_of_a_share_per_step():
    # ring: 2(d-1) steps, each moving bytes/d and paying one latency
    for d in (2, 4, 8):
        step = send_ms(1e8 / d, 200, 0.02)
        assert allreduce_ms(1e8, d, 200, 0.02) == pytest.approx(2 * (d - 1) * step, rel=1e-12)


def test_one_definition_per_formula():
    # the cost model and the profile estimator call the same functions, not copies
    assert costs.send_ms is comm.send_ms
    assert costs.dp_sync_ms is comm.dp_sync_ms
    assert profiles.allreduce_ms is comm.allreduce_ms
    assert not hasattr(profiles, "send_ms")


def test_chunk_layers():
    assert chunk_layers(7, 1) == (7,)
    assert chunk_layers(7, 2) == (4, 3)
    assert chunk_layers(8, 3) == (3, 3, 2)
    assert sum(chunk_layers(13, 4)) == 13


def test_chunk_layers_split_rule():
    for layers in range(0, 41):
        for v in range(1, 9):
            split = chunk_layers(layers, v)
            assert isinstance(split, tuple) and len(split) == v
            assert sum(split) == layers                       # every layer in one chunk
            assert max(split) - min(split) <= 1               # as even as possible
            assert list(split) == sorted(split, reverse=True)  # the larger chunks first
            assert split == tuple(layers // v + (1 if c < layers % v else 0) for c in range(v))
    assert chunk_layers(5, 4) == (2, 1, 1, 1)
    assert chunk_layers(3, 4) == (1, 1, 1, 0)


def test_stage_costs_split_chunks_by_chunk_layers(cm):
    # interleaved stage costs: chunk c of a stage costs chunk_layers(l, V)[c] decoder layers
    # (+ the embedding on chunk 0 of stage 0, the output layer on chunk V-1 of the last stage)
    layers, v = [5, 7], 3
    stages, _, _ = cm.stage_costs(stage_types=[0, 0], stage_tps=[1, 1], layers=layers, dp=1,
                                  micro_batch_size=1, num_microbatches=4,
                                  schedule="interleaved-1f1b", virtual_stages=v)
    lc = cm.layer_costs(0, 1, 1)
    for s, st in enumerate(stages):
        want_f = [c * lc.forward_ms for c in chunk_layers(layers[s], v)]
        want_b = [c * lc.backward_ms for c in chunk_layers(layers[s], v)]
        if s == 0:
            want_f[0] += lc.embedding_forward_ms
            want_b[0] += lc.embedding_backward_ms
        if s == len(layers) - 1:
            want_f[v - 1] += lc.output_forward_ms
            want_b[v - 1] += lc.output_backward_ms
        assert st.chunk_forward_ms == tuple(want_f)
        assert st.chunk_backward_ms == tuple(want_b)


# --------------------------------------------------------------------------- layer costs

def test_layer_costs_are_the_profiles(cm):
    for k, name in enumerate(cm.type_names):
        for tp in (1, 2, 4):
            for b in (1, 2):
                lc = cm.layer_costs(k, tp, b)
                dec, emb, out = (prof(cm, name, kind, tp, b)
                                 for kind in ("decoder", "embedding", "output"))
                assert lc.forward_ms == dec.forward_ms and lc.backward_ms == dec.backward_ms
                assert lc.embedding_forward_ms == emb.forward_ms
                assert lc.embedding_backward_ms == emb.backward_ms
                assert lc.output_forward_ms == out.forward_ms
                assert lc.output_backward_ms == out.backward_ms
                # Megatron all-reduces a bf16 model's gradients in fp32 by default
                assert lc.grad_bytes == 2 * dec.param_bytes


def test_activation_bytes(cm):
    assert cm.activation_bytes(1) == 2 * 1 * SEQ * 256
    assert cm.activation_bytes(4) == 2 * 4 * SEQ * 256


# --------------------------------------------------------------------------- stage costs

def _stage_costs(cm, types, tps, layers, dp, b=1, m=8, schedule="1f1b", v=1):
    return cm.stage_costs(stage_types=types, stage_tps=tps, layers=layers, dp=dp,
                          micro_batch_size=b, num_microbatches=m, schedule=schedule,
                          virtual_stages=v)


def test_forward_backward_by_hand(cm):
    # stage 0: fast tp1 3 layers, stage 1: fast tp2 2 layers, stage 2: slow tp1 3 layers; dp 1
    stages, _, _ = _stage_costs(cm, [0, 0, 1], [1, 2, 1], [3, 2, 3], 1, b=2)
    d0, e0 = prof(cm, "fast", "decoder", 1, 2), prof(cm, "fast", "embedding", 1, 2)
    d1 = prof(cm, "fast", "decoder", 2, 2)
    d2, o2 = prof(cm, "slow", "decoder", 1, 2), prof(cm, "slow", "output", 1, 2)
    assert stages[0].forward_ms == pytest.approx(3 * d0.forward_ms + e0.forward_ms)
    assert stages[0].backward_ms == pytest.approx(3 * d0.backward_ms + e0.backward_ms)
    assert stages[1].forward_ms == pytest.approx(2 * d1.forward_ms)
    assert stages[1].backward_ms == pytest.approx(2 * d1.backward_ms)
    assert stages[2].forward_ms == pytest.approx(3 * d2.forward_ms + o2.forward_ms)
    assert stages[2].backward_ms == pytest.approx(3 * d2.backward_ms + o2.backward_ms)
    for s in stages:
        assert s.allreduce_ms == 0.0   # dp = 1


def test_single_stage_holds_embedding_and_output(cm):
    stages, _, _ = _stage_costs(cm, [0], [1], [8], 1)
    d, e, o = (prof(cm, "fast", k, 1, 1) for k in ("decoder", "embedding", "output"))
    assert stages[0].forward_ms == pytest.approx(8 * d.forward_ms + e.forward_ms + o.forward_ms)
    assert stages[0].backward_ms == pytest.approx(8 * d.backward_ms + e.backward_ms
                                                  + o.backward_ms)
    assert stages[0].send_forward_ms == 0.0 and stages[0].send_backward_ms == 0.0


def test_interleaved_chunks_by_hand(cm):
    # 2 stages x V=2 chunks, layers 5 and 3: chunks (3, 2) and (2, 1)
    stages, placements, _ = _stage_costs(cm, [0, 1], [1, 1], [5, 3], 1, m=4,
                                         schedule="interleaved-1f1b", v=2)
    d0, e0 = prof(cm, "fast", "decoder", 1, 1), prof(cm, "fast", "embedding", 1, 1)
    d1, o1 = prof(cm, "slow", "decoder", 1, 1), prof(cm, "slow", "output", 1, 1)
    assert stages[0].chunk_forward_ms == pytest.approx((3 * d0.forward_ms + e0.forward_ms,
                                                        2 * d0.forward_ms))
    assert stages[0].chunk_backward_ms == pytest.approx((3 * d0.backward_ms + e0.backward_ms,
                                                         2 * d0.backward_ms))
    assert stages[1].chunk_forward_ms == pytest.approx((2 * d1.forward_ms,
                                                        1 * d1.forward_ms + o1.forward_ms))
    assert stages[1].forward_ms == pytest.approx(sum(stages[1].chunk_forward_ms))
    # wrap-around link: slow (node 2) -> fast (node 0) is cross-type
    act = 2 * 1 * SEQ * 256
    assert cm.wrap_send_ms(placements, 1) == pytest.approx(act / bytes_per_ms(50) + LAT)
    F, B, Pf, Pb, R = simulator_arrays(stages, 2, cm.wrap_send_ms(placements, 1))
    assert F.shape == (2, 2) and B.shape == (2, 2)
    assert F[0, 0] == stages[0].chunk_forward_ms[0] and F[1, 1] == stages[1].chunk_forward_ms[1]
    assert list(Pf) == pytest.approx([stages[0].send_forward_ms,
                                      act / bytes_per_ms(50) + LAT])
    assert list(Pb) == list(Pf)


@pytest.mark.parametrize("b", [1, 4])
def test_send_uses_the_right_link(cm, b):
    act = 2 * b * SEQ * 256
    # fast(0,0) -> fast(0,1) [intra 800] -> fast node 1 [tp4, inter 200] -> slow [cross 50]
    # -> slow (node 2, tp 2 at (2,0..1)) -> slow (2,2..3) [intra 400]
    stages, placements, _ = _stage_costs(cm, [0, 0, 0, 1, 1], [1, 1, 4, 2, 2],
                                         [1, 1, 1, 1, 4], 1, b=b)
    assert placements[2].slots[0][0] == (1, 0)
    expected = [act / bytes_per_ms(800) + LAT, act / bytes_per_ms(200) + LAT,
                act / bytes_per_ms(50) + LAT, act / bytes_per_ms(400) + LAT]
    assert [s.send_forward_ms for s in stages[:-1]] == pytest.approx(expected)
    assert [s.send_backward_ms for s in stages[:-1]] == pytest.approx(expected)
    assert stages[-1].send_forward_ms == 0.0 and stages[-1].send_backward_ms == 0.0
    # slow inter-node: slow tp4 on node 2 -> slow on node 3
    stages, _, _ = _stage_costs(cm, [1, 1], [4, 1], [4, 4], 1, b=b)
    assert stages[0].send_forward_ms == pytest.approx(act / bytes_per_ms(100) + LAT)


def test_send_uses_the_slowest_replica(cm):
    act = 2 * SEQ * 256
    # dp 3: stage 0 fast (0,0..2); stage 1 fast (0,3), (1,0), (1,1): replicas 1, 2 cross nodes
    stages, _, _ = _stage_costs(cm, [0, 0], [1, 1], [4, 4], 3, m=4)
    assert stages[0].send_forward_ms == pytest.approx(act / bytes_per_ms(200) + LAT)


def test_allreduce_by_hand(cm):
    # stage 0: fast tp1 dp4 inside node 0 (ring intra 800); stage 1: fast tp1 dp4 on node 1
    # (intra 800); stage 2: slow tp2 dp4: node 2 and node 3 -> slow inter-node 100
    stages, _, _ = _stage_costs(cm, [0, 0, 1], [1, 1, 2], [3, 3, 2], 4, m=2)
    d0, e0 = prof(cm, "fast", "decoder", 1, 1), prof(cm, "fast", "embedding", 1, 1)
    d2, o2 = prof(cm, "slow", "decoder", 2, 1), prof(cm, "slow", "output", 2, 1)

    def ring(param_bytes, gbps):   # fp32 gradients: 2 x the bf16 parameter bytes
        return 2 * 3 / 4 * 2 * param_bytes / bytes_per_ms(gbps) + 2 * 3 * LAT

    assert stages[0].allreduce_ms == pytest.approx(ring(3 * d0.param_bytes + e0.param_bytes, 800))
    assert stages[1].allreduce_ms == pytest.approx(ring(3 * d0.param_bytes, 800))
    assert stages[2].allreduce_ms == pytest.approx(ring(2 * d2.param_bytes + o2.param_bytes, 100))


def test_allreduce_ring_spanning_nodes_uses_inter_link(cm):
    # fast tp1 dp 8: both fast nodes, ring bottleneck = fast inter-node 200
    stages, _, _ = _stage_costs(cm, [0], [1], [8], 8, m=1)
    d, e, o = (prof(cm, "fast", k, 1, 1) for k in ("decoder", "embedding", "output"))
    grad = 2 * (8 * d.param_bytes + e.param_bytes + o.param_bytes)   # fp32 gradients
    assert stages[0].allreduce_ms == pytest.approx(2 * 7 / 8 * grad / bytes_per_ms(200) + 14 * LAT)


def test_memory_is_the_memory_model(cm):
    stages, _, _ = _stage_costs(cm, [0, 1], [1, 2], [5, 3], 2, b=2, m=4, schedule="eager-1f1b")
    for s, (l, tp, cap) in enumerate([(5, 1, 16), (3, 2, 8)]):
        want = memory.stage_memory(cm.model, layers=l, stage=s, num_stages=2, tp=tp, dp=2,
                                   micro_batch_size=2, seq_length=SEQ, num_microbatches=4,
                                   schedule="eager-1f1b").total_bytes
        assert stages[s].memory_bytes == want + cm.reserve_bytes[s]   # + the runtime reserve
        assert stages[s].memory_capacity_bytes == cap * 1024 ** 3


def test_max_layers_agrees_with_memory(cm):
    cluster = cluster_from_dict({
        "name": "tight", "device_types": {"x": {"memory_gib": 0.1, "peak_tflops": 100,
                                                "intra_node_gbps": 400}},
        "nodes": [{"device_type": "x", "devices_per_node": 4}],
        "links": {"inter_node_gbps": 100, "cross_type_gbps": 50}})
    tight = CostModel(cluster, cm.model, None, seq_length=SEQ)
    cap = tight.capacity_bytes[0]
    for stage, n in ((0, 3), (1, 3), (2, 3), (0, 1)):
        got = tight.max_layers(capacity_bytes=cap, stage=stage, num_stages=n, tp=1, dp=1,
                               micro_batch_size=1, num_microbatches=4, schedule="1f1b",
                               virtual_stages=1, limit=8)

        def mem(l):
            return memory.stage_memory(cm.model, layers=l, stage=stage, num_stages=n, tp=1,
                                       dp=1, micro_batch_size=1, seq_length=SEQ,
                                       num_microbatches=4, schedule="1f1b").total_bytes
        want = max([l for l in range(1, 9) if mem(l) <= cap], default=0)
        assert got == want


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_max_layers_is_the_largest_fitting_count(data):
    """``max_layers`` (a slope guess, then checks) equals the brute-force largest l <= limit
    whose memory fits, over capacities from none to plenty, every position and schedule; the
    memo answers later limits the same way."""
    cm = CostModel(load_cluster("examples/clusters/paper-setting1.yaml"), get_model("llama3-8b"),
                   None, seq_length=1024)
    schedule = data.draw(st.sampled_from(["1f1b", "eager-1f1b", "interleaved-1f1b", "gpipe"]))
    n = data.draw(st.integers(1, 8))
    v = data.draw(st.integers(2, 3)) if schedule == "interleaved-1f1b" else 1
    kw = dict(stage=data.draw(st.integers(0, n - 1)), num_stages=n,
              tp=data.draw(st.sampled_from([1, 2, 8])), dp=data.draw(st.sampled_from([1, 4])),
              micro_batch_size=data.draw(st.integers(1, 2)),
              num_microbatches=data.draw(st.integers(1, 16)), schedule=schedule,
              virtual_stages=v, type_index=0)

    def mem(l):
        return cm.stage_memory_bytes(layers=l, **kw)
    if data.draw(st.booleans()):      # at (or a byte off) the memory of some count k
        k = data.draw(st.integers(1, 41))
        cap = mem(k) + data.draw(st.sampled_from([-1, 0, 1, (mem(k + 1) - mem(k)) // 2]))
    else:
        cap = data.draw(st.integers(0, 200 * 1024 ** 3))
    for limit in data.draw(st.lists(st.integers(0, 40), min_size=1, max_size=3)):
        want = max([l for l in range(1, limit + 1) if mem(l) <= cap], default=0)
        assert cm.max_layers(capacity_bytes=cap, limit=limit, **kw) == want


# --------------------------------------------------------------------------- searched plans

@pytest.mark.parametrize("setting, model, gbs", [
    (SMALL, TINY, 16),
    ("examples/clusters/paper-setting1.yaml", "llama3-8b", 32),
])
def test_plan_numbers_are_hand_computable(setting, model, gbs):
    """Every per-stage number in a searched plan, recomputed from profiles and link rules."""
    cluster, mdl = load_cluster(setting), get_model(model)
    seq = mdl.seq_length if setting == SMALL else 2048
    plan = search_plan(cluster, mdl, SearchOptions(
        global_batch_size=gbs, seq_length=seq, workers=1, warmup_samples=50))
    b, n, dp, lat = plan.micro_batch_size, plan.pp, plan.dp, cluster.links.latency_ms
    act = 2 * b * seq * mdl.hidden_size

    def p(st, kind):
        return lookup_profile(None, cluster, mdl, ProfileKey(st.device_type, kind, st.tp, b, seq,
                                                            mdl.signature()))

    def link(a, c):
        na, nc = cluster.nodes[a], cluster.nodes[c]
        if a == c:
            return cluster.device_types[na.device_type].intra_node_gbps
        if na.device_type == nc.device_type:
            return cluster.links.inter_node_gbps[na.device_type]
        return cluster.links.cross_type_gbps

    for i, st in enumerate(plan.stages):
        dec = p(st, "decoder")
        f, bw, grad = st.layers * dec.forward_ms, st.layers * dec.backward_ms, \
            st.layers * dec.param_bytes
        if i == 0:
            e = p(st, "embedding")
            f, bw, grad = f + e.forward_ms, bw + e.backward_ms, grad + e.param_bytes
        if i == n - 1:
            o = p(st, "output")
            f, bw, grad = f + o.forward_ms, bw + o.backward_ms, grad + o.param_bytes
        assert st.forward_ms == pytest.approx(f, rel=1e-9)
        assert st.backward_ms == pytest.approx(bw, rel=1e-9)
        if i < n - 1:
            nxt = plan.stages[i + 1]
            gbps = min(link(a[0].node, c[0].node) for a, c in zip(st.devices, nxt.devices))
            assert st.send_forward_ms == pytest.approx(act / bytes_per_ms(gbps) + lat, rel=1e-9)
        else:
            assert st.send_forward_ms == 0.0
        nodes = {d.node for grp in st.devices for d in grp}
        if dp == 1:
            assert st.allreduce_ms == 0.0
        else:
            gbps = (link(*nodes, *nodes) if len(nodes) == 1
                    else min(link(x, y) for x in nodes for y in nodes if x != y))
            # fp32 gradients (Megatron's default for bf16): 2 x the bf16 parameter bytes
            want = 2 * (dp - 1) / dp * 2 * grad / bytes_per_ms(gbps) + 2 * (dp - 1) * lat
            assert st.allreduce_ms == pytest.approx(want, rel=1e-9)
        assert st.memory_bytes <= st.memory_capacity_bytes
