"""Baselines: each is a plan or the one-line reason it has none (every reason the even split
can fail for, and the single-type searches' own errors); their JSON entries beside a plan."""

from __future__ import annotations

import os
import re

import pytest

from poseidon_plugin.cluster import load_cluster
from poseidon_plugin.model import get_model
from poseidon_plugin.plan import Plan
from poseidon_plugin.search import (SearchOptions, baseline_entries, baseline_plans,
                                    baseline_results, skipped_baseline_entries)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = os.path.join(ROOT, "examples/clusters/small-two-type.yaml")
TINY = os.path.join(ROOT, "examples/models/tiny-gpt.yaml")


def _cluster(tmp_path, fast_mem=16, slow_mem=8, slow_devices=4, name="c"):
    p = tmp_path / f"{name}.yaml"
    p.write_text(
        f"name: {name}\ndevice_types:\n"
        f"  fast: {{memory_gib: {fast_mem}, peak_tflops: 200, intra_node_gbps: 800}}\n"
        f"  slow: {{memory_gib: {slow_mem}, peak_tflops: 100, intra_node_gbps: 400}}\n"
        "nodes:\n  - {device_type: fast, devices_per_node: 4, count: 2}\n"
        f"  - {{device_type: slow, devices_per_node: {slow_devices}, count: 2}}\n"
        "links: {inter_node_gbps: 100, cross_type_gbps: 50}\n", encoding="utf-8")
    return load_cluster(str(p))


def _results(cluster, gbs=16, **kw):
    opts = SearchOptions(global_batch_size=gbs, seq_length=128, workers=1, **kw)
    return baseline_results(cluster, get_model(TINY), opts)


def test_both_baselines_found_and_entries():
    res = _results(load_cluster(SMALL))
    assert all(isinstance(p, Plan) for p in res.values())
    entries = baseline_entries(res, 0.5 * res["megatron-default"].predicted_iteration_time_ms)
    md = entries[0]
    assert md["name"] == "megatron-default" and md["status"] == "ok" and md["reason"] is None
    assert md["speedup"] == pytest.approx(2.0)
    assert (md["pp"], md["dp"], md["tp"]) == (res["megatron-default"].pp,
                                              res["megatron-default"].dp,
                                              res["megatron-default"].tp)
    assert [e["name"] for e in entries] == ["megatron-default", "best-single-type"]
    assert all(set(e) == set(md) for e in entries + skipped_baseline_entries())


def test_even_split_batch_reason():
    """16 devices (two types of 8), TP 1, pp | 8 layers: the splits that fit the types have
    DP 2, 4 or 8, never dividing a global batch of 3."""
    res = _results(load_cluster(SMALL), gbs=3, tp_degrees=(1,), micro_batch_sizes=(1,))
    why = res["megatron-default"]
    assert isinstance(why, str)
    assert re.fullmatch(r"the global batch 3 is not a multiple of DP x micro-batch size for any "
                        r"even split over all 16 devices \(DP 2, 4, 8; micro-batch sizes 1\)",
                        why), why
    assert baseline_plans(load_cluster(SMALL), get_model(TINY), SearchOptions(
        global_batch_size=3, seq_length=128, workers=1, tp_degrees=(1,),
        micro_batch_sizes=(1,)))["megatron-default"] is None


def test_even_split_memory_reason_names_a_real_shortfall(tmp_path):
    res = _results(_cluster(tmp_path, fast_mem=0.01, slow_mem=0.005))
    why = res["megatron-default"]
    m = re.fullmatch(r"no even split fits in device memory: the closest \(pp=\d+, tp=\d+, dp=\d+, "
                     r"micro-batch \d+\) lacks ([0-9.]+) GiB on stage \d+ \((fast|slow): needs "
                     r"([0-9.]+) GiB of ([0-9.]+) GiB\)", why)
    assert m, why
    lacks, needs, cap = float(m.group(1)), float(m.group(3)), float(m.group(4))
    assert needs > cap and lacks == pytest.approx(needs - cap, abs=0.011)
    # and no single type has a plan either: each type's own one-line reason
    single = res["best-single-type"]
    assert single.startswith("no device type has a plan on its own: fast: no plan fits")
    assert "; slow: no plan fits" in single and "\n" not in single


def test_even_split_placement_reason(tmp_path):
    """4 + 2 + 2 ... devices: 12 devices, pp | 8 and TP x PP | 12 leave stages of 3, 6 or 12
    devices, which no single type's 8 (or 4) devices can split into."""
    c = _cluster(tmp_path, slow_devices=2)
    why = _results(c, gbs=12)["megatron-default"]
    assert why.startswith("no even split over all devices puts each stage's TP x DP devices on "
                          "one device type (devices per type: fast 8, slow 4; deepest splits: "
                          "pp=4 tp=1 dp=3 (3 devices a stage)"), why


def test_even_split_tp_reason(tmp_path):
    """--tp 4: valid on the 4-device nodes, not on the 2-device ones."""
    c = _cluster(tmp_path, slow_devices=2)
    why = _results(c, gbs=12, tp_degrees=(4,))["megatron-default"]
    assert why.startswith("no TP degree is valid on every device type") and "--tp 4" in why
