"""Profiles: the analytic estimator, the on-disk ProfileDB (format, atomicity, errors, merging)."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from poseidon_plugin import memory
from poseidon_plugin.cluster import cluster_from_dict, load_cluster
from poseidon_plugin.comm import allreduce_ms
from poseidon_plugin.errors import PoseidonError, ProfileDBError, SpecError
from poseidon_plugin.model import PRESETS, ModelSpec
from poseidon_plugin.profiles import (
    LayerProfile, ProfileDB, ProfileKey, estimate_profile, lookup_profile, profile_key,
)

ROOT = Path(__file__).resolve().parent.parent
TINY = ModelSpec(name="tiny", num_layers=8, hidden_size=256, ffn_hidden_size=1024,
                 num_attention_heads=8, num_query_groups=8, vocab_size=1024, seq_length=128,
                 swiglu=False, normalization="LayerNorm")
CLUSTER = {
    "name": "c",
    "device_types": {
        "fast": {"memory_gib": 16, "peak_tflops": 200, "efficiency": 0.5, "intra_node_gbps": 800},
        "slow": {"memory_gib": 8, "peak_tflops": 100, "intra_node_gbps": 400},
    },
    "nodes": [{"device_type": "fast", "devices_per_node": 4, "count": 2},
              {"device_type": "slow", "devices_per_node": 4, "count": 1}],
    "links": {"inter_node_gbps": {"fast": 200, "slow": 100}, "cross_type_gbps": 50,
              "latency_ms": 0.01},
}


def cluster(**links):
    data = copy.deepcopy(CLUSTER)
    data["links"].update(links)
    return cluster_from_dict(data)


def key(kind="decoder", tp=1, mbs=1, seq=128, device="fast", model=TINY) -> ProfileKey:
    return profile_key(model, device, kind, tp, mbs, seq)


# --------------------------------------------------------------------------- estimator

def test_decoder_estimate_by_hand():
    c = cluster()
    flops = TINY.layer_forward_flops(2, 128)
    tflops = 200 * 0.5
    p1 = estimate_profile(c, TINY, key(tp=1, mbs=2))
    assert p1.forward_ms == pytest.approx(flops / (tflops * 1e12) * 1e3)
    assert p1.backward_ms == pytest.approx(2 * p1.forward_ms)
    assert p1.source == "estimated"
    assert p1.param_bytes == 2 * TINY.layer_params()
    assert p1.activation_bytes == memory.layer_activation_bytes(TINY, micro_batch_size=2,
                                                                seq_length=128, tp=1)
    p2 = estimate_profile(c, TINY, key(tp=2, mbs=2))
    nbytes = 2 * 2 * 128 * 256                                     # b*s*h bf16
    ring = 2 * (2 - 1) / 2 * nbytes / (800e9 / 8 / 1e3) + 2 * (2 - 1) * 0.01
    compute = flops / 2 / (tflops * 1e12) * 1e3
    assert p2.forward_ms == pytest.approx(compute + 2 * ring)
    assert p2.backward_ms == pytest.approx(2 * compute + 2 * ring)
    assert p2.param_bytes == pytest.approx(2 * TINY.layer_param_split().per_device(2), abs=1)


def test_estimator_tp_all_reduce_is_comm_allreduce_ms():
    # the estimator's TP all-reduces are the one ring formula (comm.allreduce_ms), bit for bit
    c = cluster()
    for tp, b in ((2, 1), (4, 2)):
        p = estimate_profile(c, TINY, key(tp=tp, mbs=b))
        compute = TINY.layer_forward_flops(b, 128) / tp / ((200 * 0.5) * 1e12) * 1e3
        ring = allreduce_ms(2 * b * 128 * 256, tp, 800, 0.01)
        assert ring == (2.0 * (tp - 1) * 0.01
                        + 2.0 * (tp - 1) / tp * (2 * b * 128 * 256) * 8.0 / (800 * 1e6))
        assert p.forward_ms == compute + 2 * ring
        assert p.backward_ms == 2 * compute + 2 * ring
    one = estimate_profile(c, TINY, key(tp=1))
    assert one.forward_ms == TINY.layer_forward_flops(1, 128) / ((200 * 0.5) * 1e12) * 1e3


def test_default_efficiency_used_for_slow():
    c = cluster()
    p = estimate_profile(c, TINY, key(device="slow"))
    assert p.forward_ms == pytest.approx(TINY.layer_forward_flops(1, 128) / (100 * 0.5 * 1e12) * 1e3)


def test_tp_spanning_nodes_uses_inter_node_link():
    c = cluster()
    inside = estimate_profile(c, TINY, key(tp=4))
    across = estimate_profile(c, TINY, key(tp=8))
    nbytes = 2 * 128 * 256
    ring8 = 2 * 7 / 8 * nbytes / (200e9 / 8 / 1e3) + 14 * 0.01
    compute8 = TINY.layer_forward_flops(1, 128) / 8 / (100e12) * 1e3
    assert across.forward_ms == pytest.approx(compute8 + 2 * ring8)
    assert inside.forward_ms > 0


def test_embedding_and_output_estimates():
    c = cluster(latency_ms=0.0)
    b, s, h, V = 1, 128, 256, 1024
    emb = estimate_profile(c, TINY, key("embedding", tp=2))
    assert emb.param_bytes == 2 * h * V // 2
    # the int64 ids, at TP > 1 the vocabulary-parallel embedding's 1-byte mask, the dropout mask
    assert emb.activation_bytes == 8 * s * b + s * b + s * b * h
    assert emb.forward_ms == pytest.approx(b * s * h / 100e12 * 1e3
                                           + allreduce_ms(2 * b * s * h, 2, 800, 0.0))
    out = estimate_profile(c, TINY, key("output", tp=2))
    gemm = 2 * b * s * h * V / 2 / 100e12 * 1e3
    loss = 5 * b * s * V / 2 / 100e12 * 1e3
    assert out.forward_ms == pytest.approx(gemm + loss + 3 * allreduce_ms(4 * b * s, 2, 800, 0.0))
    assert out.backward_ms == pytest.approx(2 * gemm + loss + allreduce_ms(2 * b * s * h, 2, 800, 0))
    assert out.activation_bytes == 2 * s * b * h + 4 * s * b * V // 2
    assert out.param_bytes == 2 * (h * V // 2 + 2 * h)


def test_moe_estimate_counts_top_k():
    c = cluster()
    mix = dataclasses.replace(PRESETS["mixtral-8x7b"], seq_length=256)
    dense = dataclasses.replace(mix, num_experts=0, moe_top_k=0)
    moe = estimate_profile(c, mix, key(model=mix, seq=256))
    ref = estimate_profile(c, dense, key(model=dense, seq=256))
    # tp = 1: no communication, time ratio == FLOP ratio (top-2 experts + router vs one MLP)
    assert moe.forward_ms / ref.forward_ms == pytest.approx(
        mix.layer_forward_flops(1, 256) / dense.layer_forward_flops(1, 256))
    assert 1.7 < moe.forward_ms / ref.forward_ms < 2.0
    assert moe.param_bytes == 2 * mix.layer_params()          # all 8 experts held


def test_estimate_unknown_device_type():
    with pytest.raises(SpecError, match="device_types.gpu9"):
        estimate_profile(cluster(), TINY, key(device="gpu9"))


def test_estimate_on_paper_setting():
    c = load_cluster(str(ROOT / "examples/clusters/paper-setting1.yaml"))
    m = PRESETS["llama3-8b"]
    fast = estimate_profile(c, m, profile_key(m, "A2-2", "decoder", 1, 1))
    slow = estimate_profile(c, m, profile_key(m, "A2-3", "decoder", 1, 1))
    assert slow.forward_ms / fast.forward_ms == pytest.approx(376 / 313)


@settings(max_examples=100, deadline=None)
@given(tp=st.sampled_from([1, 2]), mbs=st.integers(1, 4), seq=st.sampled_from([64, 128, 512]),
       kind=st.sampled_from(["decoder", "output"]))
def test_estimator_properties(tp, mbs, seq, kind):
    # with a free network, doubling TP (inside a 4-device node) halves the compute share
    free = cluster(latency_ms=0.0)
    free = dataclasses.replace(free, device_types={
        n: dataclasses.replace(d, intra_node_gbps=1e12) for n, d in free.device_types.items()})
    a = estimate_profile(free, TINY, key(kind, tp=tp, mbs=mbs, seq=seq))
    b = estimate_profile(free, TINY, key(kind, tp=2 * tp, mbs=mbs, seq=seq))
    assert b.forward_ms < a.forward_ms and b.backward_ms < a.backward_ms
    assert b.param_bytes < a.param_bytes
    # more work -> more time; a faster device -> less time
    c = cluster()
    base = estimate_profile(c, TINY, key(kind, tp=tp, mbs=mbs, seq=seq))
    bigger = estimate_profile(c, TINY, key(kind, tp=tp, mbs=mbs + 1, seq=seq))
    slower = estimate_profile(c, TINY, key(kind, tp=tp, mbs=mbs, seq=seq, device="slow"))
    assert bigger.forward_ms > base.forward_ms
    assert bigger.activation_bytes > base.activation_bytes
    assert slower.forward_ms > base.forward_ms
    assert base.forward_ms > 0
    if kind == "decoder":   # (a tiny output layer's forward is dominated by the loss all-reduces)
        assert base.backward_ms > base.forward_ms


def test_allreduce_ms():
    assert allreduce_ms(1e6, 1, 100, 1.0) == 0.0
    assert allreduce_ms(0, 4, 100, 1.0) == 0.0
    assert allreduce_ms(1e6, 4, 100, 0.5) == pytest.approx(1.5 * 1e6 / 12.5e6 + 3.0)


# --------------------------------------------------------------------------- ProfileDB

def prof(source="measured", fwd=1.0, **k) -> LayerProfile:
    return LayerProfile(key=key(**k), forward_ms=fwd, backward_ms=2 * fwd, activation_bytes=10,
                        param_bytes=20, source=source)


def test_round_trip_and_deterministic_bytes(tmp_path):
    profiles = [prof(tp=t, mbs=m) for t in (1, 2) for m in (1, 2)] + \
        [prof("estimated", kind="output"), prof(device="slow", kind="embedding")]
    a, b = ProfileDB(), ProfileDB()
    for p in profiles:
        a.put(p)
    for p in reversed(profiles):
        b.put(p)
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    a.save(str(pa))
    b.save(str(pb))
    assert pa.read_bytes() == pb.read_bytes()
    payload = json.loads(pa.read_text())
    assert payload["version"] == ProfileDB.VERSION == 1
    assert len(payload["records"]) == len(profiles)
    loaded = ProfileDB.load(str(pa))
    assert loaded.profiles() == a.profiles()
    assert loaded.get(profiles[0].key) == profiles[0]
    assert len(loaded) == 6 and profiles[0].key in loaded
    assert list(loaded) == loaded.profiles()
    assert ProfileDB(str(pa)).profiles() == a.profiles()      # constructor loads an existing file
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


def test_new_db_at_missing_path_and_save_defaults(tmp_path):
    path = tmp_path / "sub" / "db.json"
    db = ProfileDB(str(path))
    assert len(db) == 0
    db.put(prof())
    db.save()
    assert ProfileDB.load(str(path)).get(prof().key) == prof()
    with pytest.raises(ProfileDBError, match="no path"):
        ProfileDB().save()


def test_save_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "db.json"
    db = ProfileDB()
    db.put(prof())
    db.save(str(path))
    before = path.read_bytes()
    db.put(prof(fwd=5.0))

    def boom(src, dst):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(ProfileDBError, match="No space left"):
        db.save(str(path))
    assert path.read_bytes() == before                     # old file intact
    assert os.listdir(tmp_path) == ["db.json"]             # temporary removed


def test_merge_rule():
    db = ProfileDB()
    measured, estimated = prof("measured", fwd=1.0), prof("estimated", fwd=9.0)
    assert db.put(estimated)
    assert db.put(measured)                          # measured replaces estimated
    assert not db.put(prof("estimated", fwd=7.0))    # estimated never replaces measured
    assert db.get(measured.key) == measured
    assert db.put(prof("measured", fwd=2.0))         # same source: the newer wins
    assert db.get(measured.key).forward_ms == 2.0
    other = ProfileDB()
    other.put(prof("estimated", fwd=3.0))
    other.put(prof("estimated", fwd=3.0, tp=2))
    db.merge(other)
    assert db.get(measured.key).forward_ms == 2.0
    assert db.get(key(tp=2)).forward_ms == 3.0


def test_duplicate_records_in_file_follow_merge_rule(tmp_path):
    from poseidon_plugin.profiles import profile_to_record
    records = [profile_to_record(prof("measured", fwd=1.0)),
               profile_to_record(prof("estimated", fwd=5.0))]
    path = tmp_path / "db.json"
    path.write_text(json.dumps({"version": 1, "records": records}))
    assert ProfileDB.load(str(path)).get(key()).forward_ms == 1.0


def test_lookup_profile():
    c = cluster()
    k = key()
    est = estimate_profile(c, TINY, k)
    assert lookup_profile(None, c, TINY, k) == est
    db = ProfileDB()
    db.put(dataclasses.replace(est, forward_ms=123.0))      # an estimated record: re-estimated
    assert lookup_profile(db, c, TINY, k) == est
    measured = dataclasses.replace(est, forward_ms=42.0, source="measured")
    db.put(measured)
    assert lookup_profile(db, c, TINY, k) == measured


# --------------------------------------------------------------------------- scaled estimates
# A DB measuring some configurations of a device type: the others take the type's measured rate,
# not the cluster file's peak (a Metis comparison planned V100 mbs 2-4 on the peak x efficiency
# estimate, 2.6x too fast, with mbs 1 measured at a third of it).

METIS = {
    "name": "metis",
    "device_types": {
        "V100": {"memory_gib": 32, "peak_tflops": 125, "efficiency": 0.5, "intra_node_gbps": 800},
        "A100": {"memory_gib": 40, "peak_tflops": 312, "efficiency": 0.5, "intra_node_gbps": 2400},
    },
    "nodes": [{"device_type": "V100", "devices_per_node": 4},
              {"device_type": "A100", "devices_per_node": 4}],
    "links": {"inter_node_gbps": 100, "cross_type_gbps": 50, "latency_ms": 0.01},
}
V100_RATE = 125 * 0.5 / 3   # what the measured layer reached: a third of peak x efficiency


def v100_measured(mbs=1, tp=1, rate=V100_RATE, seq=128, bwd_ratio=2.5) -> LayerProfile:
    """A measured V100 decoder record at ``rate`` TFLOP/s (forward; backward ``bwd_ratio`` x)."""
    fwd = TINY.layer_forward_flops(mbs, seq) / tp / (rate * 1e12) * 1e3
    k = key(tp=tp, mbs=mbs, seq=seq, device="V100")
    est = estimate_profile(cluster_from_dict(METIS), TINY, k)
    return dataclasses.replace(est, forward_ms=fwd, backward_ms=bwd_ratio * fwd, source="measured")


def test_an_unmeasured_micro_batch_takes_the_measured_rate_not_the_peak():
    c = cluster_from_dict(METIS)
    db = ProfileDB()
    m1 = v100_measured(mbs=1)
    db.put(m1)
    p2 = lookup_profile(db, c, TINY, key(mbs=2, device="V100"))
    flops_ratio = TINY.layer_forward_flops(2, 128) / TINY.layer_forward_flops(1, 128)
    # tp 1 (no all-reduce): the measured times scaled by the FLOPs, forward and backward
    assert p2.forward_ms == pytest.approx(m1.forward_ms * flops_ratio, rel=1e-9)
    assert p2.backward_ms == pytest.approx(m1.backward_ms * flops_ratio, rel=1e-9)
    assert p2.source == "calibrated" and p2.scaled_from == (m1.key,)
    # the compute rate of the whole layer: 3 forwards' FLOPs over forward + backward time
    assert p2.rate_tflops == pytest.approx(V100_RATE * 3 / (1 + 2.5), rel=1e-9)
    # the peak x efficiency estimate would be 3x faster
    peak = estimate_profile(c, TINY, key(mbs=2, device="V100"))
    assert peak.forward_ms == pytest.approx(p2.forward_ms / 3, rel=1e-9)
    # memory stays the analytic model's
    assert (p2.activation_bytes, p2.param_bytes) == (peak.activation_bytes, peak.param_bytes)


def test_a_type_without_measurements_still_uses_its_peak():
    c = cluster_from_dict(METIS)
    db = ProfileDB()
    db.put(v100_measured(mbs=1))
    k = key(mbs=2, device="A100")
    a100 = lookup_profile(db, c, TINY, k)
    assert a100 == estimate_profile(c, TINY, k)
    assert a100.source == "estimated" and not a100.scaled_from
    assert a100.forward_ms == pytest.approx(
        TINY.layer_forward_flops(2, 128) / (312 * 0.5 * 1e12) * 1e3)
    # the embedding and output layers are no decoder: estimated, never scaled from one
    assert not lookup_profile(db, c, TINY, key("output", mbs=2, device="V100")).scaled_from


def test_a_measured_key_scales_back_to_its_measurement():
    """The scaling is the estimator's own terms at the measured rate: a measured record, TP
    all-reduces included, comes back as itself."""
    c = cluster_from_dict(METIS)
    from poseidon_plugin.profiles import scaled_profile
    for tp in (1, 2, 4):
        m = v100_measured(mbs=2, tp=tp, rate=0.2)   # compute-bound: the all-reduces fit
        back = scaled_profile(c, TINY, m.key, [m])
        assert back.forward_ms == pytest.approx(m.forward_ms, rel=1e-9)
        assert back.backward_ms == pytest.approx(m.backward_ms, rel=1e-9)


def test_a_measurement_the_link_model_cannot_explain_is_rated_whole():
    """Where the modelled TP all-reduces would take over COMM_FIT of a measured time (the link
    model does not describe that machine), the rate is the modelled compute over the whole
    time: never a negative or near-zero compute time."""
    from poseidon_plugin.profiles import COMM_FIT, _decoder_terms, scaled_profile
    c = cluster_from_dict(METIS)
    m = v100_measured(mbs=2, tp=4)               # 20 TFLOP/s on a tiny layer: latency-bound
    fwd, bwd, comm, _ = _decoder_terms(c, TINY, m.key)
    assert comm > COMM_FIT * m.forward_ms
    back = scaled_profile(c, TINY, m.key, [m])
    assert back.rate_tflops == pytest.approx((fwd + bwd) / (m.forward_ms + m.backward_ms))
    assert back.forward_ms == pytest.approx(m.forward_ms + comm, rel=1e-9)


def test_scaled_across_tp_keeps_the_compute_rate_and_models_the_all_reduces():
    c = cluster_from_dict(METIS)
    db = ProfileDB()
    m = v100_measured(mbs=1, tp=1)
    db.put(m)
    p = lookup_profile(db, c, TINY, key(tp=2, mbs=1, device="V100"))
    comm = 2 * allreduce_ms(2 * 1 * 128 * TINY.hidden_size, 2, 800, 0.01)
    assert p.forward_ms == pytest.approx(m.forward_ms / 2 + comm, rel=1e-9)
    assert p.backward_ms == pytest.approx(m.backward_ms / 2 + comm, rel=1e-9)


def test_the_closest_measured_configurations_are_the_basis():
    from poseidon_plugin.profiles import scaling_basis
    c = cluster_from_dict(METIS)
    db = ProfileDB()
    lo, hi = v100_measured(mbs=1, rate=10.0), v100_measured(mbs=4, rate=40.0)
    other_tp = v100_measured(mbs=2, tp=4, rate=5.0)
    other_seq = v100_measured(mbs=2, seq=256, rate=1.0)
    for r in (lo, hi, other_tp, other_seq):
        db.put(r)
    measured = db.measured_of(key(device="V100"))
    assert len(measured) == 4
    # same seq and TP first; bracketing micro-batches: the rate in between on a log scale
    assert scaling_basis(measured, key(mbs=2, device="V100")) == (lo, hi)
    p2 = lookup_profile(db, c, TINY, key(mbs=2, device="V100"))
    assert p2.forward_ms == pytest.approx(
        TINY.layer_forward_flops(2, 128) / 20e12 * 1e3, rel=1e-9)   # sqrt(10 x 40)
    # beyond the measured sizes: the nearest one's rate (no extrapolation)
    assert scaling_basis(measured, key(mbs=8, device="V100")) == (hi,)
    # an unmeasured TP: the closest measured degree at the key's sequence (2 -> 1 before 4)
    assert scaling_basis(measured, key(tp=2, mbs=2, device="V100")) == (lo, hi)
    assert scaling_basis(measured, key(tp=8, mbs=2, device="V100")) == (other_tp,)
    # an unmeasured sequence: the closest measured one
    assert scaling_basis(measured, key(mbs=2, seq=512, device="V100")) == (other_seq,)


def test_the_scaled_provenance_line():
    from poseidon_plugin.profiles import provenance_entry
    c = cluster_from_dict(METIS)
    db = ProfileDB()
    db.put(v100_measured(mbs=1))
    db.put(v100_measured(mbs=4))
    kind, src, rec = provenance_entry(lookup_profile(db, c, TINY, key(tp=2, mbs=2,
                                                                      device="V100")))
    assert (kind, src) == ("decoder", "scaled")
    rate = lookup_profile(db, c, TINY, key(tp=2, mbs=2, device="V100")).rate_tflops
    assert rec == ("V100 decoder tp2 mbs2 seq128 bf16/flash/none from measured tp1 mbs1,4 "
                   f"(rate {rate:.1f} TFLOP/s)")
    assert provenance_entry(db.get(key(mbs=1, device="V100"))) == (
        "decoder", "measured", "V100 decoder tp1 mbs1 seq128 bf16/flash/none")


def test_the_measured_index_follows_the_db():
    db = ProfileDB()
    k = key(device="V100")
    assert db.measured_of(k) == ()
    db.put(dataclasses.replace(v100_measured(), source="estimated"))
    assert db.measured_of(k) == ()
    m = v100_measured()
    db.put(m)
    assert db.measured_of(k) == (m,)
    assert db.measured_of(key(device="V100", model=PRESETS["llama3-8b"])) == ()


GOOD = {"device_type": "fast", "layer_kind": "decoder", "tp": 1, "micro_batch_size": 1,
        "seq_length": 128, "model_signature": "sig", "forward_ms": 1.0, "backward_ms": 2.0,
        "activation_bytes": 10, "param_bytes": 20, "source": "measured"}


def bad_record(**patch):
    rec = dict(GOOD)
    for k, v in patch.items():
        if v is _DEL:
            del rec[k]
        else:
            rec[k] = v
    return {"version": 1, "records": [dict(GOOD), rec]}


_DEL = object()


@pytest.mark.parametrize("text,phrase", [
    ("{not json", "not valid JSON (line 1"),
    ("", "not valid JSON"),
    ("[]", "expected a JSON object"),
    (json.dumps({"version": 2, "records": []}), "version 2 is not supported (expected 1)"),
    (json.dumps({"records": []}), "version None is not supported"),
    (json.dumps({"version": 1, "records": {}}), "records: expected a list"),
    # a wrapped record list / version: the value is cut, the line stays short (fuzz finding)
    (json.dumps({"version": 1, "records": {"x": [{"field": "v" * 50}] * 40}}),
     "records: expected a list, got {'x': [{"),
    (json.dumps({"version": ["v" * 50] * 40, "records": []}), "profile DB version ['vvv"),
    (json.dumps({"version": 1, "records": [], "extra": 1}), "unknown top-level field"),
    (json.dumps({"version": 1, "records": [3]}), "records[0]: expected an object"),
    (json.dumps(bad_record(tp=0)), "records[1].tp: expected an integer >= 1"),
    (json.dumps(bad_record(tp="2")), "records[1].tp: expected an integer >= 1"),
    (json.dumps(bad_record(forward_ms=-1)), "records[1].forward_ms: expected a number >= 0"),
    (json.dumps(bad_record(forward_ms="fast")), "records[1].forward_ms"),
    (json.dumps(bad_record(activation_bytes=1.5)), "records[1].activation_bytes: expected an integer"),
    (json.dumps(bad_record(layer_kind="attention")), "records[1].layer_kind: expected one of"),
    (json.dumps(bad_record(source="guessed")), "records[1].source: expected one of"),
    (json.dumps(bad_record(device_type="")), "records[1].device_type: expected a non-empty string"),
    (json.dumps(bad_record(param_bytes=_DEL)), "records[1].param_bytes: missing"),
    (json.dumps(bad_record(fwd_ms=1.0)), "records[1].fwd_ms: expected a known field"),
])
def test_corrupt_files(tmp_path, text, phrase):
    path = tmp_path / "db.json"
    path.write_text(text)
    with pytest.raises(ProfileDBError) as info:
        ProfileDB.load(str(path))
    message = str(info.value)
    assert message.startswith(str(path))
    assert phrase in message
    assert "\n" not in message and len(message) < len(str(path)) + 300
    assert isinstance(info.value, PoseidonError)


def test_unreadable_files(tmp_path):
    with pytest.raises(ProfileDBError, match="cannot read"):
        ProfileDB.load(str(tmp_path / "missing.json"))
    binary = tmp_path / "bin.json"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ProfileDBError, match="not valid JSON"):
        ProfileDB.load(str(binary))
