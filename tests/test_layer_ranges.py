"""Costs that depend on which layers a stage holds (issue 29, item 3: the Python cost path).

Rule (costs.py, ``layer_kinds="per-kind"``): a stage holding decoder layers ``[a, a + l)`` (per
chunk, Megatron's chunk-major layout order) costs the sum over those layers of each layer's
kind's per-layer figures (forward / backward ms, gradient bytes, optimizer step, parameters,
kept activations), plus the embedding on the first stage and the output layer on the last. The
references here add the layers up one at a time.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from poseidon_plugin.cluster import load_cluster
from poseidon_plugin.costs import CostModel, chunk_layers, stage_layer_ranges
from poseidon_plugin.memory import layer_activation_bytes, stage_memory
from poseidon_plugin.model import PRESETS, get_model
from poseidon_plugin.training import TrainingSetup

SMALL = "examples/clusters/small-two-type.yaml"
TINY_MOE = "examples/models/tiny-moe.yaml"
TINY = "examples/models/tiny-gpt.yaml"
SEQ = 128


def _cm(model, layer_kinds="per-kind", training=None):
    return CostModel(load_cluster(SMALL), model, None, seq_length=SEQ, training=training,
                     layer_kinds=layer_kinds)


def _costs(cm, types, tps, layers, dp=1, b=1, m=8, schedule="1f1b", v=1):
    return cm.stage_costs(stage_types=types, stage_tps=tps, layers=layers, dp=dp,
                          micro_batch_size=b, num_microbatches=m, schedule=schedule,
                          virtual_stages=v)[0]


def test_stage_layer_ranges_follow_megatrons_layout():
    """Chunk c of stage s is virtual stage c * N + s: its range starts after every earlier
    virtual stage's layers (the order of ``Plan.layout_segments``)."""
    for layers, v in [([3, 5], 1), ([4, 4, 2], 2), ([5, 3], 3), ([1, 0, 2], 1)]:
        ranges = stage_layer_ranges(layers, v)
        segs = [chunk_layers(l, v)[c] for c in range(v) for l in layers]
        flat = sorted(r for stage in ranges for r in stage)
        start = 0
        for (a, b), seg in zip(flat, segs):
            assert a == start and b - a == seg
            start = b
        for s, stage in enumerate(ranges):
            assert [b - a for a, b in stage] == list(chunk_layers(layers[s], v))
            assert stage[0][0] == sum(segs[:s])


def test_a_uniform_model_costs_the_same_either_way():
    model = get_model(TINY)
    env, per = _cm(model, "envelope"), _cm(model, "per-kind")
    assert not per.per_kind
    for v, layers in [(1, [3, 5]), (2, [4, 4])]:
        sched = "interleaved-1f1b" if v > 1 else "1f1b"
        assert _costs(env, [0, 1], [1, 2], layers, dp=2, schedule=sched, v=v) \
            == _costs(per, [0, 1], [1, 2], layers, dp=2, schedule=sched, v=v)


@pytest.mark.parametrize("layers,v,dp,distributed", [
    ([3, 5], 1, 1, False), ([1, 4, 3], 1, 2, True), ([4, 4], 2, 2, False), ([2, 6], 1, 4, True),
    ([8], 1, 1, False), ([5, 3], 3, 1, True)])
