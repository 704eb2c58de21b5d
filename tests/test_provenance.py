"""Every number knows where it came from: per-stage provenance (table + JSON), measured memory in
the memory model, the one-line DB mismatch warning, --allow-estimates, the runtime reserve,
peak_tflops optional where records are measured. Core: no torch."""

from __future__ import annotations

import dataclasses

import json
import os
import re

import pytest

from poseidon_plugin import cli, memory
from poseidon_plugin.cluster import cluster_from_dict, load_cluster
from poseidon_plugin.costs import CostModel
from poseidon_plugin.errors import SpecError
from poseidon_plugin.model import load_model
from poseidon_plugin.plan import Plan
from poseidon_plugin.profiles import (LayerProfile, ProfileDB, calibrate_cluster, diagnose,
                                      profile_key)
from poseidon_plugin.training import TrainingSetup

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = os.path.join(ROOT, "examples/clusters/small-two-type.yaml")
TINY = os.path.join(ROOT, "examples/models/tiny-gpt.yaml")
MODEL = load_model(TINY)
PLAN = ["plan", "--cluster", SMALL, "--model", TINY, "--global-batch-size", "16",
        "--seq-length", "128", "--workers", "1", "--no-baselines", "--tp", "1",
        "--micro-batch-sizes", "1"]


def measured(device_type="fast", act=5_000_000, model=MODEL, seq=128, setup=None, fwd=0.02):
    key = profile_key(model, device_type, "decoder", 1, 1, seq_length=seq, setup=setup)
    return LayerProfile(key, fwd, 2 * fwd, act, 1574912, source="measured")


def write_db(tmp_path, *records) -> str:
    db = ProfileDB(None)
    for r in records:
        db.put(r)
    path = str(tmp_path / "db.json")
    db.save(path)
    return path


def run(capsys, argv):
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


# --------------------------------------------------------------------------- provenance

def test_stage_provenance_in_json_and_table(capsys, tmp_path):
    db = write_db(tmp_path, measured("fast"), measured("slow"))
    rc, out, err = run(capsys, PLAN + ["--profiles", db, "--json"])
    assert rc == 0 and err == ""
    plan = json.loads(out)
    for st in plan["stages"]:
        dec = st["provenance"]["decoder"]
        assert dec["source"] == "measured"
        assert dec["record"] == f"{st['device_type']} decoder tp1 mbs1 seq128 bf16/flash/none"
        assert st["memory"]["activations_source"] == "measured"
    # peak_tflops in the file, but both types measured: their rate sets the estimates' speed
    assert plan["stages"][0]["provenance"]["embedding"]["source"] == "calibrated"
    assert plan["stages"][-1]["provenance"]["output"]["source"] == "calibrated"
    assert "output" not in plan["stages"][0]["provenance"] or plan["pp"] == 1
    assert plan["training"]["attention"] == "flash"
    rc, table, _ = run(capsys, PLAN + ["--profiles", db])
    assert "costs from:" in table
    assert "decoder   measured" in table and "embedding calibrated" in table
    assert "activation memory: measured on stage(s) 0-" in table


def test_without_profiles_everything_is_estimated(capsys):
    rc, out, _ = run(capsys, PLAN + ["--json"])
    plan = json.loads(out)
    sources = {kind: v["source"] for st in plan["stages"] for kind, v in st["provenance"].items()}
    assert sources.pop("optimizer") == "none"     # no measurement, no memory bandwidth given
    assert set(sources.values()) == {"estimated"}


def test_plan_json_round_trips_provenance_and_memory(capsys, tmp_path):
    db = write_db(tmp_path, measured("fast"), measured("slow"))
    _, out, _ = run(capsys, PLAN + ["--profiles", db, "--json"])
    assert Plan.from_json(out).to_json() == out


# --------------------------------------------------------------------------- measured memory

