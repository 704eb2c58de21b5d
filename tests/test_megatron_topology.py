"""Discovery grouping, link-probe pairs, the discovered Cluster, calibration and rank renumbering."""

from __future__ import annotations

import pytest

from test_megatron_argv import make_plan

from poseidon_plugin.errors import PoseidonError, SpecError
from poseidon_plugin.megatron.launch import discovery as D
from poseidon_plugin.megatron.profile import profile_gather as G
from poseidon_plugin.megatron.launch import renumber as R
from poseidon_plugin.plan import DeviceSlot


def infos(spec):
    """spec: list of (host, type) by launch rank; local rank = index within the host."""
    seen: dict[str, int] = {}
    out = []
    for rank, (host, t) in enumerate(spec):
        lr = seen.get(host, 0)
        seen[host] = lr + 1
        out.append(D.DeviceInfo(rank, lr, host, t, 16 << 30, "emulated", 0.5 if t == "slow" else 1.0))
    return out


def test_group_nodes_splits_hosts_by_type_in_rank_order():
    topo = D.group_nodes(infos([("a", "slow"), ("a", "slow"), ("a", "fast"), ("a", "fast"),
                                ("b", "fast"), ("b", "fast")]))
    assert topo.nodes == ((0, 1), (2, 3), (4, 5))
    assert topo.node_types == ("slow", "fast", "fast")
    assert topo.slot_of(3) == (1, 1) and topo.rank_of(2, 0) == 4
    assert "local rank 3" in topo.describe(3)
    assert topo.describe(3).startswith("launch rank 3 (host a")
    assert topo.summary() == "6 rank(s) on 2 host(s), 2 device type(s)"
    one_host = D.group_nodes(infos([("a", "slow"), ("a", "slow"), ("a", "fast"), ("a", "fast")]))
    assert len(one_host.nodes) == 2 and one_host.summary() == "4 rank(s) on 1 host(s), 2 device type(s)"


def test_probe_pairs_one_per_link_class():
    topo = D.group_nodes(infos([("a", "slow"), ("a", "slow"), ("a", "fast"), ("a", "fast"),
                                ("b", "fast"), ("b", "fast")]))
    pairs = D.probe_pairs(topo)
    assert [(c, t) for c, t, _, _ in pairs] == [("intra", "slow"), ("intra", "fast"),
                                                ("cross", ""), ("inter", "fast")]
    skipped = D.probe_pairs(topo, skip={"cross", "intra:slow"})
    assert [(c, t) for c, t, _, _ in skipped] == [("intra", "fast"), ("inter", "fast")]


def test_discovered_cluster_is_a_valid_cluster_and_overrides_win():
    topo = D.group_nodes(infos([("a", "slow"), ("a", "slow"), ("b", "fast"), ("b", "fast")]))
    links = D.LinkMeasurements(intra_gbps={"slow": 50.0, "fast": 60.0}, cross_gbps=5.0, latency_ms=0.02)
    over = {"name": "lab", "device_types": {"fast": {"intra_node_gbps": 999}},
            "links": {"inter_node_gbps": {"slow": 7}}}
    cluster = D.discover_cluster(topo, links, over)
    assert cluster.name == "lab"
    assert [n.device_type for n in cluster.nodes] == ["slow", "fast"]
    assert cluster.device_types["fast"].intra_node_gbps == 999
    assert cluster.device_types["slow"].intra_node_gbps == 50.0
    assert cluster.links.cross_type_gbps == 5.0
    assert cluster.links.inter_node_gbps["slow"] == 7
    assert D.links_given(over, ["slow", "fast"]) == {"intra:fast", "inter:slow"}
    assert D.speed_given({"device_types": {"fast": {"efficiency": 0.4}, "slow": {"memory_gib": 8}}}) \
        == {"fast"}


def test_rename_and_override_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("device_names: {'NVIDIA A100-SXM4-80GB': A100}\nlinks: {cross_type_gbps: 25}\n")
    over = D.load_overrides(str(path))
    assert D.rename_type("NVIDIA A100-SXM4-80GB", over) == "A100"
    assert D.rename_type("other", over) == "other"
    bad = tmp_path / "bad.yaml"
    bad.write_text("nodez: 1\n")
    with pytest.raises(SpecError, match="nodez"):
        D.load_overrides(str(bad))
    nodes = tmp_path / "nodes.yaml"      # once accepted and silently ignored
    nodes.write_text("nodes: [{device_type: A100, devices_per_node: 8, count: 2}]\n")
    with pytest.raises(SpecError, match="found by discovery"):
        D.load_overrides(str(nodes))