def test_stage_costs_sum_the_layers_a_stage_holds(layers, v, dp, distributed):
    model = get_model(TINY_MOE)
    assert model.is_mixed and model.layer_kind_of[:2] == (0, 0)
    training = TrainingSetup(distributed_optimizer=distributed)
    cm = _cm(model, training=training)
    n = len(layers)
    types = [s % 2 for s in range(n)]
    tps = [1 + (s % 2) for s in range(n)]
    sched = "interleaved-1f1b" if v > 1 else "1f1b"
    stages = _costs(cm, types, tps, layers, dp=dp, m=8, schedule=sched, v=v)
    ranges = stage_layer_ranges(layers, v)
    for s, st in enumerate(stages):
        kcs = cm.kind_layer_costs(types[s], tps[s], 1)
        first = kcs[0]
        for c, (a, b) in enumerate(ranges[s]):
            f = sum(kcs[model.layer_kind_of[i]].forward_ms for i in range(a, b))
            bw = sum(kcs[model.layer_kind_of[i]].backward_ms for i in range(a, b))
            if s == 0 and c == 0:
                f, bw = f + first.embedding_forward_ms, bw + first.embedding_backward_ms
            if s == n - 1 and c == v - 1:
                f, bw = f + first.output_forward_ms, bw + first.output_backward_ms
            assert st.chunk_forward_ms[c] == pytest.approx(f, rel=1e-12)
            assert st.chunk_backward_ms[c] == pytest.approx(bw, rel=1e-12)
        held = [i for a, b in ranges[s] for i in range(a, b)]
        grad = sum(kcs[model.layer_kind_of[i]].grad_bytes for i in held)
        opt = sum(kcs[model.layer_kind_of[i]].grad_bytes
                  * kcs[model.layer_kind_of[i]].optimizer_ms_per_grad_byte for i in held)
        if s == 0:
            grad += first.embedding_grad_bytes
            opt += first.embedding_grad_bytes * first.optimizer_ms_per_grad_byte
        if s == n - 1:
            grad += first.output_grad_bytes
            opt += first.output_grad_bytes * first.optimizer_ms_per_grad_byte
        if distributed:
            opt /= dp
        assert st.optimizer_ms == pytest.approx(opt, rel=1e-12)
        # memory: the parameters of exactly the layers held (layers_param_split per range)
        params = sum(model.layers_param_split(a, b).per_device(tps[s]) for a, b in ranges[s])
        ref = stage_memory(model, layers=0, stage=s, num_stages=n, tp=tps[s], dp=dp,
                           micro_batch_size=1, seq_length=SEQ, num_microbatches=8,
                           schedule=sched, virtual_stages=v, setup=training)
        w = training.weight_bytes
        assert st.memory.weights_bytes == pytest.approx(
            ref.weights_bytes + params * w, abs=2)
        kinds_held = {model.layer_kind_of[i] for i in held}
        names = {p.key.layer_kind for p in st.provenance}
        assert "decoder" in names or not held
        assert len([p for p in st.provenance if p.key.layer_kind == "decoder"]) == len(kinds_held)
        if dp > 1:
            assert st.allreduce_ms > 0


def test_memory_of_one_kind_is_that_kinds_uniform_model():
    """A stage holding only MoE (only dense) layers has the memory of the MoE (dense) model's
    stage of as many layers, recompute or not."""
    model = get_model(TINY_MOE)
    for recompute in ("none", "selective", "full"):
        setup = TrainingSetup(recompute=recompute)
        for k in range(len(model.layer_kinds)):
            one = model.kind_model(k)
            for stage, n, l in [(0, 2, 2), (1, 2, 3), (1, 3, 1), (0, 1, 4)]:
                counts = tuple(l if i == k else 0 for i in range(len(model.layer_kinds)))
                kw = dict(layers=l, stage=stage, num_stages=n, tp=2, dp=2, micro_batch_size=2,
                          seq_length=SEQ, num_microbatches=4, setup=setup)
                got = stage_memory(model, **kw, kind_counts=counts)
                want = stage_memory(one, **kw)
                for part in ("weights_bytes", "gradients_bytes", "optimizer_bytes",
                             "activations_bytes", "total_bytes"):
                    assert abs(getattr(got, part) - getattr(want, part)) <= 4, part


def test_memory_sums_the_kinds_and_stays_below_the_envelope():
    model = get_model(TINY_MOE)
    shape = dict(micro_batch_size=2, seq_length=SEQ, tp=1)
    acts = [layer_activation_bytes(model.kind_model(k), **shape) for k in range(2)]
    for a in range(0, 8):
        for b in range(a, 9):
            counts = model.kind_counts_in(a, b)
            kw = dict(layers=b - a, stage=1, num_stages=3, tp=1, dp=1, micro_batch_size=2,
                      seq_length=SEQ, num_microbatches=4)
            got = stage_memory(model, **kw, kind_counts=counts)
            env = stage_memory(model, **kw)
            assert got.total_bytes <= env.total_bytes
            in_flight = 2.0   # 1f1b, stage 1 of 3
            assert got.activations_bytes == math.ceil(
                sum(c * x for c, x in zip(counts, acts)) * in_flight)
            params = model.layers_param_split(a, b).per_device(1)
            assert got.weights_bytes == math.ceil(params * 2)