def test_measured_activation_bytes_reach_the_memory_model():
    cluster = load_cluster(SMALL)
    db = ProfileDB(None)
    db.put(measured("fast", act=7_000_000))
    cm = CostModel(cluster, MODEL, db, seq_length=128)
    kw = dict(layers=3, stage=1, num_stages=4, tp=1, dp=1, micro_batch_size=1,
              num_microbatches=8, schedule="1f1b", virtual_stages=1)
    mem = cm.stage_memory(**kw, type_index=0)
    assert mem.activations_measured
    assert mem.activations_bytes == 3 * 7_000_000 * 3          # 3 layers x 3 in flight
    est = cm.stage_memory(**kw, type_index=1)                   # slow: no record
    assert not est.activations_measured
    assert est.activations_bytes == pytest.approx(
        3 * 3 * memory.layer_activation_bytes(MODEL, micro_batch_size=1, seq_length=128, tp=1),
        abs=1)
    assert mem.reserve_bytes == 2 << 30 and est.reserve_bytes == 1 << 30   # min(2, mem / 8)
    assert mem.total_bytes == sum(v for k, v in mem.parts().items() if k != "total_bytes")


def test_a_large_measured_activation_moves_the_plan(capsys, tmp_path):
    """Measured memory decides feasibility: the same measured times with 1 MB or 3 GiB of
    activations per layer and micro-batch give different plans, each fitting its memory."""
    def plan(act, sub):
        d = tmp_path / sub
        d.mkdir()
        db = write_db(d, measured("fast", act=act), measured("slow", act=act))
        rc, out, _ = run(capsys, PLAN + ["--profiles", db, "--json"])
        assert rc == 0
        return json.loads(out)

    small, big = plan(1_000_000, "small"), plan(3 << 30, "big")
    shape = lambda p: (p["pp"], p["dp"], [(s["device_type"], s["layers"]) for s in p["stages"]])
    assert shape(small) != shape(big)
    for st in big["stages"]:
        assert st["memory"]["activations_bytes"] >= 3 << 30
        assert st["memory_bytes"] <= st["memory_capacity_bytes"]


# --------------------------------------------------------------------------- mismatch warning

def test_one_warning_line_names_the_differing_model_field(capsys, tmp_path):
    biased = dataclasses.replace(load_model(TINY), add_bias_linear=True)
    db = write_db(tmp_path, *(measured(t, model=biased) for t in ("fast", "slow")))
    rc, _, err = run(capsys, PLAN + ["--profiles", db])
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1   # one error line, the reason inside
    assert lines[0].startswith("poseidon: error: --profiles ")
    assert "profiles: 2 of 2 measured record(s) unusable" in lines[0]
    assert "add_bias_linear (True vs False) differs x2" in lines[0]
    assert "--allow-estimates" in lines[0]
    rc, out, err = run(capsys, PLAN + ["--profiles", db, "--allow-estimates"])
    assert rc == 0 and len(err.strip().splitlines()) == 1 and "Plan for" in out


def test_warning_names_sequence_and_setup(tmp_path):
    cluster = load_cluster(SMALL)
    db = ProfileDB(None)
    db.put(measured("fast", seq=2048))
    db.put(measured("slow", setup=TrainingSetup(attention="unfused")))
    db.put(measured("fast"))
    usable, line = diagnose(db, cluster, MODEL, 128, TrainingSetup())
    assert usable == 1
    assert line.startswith("profiles: 2 of 3 measured record(s) unusable for tiny-gpt at seq 128")
    assert "seq 2048 (planning seq 128)" in line and "attention unfused (planning flash)" in line
    assert "\n" not in line
    assert diagnose(db, cluster, MODEL, 128, TrainingSetup(attention="unfused"))[0] == 1


def test_setup_flags_change_the_plan_memory(capsys):
    def stage0(extra):
        _, out, _ = run(capsys, PLAN + ["--json"] + extra)
        return json.loads(out)["stages"][0]["memory"]

    base, full = stage0([]), stage0(["--recompute", "full"])
    dist = stage0(["--distributed-optimizer"])
    assert full["activations_bytes"] < base["activations_bytes"]
    assert dist["optimizer_bytes"] <= base["optimizer_bytes"]
    unfused = stage0(["--attention", "unfused"])
    assert unfused["activations_bytes"] > base["activations_bytes"]


# --------------------------------------------------------------------------- cluster fields