def test_calibrate_sets_measured_speed():
    from poseidon_plugin.model import get_model
    from poseidon_plugin.profiles import LayerProfile, ProfileDB, ProfileKey

    model = get_model("llama3-8b")
    topo = D.group_nodes(infos([("a", "slow"), ("a", "slow"), ("b", "fast"), ("b", "fast")]))
    cluster = D.discover_cluster(topo, D.LinkMeasurements())
    db = ProfileDB(None)
    flops = model.layer_forward_flops(1, 128)
    for t, ms in (("slow", 20.0), ("fast", 10.0)):
        db.put(LayerProfile(ProfileKey(t, "decoder", 1, 1, 128, model.signature()), ms, 2 * ms, 1, 1,
                            source="measured"))
    out = G.calibrate(cluster, db, model, [1], [1], 128, estimated_peak=["slow", "fast"])
    assert out.device_types["fast"].peak_tflops == pytest.approx(flops / 10e-3 / 1e12, rel=1e-5)
    assert out.device_types["slow"].efficiency == 1.0
    assert out.device_types["fast"].effective_tflops == pytest.approx(
        2 * out.device_types["slow"].effective_tflops, rel=1e-5)
    # a type whose speed the cluster file fixes is left alone
    kept = G.calibrate(cluster, db, model, [1], [1], 128, fixed={"fast"},
                       estimated_peak=["slow", "fast"])
    assert kept.device_types["fast"] == cluster.device_types["fast"]
    assert kept.device_types["slow"] == out.device_types["slow"]


def two_stage_plan(dp=2):
    return make_plan(layers=(6, 2), dp=dp, types=["fast", "slow"], nodes=[1, 0])


def test_renumber_moves_fast_devices_to_stage_zero():
    topo = D.group_nodes(infos([("a", "slow"), ("a", "slow"), ("a", "fast"), ("a", "fast")]))
    plan = two_stage_plan()
    ren = R.renumber(plan.rank_order(), topo, 4)
    assert ren.launch_rank_of == (2, 3, 0, 1)
    assert ren.new_rank_of == {2: 0, 3: 1, 0: 2, 1: 3}
    assert ren.unused == () and ren.world_size == 4
    lines = R.stage_map(plan, ren, topo)
    assert lines[0].startswith("new rank   0 <- launch rank 2") and lines[0].endswith("stage 0")


def test_renumber_reports_unused_ranks():
    topo = D.group_nodes(infos([("a", "slow"), ("a", "slow"), ("a", "fast"), ("a", "fast")]))
    plan = make_plan(layers=(8,), dp=2, types=["fast"], nodes=[1])
    ren = R.renumber(plan.rank_order(), topo, 4)
    assert ren.launch_rank_of == (2, 3) and ren.unused == (0, 1) and ren.world_size == 2


def test_renumber_rejects_a_plan_for_another_cluster():
    topo = D.group_nodes(infos([("a", "slow"), ("a", "fast")]))
    with pytest.raises(PoseidonError, match="does not have"):
        R.renumber([DeviceSlot(3, 0)], topo, 2)
    with pytest.raises(PoseidonError, match="twice"):
        R.renumber([DeviceSlot(0, 0), DeviceSlot(0, 0)], topo, 2)


def test_aggregate_takes_the_median_per_type_and_names_stragglers():
    from poseidon_plugin.megatron.profile.profiler import LayerTiming, aggregate

    def t(f, b=None):
        return [LayerTiming(1, 1, f, f if b is None else b, 100, 10)]

    per_rank = {0: t(10.0), 1: t(11.0), 2: t(40.0), 3: t(2.0), 4: t(2.2), 5: t(2.1)}
    type_of = {0: "a", 1: "a", 2: "a", 3: "b", 4: "b", 5: "b"}
    aggs, stragglers = aggregate(per_rank, type_of)
    by_type = {a.device_type: a for a in aggs}
    assert by_type["a"].forward_ms == 11.0 and by_type["a"].ranks == 3
    assert by_type["b"].forward_ms == 2.1
    assert len(stragglers) == 1 and stragglers[0].startswith("rank 2 (a, tp=1, mbs=1)")