def test_deepseek_v3_like_first_stage_holds_the_dense_layers_and_costs_less():
    """3 dense + MoE layers (DeepSeek-V3's pattern, scaled down): a first stage holding the
    dense layers is cheaper in time and memory than the same stage at the envelope, and than
    the same layer count of MoE layers."""
    model = dataclasses.replace(get_model(TINY_MOE), first_k_dense_replace=3,
                                ffn_hidden_size=512, moe_ffn_hidden_size=512)
    assert model.layer_kind_of == (0, 0, 0, 1, 1, 1, 1, 1)
    dense, moe = model.layer_kinds
    assert dense.forward_flops(1, SEQ) < moe.forward_flops(1, SEQ)
    assert dense.params() < moe.params()
    per, env = _cm(model), _cm(model, "envelope")
    layers = [3, 5]
    a = _costs(per, [0, 0], [1, 1], layers, dp=2)
    e = _costs(env, [0, 0], [1, 1], layers, dp=2)
    assert a[0].forward_ms < e[0].forward_ms and a[0].backward_ms < e[0].backward_ms
    assert a[0].memory_bytes < e[0].memory_bytes
    assert a[1].forward_ms == pytest.approx(e[1].forward_ms, rel=1e-12)   # all MoE
    dense_first = a[0].forward_ms
    b = _costs(per, [0, 0], [1, 1], [5, 3], dp=2)       # stage 0: 3 dense + 2 MoE
    assert b[0].forward_ms > dense_first
    assert [p.key.layer_kind for p in a[0].provenance] == ["decoder", "embedding"]
    assert [p.key.layer_kind for p in b[0].provenance] == ["decoder", "decoder", "embedding"]


def test_presets_per_kind_stage_memory_is_exact_for_deepseek():
    m = PRESETS["deepseek-v3"]
    counts = m.kind_counts_in(0, 5)
    assert counts == (3, 2)
    kw = dict(layers=5, stage=0, num_stages=16, tp=8, dp=4, micro_batch_size=1,
              seq_length=4096, num_microbatches=32)
    got = stage_memory(m, **kw, kind_counts=counts)
    env = stage_memory(m, **kw)
    assert got.total_bytes < env.total_bytes


@pytest.mark.parametrize("stage,n,schedule", [(0, 2, "1f1b"), (1, 2, "1f1b"), (1, 3, "gpipe"),
                                              (0, 1, "1f1b")])
def test_max_layers_from_a_start_is_the_largest_fitting_range(stage, n, schedule):
    """The memory limit of a stage that starts at layer ``start``: brute force over l; with
    MoE layers larger than dense ones, a stage starting on the dense layers fits more."""
    model = dataclasses.replace(get_model(TINY_MOE), first_k_dense_replace=3,
                                ffn_hidden_size=512, moe_ffn_hidden_size=512)
    cm = _cm(model)
    kw = dict(stage=stage, num_stages=n, tp=1, dp=1, micro_batch_size=2, num_microbatches=4,
              schedule=schedule, type_index=0)
    L = model.num_layers

    def mem(a, l):
        return cm.stage_memory_bytes(layers=l, kind_counts=model.kind_counts_in(a, a + l),
                                     virtual_stages=1, **kw)

    found = set()
    for cap_layers in (1, 2, 3, 5):
        # capacities around the memory of cap_layers dense / MoE layers
        for cap in (mem(0, cap_layers), mem(L - cap_layers, cap_layers),
                    mem(L - cap_layers, cap_layers) - 1):
            for start in range(L + 1):
                want = max([l for l in range(0, L - start + 1)
                            if l == 0 or mem(start, l) <= cap])
                for limit in (L, 3):
                    got = cm.max_layers_from(start, capacity_bytes=cap, limit=limit, **kw)
                    assert got == min(want, limit), (cap, start, limit)
                found.add((cap, cm.max_layers_from(0, capacity_bytes=cap, limit=L, **kw),
                           cm.max_layers_from(3, capacity_bytes=cap, limit=L, **kw)))
    assert any(a > b for _, a, b in found)   # the dense start fits more layers
    # a uniform model (or the envelope): the start does not matter, as max_layers
    env = _cm(model, "envelope")
    cap = mem(0, 3)
    want = env.max_layers(capacity_bytes=cap, limit=L, virtual_stages=1, **kw)
    assert all(env.max_layers_from(a, capacity_bytes=cap, limit=L, **kw) == min(want, L - a)
               for a in range(L + 1))