def _cluster(**fast):
    spec = {"memory_gib": 16, "intra_node_gbps": 800, **fast}
    return {"device_types": {"fast": spec}, "nodes": [{"device_type": "fast",
                                                       "devices_per_node": 4}],
            "links": {"inter_node_gbps": 100, "cross_type_gbps": 50}}


def test_reserve_gib_field():
    assert cluster_from_dict(_cluster(peak_tflops=100)).device_types["fast"].reserve_gib == 2.0
    c = cluster_from_dict(_cluster(peak_tflops=100, reserve_gib="512 MiB"))
    assert c.device_types["fast"].reserve_bytes == 512 << 20
    with pytest.raises(SpecError, match=r"device_types.fast.reserve_gib: expected a number >= 0"):
        cluster_from_dict(_cluster(peak_tflops=100, reserve_gib=16))


def test_memory_bandwidth_field():
    assert cluster_from_dict(_cluster(peak_tflops=100)).device_types["fast"] \
        .memory_bandwidth_gbps is None
    c = cluster_from_dict(_cluster(peak_tflops=100, memory_bandwidth_gbps="2039 GB/s"))
    assert c.device_types["fast"].memory_bandwidth_gbps == pytest.approx(16312.0)
    assert cluster_from_dict(_cluster(memory_bandwidth_gbps=900)).device_types["fast"] \
        .memory_bandwidth_gbps == 900.0
    with pytest.raises(SpecError, match=r"device_types.fast.memory_bandwidth_gbps: expected a"):
        cluster_from_dict(_cluster(peak_tflops=100, memory_bandwidth_gbps=-5))
    with pytest.raises(SpecError, match=r"memory_bandwidth_gbps"):
        cluster_from_dict(_cluster(peak_tflops=100, memory_bandwidth_gbps="2 GiB"))


def _two_type(bw=None):
    spec = cluster_from_dict({
        "device_types": {
            "fast": {"memory_gib": 16, "peak_tflops": 200, "intra_node_gbps": 800,
                     **({"memory_bandwidth_gbps": bw} if bw else {})},
            "slow": {"memory_gib": 8, "peak_tflops": 100, "intra_node_gbps": 400}},
        "nodes": [{"device_type": "fast", "devices_per_node": 4, "count": 2},
                  {"device_type": "slow", "devices_per_node": 4, "count": 2}],
        "links": {"inter_node_gbps": 100, "cross_type_gbps": 50}})
    return spec


@pytest.mark.parametrize("setup,per_param", [(TrainingSetup(), 42),
                                             (TrainingSetup(grad_dtype="bf16"), 36),
                                             (TrainingSetup(params_dtype="fp32"), 36)])
def test_optimizer_step_estimated_from_the_memory_bandwidth(setup, per_param):
    """By hand: a streaming pass of ``per_param`` bytes per parameter (grad norm, Adam's reads
    and writes, the master copied back, the gradient buffer zeroed) at 0.8 x the bandwidth;
    a type without a bandwidth adds 0 ms and says so; a measured step wins."""
    bw = 16312.0   # 2039 GB/s
    cm = CostModel(_two_type(bw), MODEL, None, seq_length=128, training=setup)
    stages, _, _ = cm.stage_costs(stage_types=[0, 1], stage_tps=[1, 1], layers=[5, 3], dp=2,
                                  micro_batch_size=1, num_microbatches=4, schedule="1f1b",
                                  virtual_stages=1)
    fast = cm.layer_costs(0, 1, 1)
    params = (5 * fast.grad_bytes + fast.embedding_grad_bytes) / setup.grad_bytes
    assert stages[0].optimizer_ms == pytest.approx(params * per_param / (0.8 * bw * 1e9 / 8)
                                                   * 1e3, rel=1e-12)
    assert stages[0].optimizer_source[0] == "estimated"
    assert f"{per_param} bytes per parameter" in stages[0].optimizer_source[1]
    assert stages[1].optimizer_ms == 0.0 and stages[1].optimizer_source[0] == "none"
    # a measured step (0.25 ms per layer) replaces the estimate
    db = ProfileDB(None)
    rec = measured("fast", setup=setup)
    db.put(LayerProfile(rec.key, rec.forward_ms, rec.backward_ms, rec.activation_bytes,
                        rec.param_bytes, "measured", optimizer_ms=0.25))
    cm2 = CostModel(_two_type(bw), MODEL, db, seq_length=128, training=setup)
    lc = cm2.layer_costs(0, 1, 1)
    assert lc.optimizer_source[0] == "measured"
    assert 4 * lc.grad_bytes * lc.optimizer_ms_per_grad_byte == pytest.approx(1.0)


