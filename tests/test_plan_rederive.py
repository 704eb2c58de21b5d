"""A plan's JSON alone re-derives its predicted iteration time (issue 10: interleaved plans carry
their per-chunk layer split, per-chunk times and every link's send time, wrap-around included)."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from poseidon_plugin.cluster import load_cluster
from poseidon_plugin.costs import chunk_layers
from poseidon_plugin.errors import PoseidonError
from poseidon_plugin.model import get_model
from poseidon_plugin.plan import Plan
from poseidon_plugin.search import SearchOptions, search_plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = [
    ("small-two-type.yaml", os.path.join(ROOT, "examples/models/tiny-gpt.yaml"), 16, 128),
    ("paper-setting1.yaml", "llama3-8b", 128, 4096),
    ("paper-setting2.yaml", "llama3-8b", 128, 4096),
]


def _search(cluster_file, model, gbs, seq, schedules):
    cluster = load_cluster(os.path.join(ROOT, "examples/clusters", cluster_file))
    return search_plan(cluster, get_model(model), SearchOptions(
        global_batch_size=gbs, seq_length=seq, workers=1, warmup_samples=20,
        schedules=schedules, max_virtual_stages=4))


@pytest.fixture(scope="module", params=CASES, ids=[c[0] for c in CASES])
def interleaved(request):
    return _search(*request.param, ("interleaved-1f1b",))


def test_interleaved_time_rederived_from_json_alone(interleaved):
    p = Plan.from_json(interleaved.to_json())
    assert p.virtual_stages > 1
    t = p.rederived_iteration_time_ms()
    assert t == pytest.approx(interleaved.predicted_iteration_time_ms, rel=1e-6, abs=1e-4)


def test_json_carries_chunk_split_and_every_link(interleaved):
    d = json.loads(interleaved.to_json())
    v, n = d["virtual_stages"], d["pp"]
    for s in d["stages"]:
        assert s["chunk_layers"] == list(chunk_layers(s["layers"], v))
        assert len(s["chunk_forward_ms"]) == len(s["chunk_backward_ms"]) == v
        assert sum(s["chunk_forward_ms"]) == pytest.approx(s["forward_ms"], abs=1e-5)
    links = d["links"]
    assert [(x["from_stage"], x["to_stage"]) for x in links] == \
        [(i, i + 1) for i in range(n - 1)] + [(n - 1, 0)]
    assert links[-1]["wrap_around"] and links[-1]["send_ms"] == d["wrap_send_ms"] > 0
    assert d["timing_model"]["name"] == "engine"


def test_rederivation_depends_on_the_wrap_link_and_the_chunk_split(interleaved):
    """The check can fail: a slower wrap-around link, or an even chunk split, changes the time
    (unless that plan is insensitive to it; then the other must move it)."""
    p = interleaved
    t = p.rederived_iteration_time_ms()
    slow_wrap = dataclasses.replace(p, wrap_send_ms=p.wrap_send_ms + 50.0)
    assert slow_wrap.rederived_iteration_time_ms() > t
    even = dataclasses.replace(p, stages=tuple(dataclasses.replace(
        s, chunk_forward_ms=(s.forward_ms / p.virtual_stages,) * p.virtual_stages,
        chunk_backward_ms=(s.backward_ms / p.virtual_stages,) * p.virtual_stages)
        for s in p.stages))
    if any(len(set(s.chunk_forward_ms)) > 1 for s in p.stages):
        assert even.rederived_iteration_time_ms() != pytest.approx(t, rel=1e-9)


@pytest.mark.parametrize("case", CASES[:2], ids=[c[0] for c in CASES[:2]])
def test_non_interleaved_time_rederived(case):
    p = _search(*case, ("1f1b",))
    q = Plan.from_json(p.to_json())
    assert q.links() == p.links() and all(x.get("wrap_around") is None for x in q.links())
    assert q.rederived_iteration_time_ms() == pytest.approx(p.predicted_iteration_time_ms,
                                                            rel=1e-6, abs=1e-4)


def test_json_records_the_interleaved_micro_batch_group_size(interleaved):
    """The interleaved plan's micro-batch group size (megatron-core's default, pp, which its time
    and memory assume) is in the JSON and read back; another value is refused, not re-timed
    as if it were pp."""
    d = json.loads(interleaved.to_json())
    assert d["microbatch_group_size"] == d["pp"] == interleaved.microbatch_group_size
    back = Plan.from_json(interleaved.to_json())
    assert back.microbatch_group_size == d["pp"]
    d["microbatch_group_size"] = d["pp"] + 1
    with pytest.raises(PoseidonError, match="microbatch_group_size"):
        Plan.from_json(json.dumps(d))


def test_non_interleaved_json_has_no_group_size():
    p = _search(*CASES[0], ("1f1b",))
    d = json.loads(p.to_json())
    assert d["microbatch_group_size"] is None
    assert Plan.from_json(p.to_json()).microbatch_group_size is None
    d["microbatch_group_size"] = d["pp"]
    with pytest.raises(PoseidonError, match="not interleaved"):
        Plan.from_json(json.dumps(d))
