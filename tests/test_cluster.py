"""Cluster spec: loading, unit parsing, validation errors, link lookup, shipped examples."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from hypothesis import given, strategies as st

from poseidon_plugin.cluster import (
    DEFAULT_EFFICIENCY, Cluster, cluster_from_dict, cluster_to_dict, load_cluster,
)
from poseidon_plugin.comm import send_ms
from poseidon_plugin.errors import PoseidonError, SpecError
from poseidon_plugin.model import load_model
from poseidon_plugin.specfile import load_yaml_mapping
from poseidon_plugin.units import BYTES_PER_GIB, parse_quantity

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "clusters"

BASE = {
    "name": "t",
    "device_types": {
        "A100": {"memory_gib": 80, "peak_tflops": 312, "intra_node_gbps": 2400, "efficiency": 0.4},
        "V100": {"memory_gib": 32, "peak_tflops": 125, "intra_node_gbps": 1200},
    },
    "nodes": [
        {"device_type": "A100", "devices_per_node": 8, "count": 2},
        {"device_type": "V100", "devices_per_node": 4},
    ],
    "links": {"inter_node_gbps": {"A100": 200, "V100": 100}, "cross_type_gbps": 50,
              "latency_ms": 0.02},
}


def spec(**patch) -> dict:
    data = copy.deepcopy(BASE)
    for path, value in patch.items():
        node = data
        parts = path.split("__")
        for part in parts[:-1]:
            node = node[int(part)] if isinstance(node, list) else node[part]
        last = parts[-1]
        if value is _DELETE:
            del node[last]
        elif isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value
    return data


_DELETE = object()


def write(tmp_path: Path, data: object, name: str = "c.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return str(path)


# --------------------------------------------------------------------------- happy path

def test_loads_and_expands_nodes(tmp_path):
    cluster = load_cluster(write(tmp_path, BASE))
    assert cluster.name == "t"
    assert [n.device_type for n in cluster.nodes] == ["A100", "A100", "V100"]
    assert [n.index for n in cluster.nodes] == [0, 1, 2]
    assert cluster.total_devices == 20
    assert cluster.devices_of_type("A100") == 16
    assert cluster.devices_of_type("nope") == 0
    assert cluster.type_names == ("A100", "V100")
    assert len(cluster.nodes_of_type("V100")) == 1
    assert cluster.source.endswith("c.yaml")
    a100 = cluster.device_types["A100"]
    assert a100.memory_bytes == 80 * BYTES_PER_GIB
    assert a100.effective_tflops == pytest.approx(312 * 0.4)
    assert cluster.device_types["V100"].effective_tflops == pytest.approx(125 * DEFAULT_EFFICIENCY)


def test_link_gbps_intra_inter_cross():
    cluster = cluster_from_dict(BASE)
    assert cluster.link_gbps(0, 0) == 2400          # intra-node, per type
    assert cluster.link_gbps(2, 2) == 1200
    assert cluster.link_gbps(0, 1) == 200           # inter-node, same type
    assert cluster.link_gbps(1, 2) == 50            # cross-type
    assert cluster.link_gbps(2, 0) == 50
    assert cluster.transfer_ms(1e9, 0, 1) == pytest.approx(0.02 + 1e9 * 8 / 200e9 * 1e3)


def test_units_are_converted():
    data = spec(device_types__A100__memory_gib="80 GB", device_types__A100__peak_tflops="0.312 PFLOPs",
                device_types__V100__intra_node_gbps="150 GB/s", links__cross_type_gbps="50 Gb/s",
                links__latency_ms="20 us")
    cluster = cluster_from_dict(data)
    assert cluster.device_types["A100"].memory_gib == pytest.approx(80e9 / 2**30)
    assert cluster.device_types["A100"].peak_tflops == pytest.approx(312)
    assert cluster.device_types["V100"].intra_node_gbps == pytest.approx(1200)
    assert cluster.links.cross_type_gbps == pytest.approx(50)
    assert cluster.links.latency_ms == pytest.approx(0.02)


@pytest.mark.parametrize("text,kind,expected", [
    ("64 GiB", "memory", 64), ("64GiB", "memory", 64), ("512 MiB", "memory", 0.5),
    (64, "memory", 64), ("1 TiB", "memory", 1024),
    ("200 Gbps", "bandwidth", 200), ("1.4 Tbps", "bandwidth", 1400), ("25 GB/s", "bandwidth", 200),
    ("200 Gbit/s", "bandwidth", 200), ("100 Mbps", "bandwidth", 0.1),
    ("10 us", "time", 0.01), ("0.5 s", "time", 500), ("3", "time", 3), ("1e-3 ms", "time", 1e-3),
    ("376 TFLOPs", "compute", 376), ("376 TFLOP/s", "compute", 376), ("990 GFLOPS", "compute", 0.99),
])
def test_parse_quantity(text, kind, expected):
    assert parse_quantity(text, kind, source="s", field="f") == pytest.approx(expected)


@pytest.mark.parametrize("text,kind", [
    ("64 Gbps", "memory"), ("64 GiB", "bandwidth"), ("64 parsecs", "memory"), ("fast", "time"),
    ("", "time"), (True, "memory"), ([64], "memory"), ("nan", "memory"), ("inf GiB", "memory"),
])
def test_parse_quantity_rejects(text, kind):
    with pytest.raises(SpecError) as info:
        parse_quantity(text, kind, source="file.yaml", field="a.b")
    assert info.value.source == "file.yaml" and info.value.field == "a.b"


def test_transfer_ms_zero_bytes():
    assert send_ms(0, 100, 5.0) == 0.0
    # Cluster.transfer_ms is comm.send_ms on the node pair's link: 0 bytes -> 0 ms too
    cluster = cluster_from_dict(BASE)
    assert cluster.transfer_ms(0, 0, 1) == 0.0
    assert cluster.transfer_ms(1e9, 0, 1) == send_ms(1e9, 200, 0.02)
    assert cluster.transfer_ms(1e9, 1, 2) == send_ms(1e9, 50, 0.02)


def test_scalar_inter_node_applies_to_all_types():
    cluster = cluster_from_dict(spec(links__inter_node_gbps="100 Gbps"))
    assert cluster.link_gbps(0, 1) == 100
    assert dict(cluster.links.inter_node_gbps) == {"A100": 100, "V100": 100}


def test_defaults_count_latency_name(tmp_path):
    data = spec(nodes__0__count=_DELETE, links__latency_ms=_DELETE, name=_DELETE)
    cluster = load_cluster(write(tmp_path, data, "my-cluster.yaml"))
    assert cluster.name == "my-cluster"
    assert len(cluster.nodes) == 2
    assert cluster.links.latency_ms == 0.0


def test_unused_device_type_is_allowed():
    data = spec()
    data["device_types"]["H100"] = {"memory_gib": 80, "peak_tflops": 989, "intra_node_gbps": 3600}
    cluster = cluster_from_dict(data)
    assert cluster.type_names == ("A100", "V100")


def test_cluster_is_hashable_and_round_trips():
    cluster = cluster_from_dict(BASE, source="x.yaml")
    again = cluster_from_dict(cluster_to_dict(cluster), source="x.yaml")
    assert again == cluster
    assert hash(again) == hash(cluster)
    with pytest.raises(TypeError):
        cluster.device_types["X"] = None  # type: ignore[index]


# --------------------------------------------------------------------------- errors

ERRORS = [
    # (patch, field path, phrase in expected)
    ({"device_types__A100__memory_gib": -3}, "device_types.A100.memory_gib", "> 0"),
    ({"device_types__A100__memory_gib": 0}, "device_types.A100.memory_gib", "> 0"),
    ({"device_types__A100__memory_gib": "80 parsecs"}, "device_types.A100.memory_gib", "memory unit"),
    ({"device_types__A100__memory_gib": "lots"}, "device_types.A100.memory_gib", "number"),
    ({"device_types__A100__memory_gib": _DELETE}, "device_types.A100.memory_gib", "value"),
    ({"device_types__A100__peak_tflops": "312 Gbps"}, "device_types.A100.peak_tflops", "compute unit"),
    ({"device_types__A100__peak_tflops": True}, "device_types.A100.peak_tflops", "number"),
    ({"device_types__A100__intra_node_gbps": _DELETE}, "device_types.A100.intra_node_gbps", "value"),
    ({"device_types__A100__efficiency": 1.5}, "device_types.A100.efficiency", "fraction"),
    ({"device_types__A100__efficiency": 0}, "device_types.A100.efficiency", "fraction"),
    ({"device_types__A100__memroy_gib": 80}, "device_types.A100.memroy_gib", "known key"),
    ({"device_types__A100": [80]}, "device_types.A100", "mapping"),
    ({"device_types": {}}, "device_types", "at least one"),
    ({"device_types": [1]}, "device_types", "mapping"),
    ({"device_types": _DELETE}, "device_types", "value"),
    ({"nodes": []}, "nodes", "non-empty list"),
    ({"nodes": {"a": 1}}, "nodes", "non-empty list"),
    ({"nodes": _DELETE}, "nodes", "value"),
    ({"nodes__1__device_type": "H100"}, "nodes[1].device_type", "declared in device_types"),
    ({"nodes__1__device_type": _DELETE}, "nodes[1].device_type", "value"),
    ({"nodes__0__devices_per_node": 0}, "nodes[0].devices_per_node", "integer > 0"),
    ({"nodes__0__devices_per_node": 8.5}, "nodes[0].devices_per_node", "integer > 0"),
    ({"nodes__0__devices_per_node": "8"}, "nodes[0].devices_per_node", "integer > 0"),
    ({"nodes__0__count": -1}, "nodes[0].count", "integer > 0"),
    ({"nodes__0__cuont": 2}, "nodes[0].cuont", "known key"),
    ({"nodes__0": "A100"}, "nodes[0]", "mapping"),
    ({"links": _DELETE}, "links", "value"),
    ({"links": 5}, "links", "mapping"),
    ({"links__cross_type_gbps": _DELETE}, "links.cross_type_gbps", "value"),
    ({"links__cross_type_gbps": -1}, "links.cross_type_gbps", "> 0"),
    ({"links__cross_type_gbps": "75 GiB"}, "links.cross_type_gbps", "bandwidth unit"),
    ({"links__inter_node_gbps__H100": 100}, "links.inter_node_gbps.H100", "declared in device_types"),
    ({"links__inter_node_gbps__V100": _DELETE}, "links.inter_node_gbps.V100", "every device type"),
    ({"links__inter_node_gbps__V100": 0}, "links.inter_node_gbps.V100", "> 0"),
    ({"links__inter_node_gbps": _DELETE}, "links.inter_node_gbps", "value"),
    ({"links__latency_ms": -0.1}, "links.latency_ms", ">= 0"),
    ({"links__latency_ms": "1 GiB"}, "links.latency_ms", "time unit"),
    ({"links__bandwith": 1}, "links.bandwith", "known key"),
    ({"nmae": "x"}, "nmae", "known key"),
    ({"name": ""}, "name", "non-empty string"),
    ({"name": 3}, "name", "non-empty string"),
]


@pytest.mark.parametrize("patch,field,phrase", ERRORS, ids=[e[1] + ":" + e[2] for e in ERRORS])
def test_spec_errors_name_file_and_field(tmp_path, patch, field, phrase):
    path = write(tmp_path, spec(**patch))
    with pytest.raises(SpecError) as info:
        load_cluster(path)
    err = info.value
    assert err.source == path
    assert err.field == field
    assert phrase in err.expected
    assert str(err).startswith(f"{path}: {field}: expected")
    assert "\n" not in str(err)
    assert isinstance(err, PoseidonError)


def test_error_file_level(tmp_path):
    with pytest.raises(SpecError, match="readable"):
        load_cluster(str(tmp_path / "missing.yaml"))
    with pytest.raises(SpecError, match="empty file"):
        load_cluster(write(tmp_path, ""))
    with pytest.raises(SpecError, match="valid YAML") as info:
        load_cluster(write(tmp_path, "device_types: [1, 2\nnodes: {"))
    assert info.value.field.startswith("line ")
    with pytest.raises(SpecError, match="<top level>: expected a mapping"):
        load_cluster(write(tmp_path, "- 1\n- 2\n"))


# one loader (specfile.load_yaml_mapping) for cluster and model files: the same file-level errors,
# word for word, naming the kind of file
@pytest.mark.parametrize("load,what,mapping", [
    (load_cluster, "cluster", "a mapping"),
    (load_model, "model", "a mapping of model fields"),
])
def test_file_level_errors_are_shared(tmp_path, load, what, mapping):
    missing = str(tmp_path / "missing.yaml")
    with pytest.raises(SpecError) as info:
        load(missing)
    assert str(info.value) == (f"{missing}: <file>: expected a readable {what} YAML file, "
                               f"got 'No such file or directory'")
    with pytest.raises(SpecError) as info:
        load(str(tmp_path))                       # a directory
    assert str(info.value).startswith(f"{tmp_path}: <file>: expected a readable {what} YAML file")
    empty = write(tmp_path, "", name="empty.yaml")
    with pytest.raises(SpecError) as info:
        load(empty)
    assert str(info.value) == f"{empty}: <top level>: expected a {what} mapping, got 'an empty file'"
    listed = write(tmp_path, "- 1\n- 2\n", name="list.yaml")
    with pytest.raises(SpecError) as info:
        load(listed)
    assert str(info.value) == f"{listed}: <top level>: expected {mapping}, got 'list'"
    bad = write(tmp_path, "a: [1, 2\nb: {", name="bad.yaml")
    with pytest.raises(SpecError) as info:
        load(bad)
    assert info.value.source == bad and info.value.field.startswith("line ")
    assert info.value.expected == "valid YAML"


def test_load_yaml_mapping_returns_the_mapping(tmp_path):
    path = write(tmp_path, {"a": 1, "b": {"c": [2, 3]}})
    assert load_yaml_mapping(path, "thing") == {"a": 1, "b": {"c": [2, 3]}}
    with pytest.raises(SpecError, match="expected a readable thing YAML file"):
        load_yaml_mapping(str(tmp_path / "nope.yaml"), "thing")
    with pytest.raises(SpecError, match="<top level>: expected a list of things, got 'int'"):
        load_yaml_mapping(write(tmp_path, "3\n"), "thing", "a list of things")


# --------------------------------------------------------------------------- shipped examples

PAPER = {
    # file: {type: node count}
    "paper-setting1": {"A2-2": 1, "A2-3": 1},
    "paper-setting2": {"A2-2": 2, "A2-3": 2},
    "paper-setting3": {"A2-2": 2, "A2-3": 2, "A2-4": 2},
    "paper-setting4": {"A2-2": 1, "A2-3": 2, "A2-4": 4},
    "paper-setting5": {"A100": 1, "RTX-4090": 2, "RTX-3090": 2},
    "paper-setting6": {"A2-2": 6, "A2-3": 6, "A2-4": 24},
    "paper-setting6-96": {"A2-2": 2, "A2-3": 2, "A2-4": 8},
    "paper-setting6-192": {"A2-2": 4, "A2-3": 4, "A2-4": 16},
}
DEVICES = {  # (memory GiB, peak TFLOP/s)
    "A2-2": (64, 376), "A2-3": (64, 313), "A2-4": (32, 280),
    "A100": (80, 312), "RTX-4090": (24, 330), "RTX-3090": (24, 71),
}


@pytest.mark.parametrize("name", sorted(PAPER))
def test_paper_settings(name):
    path = EXAMPLES / f"{name}.yaml"
    text = path.read_text()
    assert text.startswith("# ") and "Model used there" in text and "GiB" in text
    cluster = load_cluster(str(path))
    assert cluster.name == name
    counts = {t: len(cluster.nodes_of_type(t)) for t in cluster.type_names}
    assert counts == PAPER[name]
    assert all(n.num_devices == 8 for n in cluster.nodes)
    npu = "A2-2" in counts
    intra, inter, cross = (1400, 200, 75) if npu else (256, 100, 75)
    for t in cluster.type_names:
        dt = cluster.device_types[t]
        assert (dt.memory_gib, dt.peak_tflops) == DEVICES[t]
        assert dt.intra_node_gbps == intra
        assert cluster.links.inter_node_gbps[t] == inter
    assert cluster.links.cross_type_gbps == cross


def test_setting6_sizes():
    assert load_cluster(str(EXAMPLES / "paper-setting6.yaml")).total_devices == 288
    assert load_cluster(str(EXAMPLES / "paper-setting6-96.yaml")).total_devices == 96
    assert load_cluster(str(EXAMPLES / "paper-setting6-192.yaml")).total_devices == 192


def test_small_two_type():
    cluster = load_cluster(str(EXAMPLES / "small-two-type.yaml"))
    assert len(cluster.type_names) == 2
    assert cluster.total_devices == 16


def test_every_example_loads():
    for path in sorted(EXAMPLES.glob("*.yaml")):
        assert isinstance(load_cluster(str(path)), Cluster)


# --------------------------------------------------------------------------- properties

@given(st.lists(st.tuples(st.sampled_from(["A100", "V100"]), st.integers(1, 16), st.integers(1, 4)),
                min_size=1, max_size=5))
def test_expansion_and_links_property(groups):
    data = spec(nodes=[{"device_type": t, "devices_per_node": d, "count": c} for t, d, c in groups])
    cluster = cluster_from_dict(data)
    assert len(cluster.nodes) == sum(c for _, _, c in groups)
    assert cluster.total_devices == sum(d * c for _, d, c in groups)
    for a in cluster.nodes:
        for b in cluster.nodes:
            gbps = cluster.link_gbps(a.index, b.index)
            assert gbps == cluster.link_gbps(b.index, a.index)
            if a.index == b.index:
                assert gbps == cluster.device_types[a.device_type].intra_node_gbps
            elif a.device_type == b.device_type:
                assert gbps == cluster.links.inter_node_gbps[a.device_type]
            else:
                assert gbps == cluster.links.cross_type_gbps