def test_optimizer_provenance_in_the_table_and_json(capsys, tmp_path):
    import yaml
    path = tmp_path / "c.yaml"
    data = yaml.safe_load(open(SMALL))
    data["device_types"]["fast"]["memory_bandwidth_gbps"] = "1 TB/s"
    path.write_text(yaml.safe_dump(data))
    argv = [str(path) if a == SMALL else a for a in PLAN]
    rc, out, err = run(capsys, argv + ["--json"])
    assert rc == 0, err
    plan = json.loads(out)
    by_type = {st["device_type"]: st for st in plan["stages"]}
    for name, st in by_type.items():
        src = st["provenance"]["optimizer"]["source"]
        assert src == ("estimated" if name == "fast" else "none")
        assert (st["optimizer_ms"] > 0) == (name == "fast")
    assert set(by_type) == {"fast", "slow"}
    rc, table, _ = run(capsys, argv)
    assert "optimizer estimated" in table and "at 0.8 x 8000 Gbit/s" in table
    assert "optimizer none" in table


def test_peak_is_optional_where_records_are_measured(tmp_path):
    cluster = cluster_from_dict(_cluster(), source="c.yaml")
    with pytest.raises(SpecError, match=r"c.yaml: device_types.fast.peak_tflops: expected a peak"):
        calibrate_cluster(cluster, None, MODEL, 128)
    db = ProfileDB(None)
    db.put(measured("fast", fwd=0.5))
    cal = calibrate_cluster(cluster, db, MODEL, 128)
    dt = cal.device_types["fast"]
    assert dt.calibrated and dt.efficiency == 1.0
    assert dt.peak_tflops == pytest.approx(MODEL.layer_forward_flops(1, 128) / 0.5e-3 / 1e12,
                                           rel=1e-5)


