"""The per-iteration overhead in the search's costs (``overhead.py``, ``costs.py``): stored in the
profile DB, added to every stage's post-pipeline term by the search and the simulator alike,
carried by the plan (table, JSON, re-derivation) with its provenance."""

from __future__ import annotations

import json

import pytest

from poseidon_plugin.cluster import load_cluster
from poseidon_plugin.costs import CostModel
from poseidon_plugin.errors import ProfileDBError
from poseidon_plugin.model import get_model
from poseidon_plugin.overhead import IterationOverhead, overhead_key
from poseidon_plugin.plan import Plan
from poseidon_plugin.profiles import ProfileDB, lookup_overhead
from poseidon_plugin.search import SearchOptions, search_plan
from poseidon_plugin.training import TrainingSetup

SMALL = "examples/clusters/small-two-type.yaml"
TINY = "examples/models/tiny-gpt.yaml"
SEQ = 128


@pytest.fixture(scope="module")
def specs():
    return load_cluster(SMALL), get_model(TINY)


def db_with(cluster, model, ms: float, source="calibrated") -> ProfileDB:
    db = ProfileDB(None)
    key = overhead_key(model.signature(), SEQ, reversed(cluster.type_names),
                       TrainingSetup().profile_fields)
    db.put_overhead(IterationOverhead(key, ms, source, "1f1b pp=2 dp=2 tp=1 mbs=1 m=8, "
                                                       "iterations 2-8"))
    return db


def test_overhead_round_trips_through_the_db_file(tmp_path, specs):
    cluster, model = specs
    db = db_with(cluster, model, 42.5)
    path = str(tmp_path / "db.json")
    db.save(path)
    text = open(path).read()
    assert '"overheads"' in text and '"overhead_ms": 42.5' in text
    back = ProfileDB.load(path)
    got = lookup_overhead(back, cluster, model, SEQ)
    assert got.overhead_ms == 42.5 and got.source == "calibrated"
    assert got.calibrated_on.endswith("iterations 2-8")
    # no overhead: the file keeps its old form (no "overheads" key)
    assert '"overheads"' not in ProfileDB(None).to_json()
    # another sequence, setup or set of device types has none
    assert lookup_overhead(back, cluster, model, 256) is None
    assert lookup_overhead(back, cluster, model, SEQ, TrainingSetup(recompute="full")) is None


def test_merge_rule_calibrated_beats_estimated_newer_wins(specs):
    cluster, model = specs
    db = db_with(cluster, model, 10.0, "calibrated")
    key = db.overheads()[0].key
    assert not db.put_overhead(IterationOverhead(key, 99.0, "estimated"))
    assert db.put_overhead(IterationOverhead(key, 12.0, "calibrated"))
    assert db.get_overhead(key).overhead_ms == 12.0
    other = ProfileDB(None)
    other.merge(db)
    assert other.get_overhead(key).overhead_ms == 12.0


@pytest.mark.parametrize("record, field", [
    ({"seq_length": 128, "device_types": "a", "overhead_ms": 1.0}, "model_signature: missing"),
    ({"model_signature": "s", "seq_length": 128, "device_types": "a", "overhead_ms": -1},
     "overhead_ms: expected a number in [0"),
    ({"model_signature": "s", "seq_length": 0, "device_types": "a", "overhead_ms": 1},
     "seq_length: expected an integer"),
    ({"model_signature": "s", "seq_length": 1, "device_types": "a", "overhead_ms": 1,
      "source": "measured"}, "source: expected one of calibrated, estimated"),
    ({"model_signature": "s", "seq_length": 1, "device_types": "a", "overhead_ms": 1,
      "color": "red"}, "color: expected a known field"),
    ({"model_signature": "s", "seq_length": 1, "device_types": "a", "overhead_ms": 1,
      "recompute": "most"}, "recompute: expected one of none, selective, full"),
])
def test_bad_overhead_records_are_refused_naming_the_field(record, field):
    text = json.dumps({"version": 1, "records": [], "overheads": [record]})
    with pytest.raises(ProfileDBError, match=r"overheads\[0\]\." + field.replace("[", r"\[")):
        ProfileDB.from_json(text, "db.json")
    with pytest.raises(ProfileDBError, match="overheads: expected a list"):
        ProfileDB.from_json(json.dumps({"version": 1, "records": [], "overheads": {}}), "db.json")


def test_every_stage_carries_the_overhead_in_its_post_pipeline_term(specs):
    cluster, model = specs
    plain = CostModel(cluster, model, None, seq_length=SEQ)
    withx = CostModel(cluster, model, db_with(cluster, model, 30.0), seq_length=SEQ)
    assert (plain.iteration_overhead_ms, withx.iteration_overhead_ms) == (0.0, 30.0)
    kw = dict(stage_types=[0, 1], stage_tps=[1, 1], layers=[3, 5], dp=2, micro_batch_size=1,
              num_microbatches=4, schedule="1f1b", virtual_stages=1)
    a, _, _ = plain.stage_costs(**kw)
    b, _, _ = withx.stage_costs(**kw)
    for sa, sb in zip(a, b):
        assert sb.overhead_ms == 30.0
        assert sb.post_pipeline_ms == pytest.approx(sa.post_pipeline_ms + 30.0)


def test_search_times_every_plan_with_the_overhead(specs):
    """A per-iteration overhead X on every stage adds X to the iteration (the max over stages of
    last op + R_s): the same plan, X later; the lower bound moves with it, the JSON re-derives
    the time, and the table and JSON say where X came from."""
    cluster, model = specs
    opts = SearchOptions(global_batch_size=16, seq_length=SEQ, schedules=("1f1b",))
    p0 = search_plan(cluster, model, opts, None)
    p1 = search_plan(cluster, model, opts, db_with(cluster, model, 30.0))
    assert p1.layers_per_stage == p0.layers_per_stage and p1.dp == p0.dp
    assert p1.predicted_iteration_time_ms == pytest.approx(p0.predicted_iteration_time_ms + 30.0)
    assert p1.lower_bound_ms <= p1.predicted_iteration_time_ms + 1e-9
    assert p1.lower_bound_ms >= p0.lower_bound_ms + 30.0 - 1e-6
    assert all(s.overhead_ms == 30.0 for s in p1.stages)
    back = Plan.from_json(p1.to_json())
    assert back.rederived_iteration_time_ms() == pytest.approx(p1.predicted_iteration_time_ms,
                                                               rel=1e-6)
    d = json.loads(p1.to_json())
    assert d["iteration_overhead"]["source"] == "calibrated" and d["iteration_overhead"]["ms"] == 30
    assert "iterations 2-8" in d["iteration_overhead"]["record"]
    assert d["stages"][0]["overhead_ms"] == 30.0
    assert "iteration calibrated" in " ".join(p1.table().split()) and "+30.00 ms" in p1.table()
    assert json.loads(p0.to_json())["iteration_overhead"] is None
    assert "iteration none" in " ".join(p0.table().split())
    # MFU and TFLOP/s follow the longer iteration together
    assert p1.model_tflops_per_device / p0.model_tflops_per_device == pytest.approx(
        p1.mfu / p0.mfu)
    assert p1.mfu < p0.mfu