def test_cli_plans_a_peakless_cluster_from_measured_records(capsys, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(json.dumps(_cluster()))
    db = write_db(tmp_path, measured("fast", fwd=0.5))
    base = ["plan", "--cluster", str(path), "--model", TINY, "--global-batch-size", "8",
            "--seq-length", "128", "--workers", "1", "--no-baselines", "--micro-batch-sizes", "1"]
    rc, out, _ = run(capsys, base + ["--tp", "1", "--profiles", db, "--json"])
    assert rc == 0
    st = json.loads(out)["stages"][0]
    assert st["provenance"]["decoder"]["source"] == "measured"
    assert st["provenance"]["embedding"]["source"] == "calibrated"
    rc, _, err = run(capsys, base)
    assert rc == 2 and "device_types.fast.peak_tflops" in err


def test_merge_rule_measured_beats_calibrated_beats_estimated():
    key = profile_key(MODEL, "fast", "decoder", 1, 1)
    db = ProfileDB(None)
    db.put(LayerProfile(key, 1, 2, 3, 4, source="measured"))
    assert not db.put(LayerProfile(key, 9, 9, 9, 9, source="calibrated"))
    db2 = ProfileDB(None)
    db2.put(LayerProfile(key, 9, 9, 9, 9, source="estimated"))
    assert db2.put(LayerProfile(key, 1, 2, 3, 4, source="calibrated"))
    assert db2.get(key).source == "calibrated"


def test_profile_merge_command(capsys, tmp_path):
    a = write_db(tmp_path, measured("fast"))
    b_path = tmp_path / "b"
    b_path.mkdir()
    b = write_db(b_path, measured("slow"))
    out = str(tmp_path / "merged.json")
    rc, _, err = run(capsys, ["profile", "--merge", a, b, "-o", out])
    assert rc == 0 and "2 records" in err
    assert {p.key.device_type for p in ProfileDB.load(out)} == {"fast", "slow"}


def test_old_records_without_setup_fields_still_load(tmp_path):
    rec = {"device_type": "fast", "layer_kind": "decoder", "tp": 1, "micro_batch_size": 1,
           "seq_length": 128, "model_signature": MODEL.signature(), "forward_ms": 1.0,
           "backward_ms": 2.0, "activation_bytes": 10, "param_bytes": 20, "source": "measured"}
    db = ProfileDB.from_json(json.dumps({"version": 1, "records": [rec]}))
    (p,) = db.profiles()
    assert (p.key.dtype, p.key.attention, p.key.recompute) == ("bf16", "flash", "none")


def test_a_known_device_keeps_its_nominal_peak_and_an_unknown_one_has_no_mfu(capsys, tmp_path):
    """A type with no peak_tflops is calibrated from its measured layer: a device known by name
    keeps its nominal peak (efficiency = the measured rate over it, so MFU is against the real
    peak); an unknown one gets the rate as its peak and no MFU (it would read ~100 %)."""
    from poseidon_plugin.cluster import nominal_peak_tflops

    assert nominal_peak_tflops("NVIDIA-H200") == 989.0 and nominal_peak_tflops("fast") is None
    data = _cluster()
    data["device_types"] = {"NVIDIA-H200": data["device_types"]["fast"]}
    data["nodes"] = [dict(n, device_type="NVIDIA-H200") for n in data["nodes"]]
    if isinstance(data["links"].get("inter_node_gbps"), dict):
        data["links"]["inter_node_gbps"] = {"NVIDIA-H200": 100}
    cluster = cluster_from_dict(data, source="c.yaml")
    db = ProfileDB(None)
    db.put(measured("NVIDIA-H200", fwd=0.5))
    cal = calibrate_cluster(cluster, db, MODEL, 128)
    dt = cal.device_types["NVIDIA-H200"]
    rate = MODEL.layer_forward_flops(1, 128) / 0.5e-3 / 1e12
    assert dt.peak_tflops == 989.0 and not dt.measured_peak
    assert dt.efficiency == pytest.approx(rate / 989.0, rel=1e-5)
    assert dt.effective_tflops == pytest.approx(rate, rel=1e-5)   # the estimates' scale is kept

    path = tmp_path / "c.yaml"
    path.write_text(json.dumps(_cluster()))
    dbfile = write_db(tmp_path, measured("fast", fwd=0.5))
    argv = ["plan", "--cluster", str(path), "--model", TINY, "--global-batch-size", "8",
            "--seq-length", "128", "--workers", "1", "--no-baselines", "--micro-batch-sizes", "1",
            "--tp", "1", "--profiles", dbfile]
    rc, out, _ = run(capsys, argv)
    assert rc == 0 and "MFU n/a (no device peak known)" in out
    rc, out, _ = run(capsys, argv + ["--json"])
    assert json.loads(out)["mfu"] == 0.0


def test_a_plan_on_an_unprofiled_tp_degree_says_so(capsys):
    """The committed H200 DB measured TP 1 only; allowed TP 2, the plan picks it on a scaled
    estimate, and one note line says which stage, which degrees were measured and what to do."""
    argv = ["plan", "--cluster", "examples/clusters/h200-8.yaml", "--model", "llama3-8b",
            "--seq-length", "4096", "--global-batch-size", "64", "--workers", "1",
            "--no-baselines", "--profiles", "examples/profiles/llama3-8b-H200.json",
            "--attention", "unfused"]
    rc, out, err = run(capsys, argv)
    assert rc == 0 and "tp=2" in out.splitlines()[0]
    (note,) = [l for l in err.splitlines() if l.startswith("poseidon: note:")]
    assert "stage(s) 0 run NVIDIA-H200 at TP 2, measured only at TP 1" in note
    assert "`--tp 1 2`" in note
    rc, out, err = run(capsys, argv + ["--tp", "1"])
    assert rc == 0 and "tp=1" in out.splitlines()[0] and "poseidon: note" not in err


# --------------------------------------------------------------------------- scaled estimates

def _v100_cluster(tmp_path) -> str:
    """V100 nodes with peak_tflops in the file (the Metis comparison's setting)."""
    path = tmp_path / "v100.yaml"
    path.write_text(json.dumps({
        "device_types": {"V100": {"memory_gib": 32, "peak_tflops": 125, "efficiency": 0.5,
                                  "intra_node_gbps": 800}},
        "nodes": [{"device_type": "V100", "devices_per_node": 4}],
        "links": {"inter_node_gbps": 100, "cross_type_gbps": 50, "latency_ms": 0.01}}))
    return str(path)


def test_a_micro_batch_the_db_did_not_measure_is_planned_at_the_measured_rate(capsys, tmp_path):
    """V100 measured at micro-batch 1 only, at a tenth of the file's peak x efficiency; a plan
    at micro-batch 2 rests on the mbs-1 rate scaled by FLOPs (not the peak), its `costs from:`
    line says so, and one note line says what to profile."""
    rate = 125 * 0.5 / 10
    fwd = MODEL.layer_forward_flops(1, 128) / (rate * 1e12) * 1e3
    db = write_db(tmp_path, measured("V100", fwd=fwd))
    argv = ["plan", "--cluster", _v100_cluster(tmp_path), "--model", TINY,
            "--global-batch-size", "16", "--seq-length", "128", "--workers", "1",
            "--no-baselines", "--tp", "1", "--micro-batch-sizes", "2", "--profiles", db]
    rc, out, err = run(capsys, argv + ["--json"])
    assert rc == 0, err
    plan = json.loads(out)
    assert plan["micro_batch_size"] == 2
    flops_ratio = MODEL.layer_forward_flops(2, 128) / MODEL.layer_forward_flops(1, 128)
    want = 3 * MODEL.layer_forward_flops(2, 128) / (3 * fwd * flops_ratio * 1e-3) / 1e12
    for st in plan["stages"]:
        dec = st["provenance"]["decoder"]
        assert dec["source"] == "scaled"
        assert dec["record"] == ("V100 decoder tp1 mbs2 seq128 bf16/flash/none from measured "
                                 f"tp1 mbs1 (rate {want:.1f} TFLOP/s)")
        # the stage's forward: its layers at the measured rate (the peak x efficiency estimate
        # is 10x faster), plus the embedding / output layers on the first / last stage
        decoders = st["layers"] * fwd * flops_ratio
        assert decoders <= st["forward_ms"] < 1.2 * decoders
    assert plan["stages"][0]["provenance"]["embedding"]["source"] == "calibrated"
    assert plan["mfu"] > 0.0    # the file's peak still serves MFU

    rc, table, err = run(capsys, argv)
    assert rc == 0
    (line,) = [l for l in table.splitlines() if l.startswith("  decoder ")]
    assert line.split()[:2] == ["decoder", "scaled"]
    assert line.endswith(f"V100 decoder tp1 mbs2 seq128 bf16/flash/none from measured tp1 mbs1 "
                         f"(rate {want:.1f} TFLOP/s)")
    (note,) = [l for l in err.splitlines() if l.startswith("poseidon: note:")]
    assert "run V100 at TP 1 micro-batch 2, measured only at micro-batch 1 there" in note
    assert "`--micro-batch-sizes 1 2`" in note

    # at the measured micro-batch: measured, no note
    rc, table, err = run(capsys, argv[:-4] + ["--micro-batch-sizes", "1", "--profiles", db])
    assert rc == 0 and "decoder   measured" in table and "poseidon: note" not in err


def test_a_type_with_a_peak_and_measurements_is_rated_by_them(tmp_path):
    """peak_tflops in the file and a measured decoder: the estimates of the type's other layers
    (embedding, output) take the measured rate (efficiency = rate / peak); the peak stays for
    MFU. A type with a peak and no measurement keeps the file's speed."""
    cluster = load_cluster(SMALL)                   # fast: 200 x 0.5, slow: 100 x 0.5
    db = ProfileDB(None)
    db.put(measured("fast", fwd=0.5))
    cal = calibrate_cluster(cluster, db, MODEL, 128)
    fast, slow = cal.device_types["fast"], cal.device_types["slow"]
    rate = MODEL.layer_forward_flops(1, 128) / 0.5e-3 / 1e12
    assert fast.peak_tflops == 200 and fast.calibrated and not fast.measured_peak
    assert fast.effective_tflops == pytest.approx(rate, rel=1e-6)
    assert slow == cluster.device_types["slow"]
    emb = CostModel(cal, MODEL, db, seq_length=128).layer_costs(0, 1, 1).profiles[2]
    assert emb.source == "calibrated"


def test_the_scaled_estimate_note_names_what_is_not_measured():
    from types import SimpleNamespace

    from poseidon_plugin.profiles import scaled_estimate_note

    db = ProfileDB(None)
    db.put(measured("V100", fwd=0.1))                                       # tp 1, mbs 1
    db.put(LayerProfile(profile_key(MODEL, "V100", "decoder", 1, 2, seq_length=128), 0.2, 0.4,
                        1, 1, source="measured"))                             # tp 1, mbs 2

    def note(tp, mbs, src="scaled", seq=128, device="V100"):
        st = SimpleNamespace(index=1, device_type=device, tp=tp,
                             provenance=(("decoder", src, "..."),))
        return scaled_estimate_note(SimpleNamespace(stages=[st], micro_batch_size=mbs), db,
                                    MODEL, seq)

    assert note(1, 1, src="measured") is None
    assert note(2, 4, device="A100") is None            # a type nothing measured: estimated
    assert note(2, 1).startswith("stage(s) 1 run V100 at TP 2, measured only at TP 1: its "
                                 "decoder is scaled from that type's measured rate")
    assert note(2, 1).endswith("profile `--tp 1 2` to compare measured with measured, or plan "
                               "with --tp limited to the measured ones")
    assert note(2, 4).startswith("stage(s) 1 run V100 at TP 2 micro-batch 4, measured only at "
                                 "TP 1 and micro-batch 1/2:")
    assert "profile `--tp 1 2 --micro-batch-sizes 1 2 4`" in note(2, 4)
    assert "plan with --tp / --micro-batch-sizes limited" in note(2, 4)
    assert note(1, 4).startswith("stage(s) 1 run V100 at TP 1 micro-batch 4, measured only at "
                                 "micro-batch 1/2 there:")
    assert "profile `--micro-batch-sizes 1 2 4`" in note(1, 4)
    assert "measured only at seq 128 (planning seq 256)" in note(1, 1, seq=256)
    assert note(1, 1, seq=256).endswith("profile at seq 256 to compare measured with measured")


def test_an_mfu_above_100_percent_gets_one_warning_naming_the_type_and_its_peak(
        capsys, tmp_path, monkeypatch):
    """A measured rate above the cluster file's peak (let through here by widening the record
    check's slack) gives an MFU above 100 %: one warning line names the type and its peak,
    in the table's run and the --json one alike; a plan under 100 % gets none."""
    from poseidon_plugin import profile_checks
    src = open(os.path.join(ROOT, "examples/clusters/h200-8.yaml")).read()
    low = tmp_path / "h200-low-peak.yaml"
    low.write_text(src.replace("NVIDIA-H200: {memory_gib: 139.8,",
                               "NVIDIA-H200: {memory_gib: 139.8, peak_tflops: 100,"))
    argv = ["plan", "--cluster", str(low), "--model", "llama3-8b", "--seq-length", "4096",
            "--global-batch-size", "64", "--workers", "1", "--no-baselines", "--tp", "1",
            "--profiles", "examples/profiles/llama3-8b-H200.json", "--attention", "unfused"]
    monkeypatch.setattr(profile_checks, "_SLACK", 10.0)
    for extra in ([], ["--json"]):
        rc, out, err = run(capsys, argv + extra)
        assert rc == 0, err
        mfu = json.loads(out)["mfu"] if extra else float(re.search(r"MFU ([0-9.]+)%", out)[1]) / 100
        assert mfu > 1.0
        warnings = [ln for ln in err.splitlines() if "MFU" in ln]
        assert len(warnings) == 1 and warnings[0].startswith("poseidon: warning: MFU ")
        assert "NVIDIA-H200 100 TFLOP/s" in warnings[0]
    rc, out, err = run(capsys, argv[:2] + ["examples/clusters/h200-8.yaml"] + argv[3:])
    assert rc == 0 and "MFU" not in err
