"""Cluster specification: device types, nodes and links; loading and validation.

YAML shape (units in names; a value may also be a string with a unit, see ``units.py``)::

    name: paper-setting1                 # optional; defaults to the file's stem
    device_types:                        # a catalogue; types no node uses are allowed
      A2-2: {memory_gib: 64, peak_tflops: 376, efficiency: 0.45, intra_node_gbps: 1400}
      A2-3: {memory_gib: "64 GiB", peak_tflops: "313 TFLOPs", intra_node_gbps: "1400 Gbps"}
    nodes:                               # groups of identical nodes, expanded in file order
      - {device_type: A2-2, devices_per_node: 8, count: 1}   # count defaults to 1
      - {device_type: A2-3, devices_per_node: 8, count: 1}
    links:
      inter_node_gbps: {A2-2: 200, A2-3: 200}   # between nodes of the same type (one number = all)
      cross_type_gbps: 75                        # between nodes of different types
      latency_ms: 0.01                           # optional, per message, added to every transfer

Fields per device type: ``memory_gib`` (> 0), ``intra_node_gbps`` (> 0), ``peak_tflops`` (dense
bf16, > 0) and ``efficiency`` (fraction of peak a transformer layer reaches, 0 < e <= 1; default
``DEFAULT_EFFICIENCY``) -- the estimator's two fields, optional where a profile DB measures the
type's layers (``poseidon plan`` then calibrates the rest from the measured rate); optional
``reserve_gib`` (>= 0, default ``default_reserve_gib``): memory the plan leaves to the runtime;
optional ``memory_bandwidth_gbps`` (> 0, Gbit/s like every bandwidth here, or a string such as
``"2039 GB/s"``): the device memory's peak bandwidth, from which ``costs`` estimates the
optimizer step where no profile measured it (without it and a measurement the step counts
0 ms, and the plan says so). ``inter_node_gbps`` must name every device type that
nodes use; ``latency_ms`` >= 0. Unknown keys anywhere are errors (they are usually typos).

Every mistake raises ``SpecError(source, field_path, expected, got)``, e.g.
``clusters/x.yaml: device_types.A100.memory_gib: expected a number > 0, got -3``.

Limits (a hostile or mistyped file is refused before any arithmetic, with the limit named):
at most ``MAX_DEVICE_TYPES`` device types, ``MAX_DEVICES_PER_NODE`` devices in a node,
``MAX_NODES`` nodes and ``MAX_DEVICES`` devices in all; every number finite and inside
``_RANGES`` (e.g. ``memory_gib`` up to 65536, ``peak_tflops`` up to 1e6 per device).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping

from .comm import send_ms
from .errors import SpecError
from .safeio import NAME_MAX_CHARS, name_problem  # NAME_MAX_CHARS: cluster and type names
from .specfile import load_yaml_mapping, require_mapping
from .units import BYTES_PER_GIB, parse_quantity, positive_quantity

DEFAULT_EFFICIENCY = 0.5  # fraction of peak dense bf16 TFLOP/s a transformer layer reaches
DEFAULT_RESERVE_GIB = 2.0
"""Per-device runtime reserve the memory model adds to every stage (``reserve_gib``). A stated,
not measured, default: about 0.5 GiB of CUDA/CANN context and library workspaces (cuBLAS /
cuDNN / ACL handles; outside PyTorch's allocator, so ``max_memory_allocated`` never shows it),
about 0.5 GiB of NCCL/HCCL buffers for a rank's TP, PP, DP and embedding communicators (a few
MiB per channel and peer each), and about 1 GiB of caching-allocator fragmentation (reserved
minus allocated, typically 5-10 % of a training process's peak on a 16-24 GiB working set).
Devices under 16 GiB (small or emulated ones) get an eighth of their memory instead
(``default_reserve_gib``). Measure it on your devices and set it per device type: a launch's
calibration line reports it (the device's used memory outside PyTorch's allocator). Measured
on an H200 (CUDA 13.0, torch 2.11, megatron-core 0.19.2, one rank, no Apex/TE): 2.42 GiB
outside the allocator, which itself cached 4.9-5.5 GiB beyond its peak allocation (freed and
retried before an out-of-memory error, so not counted here)."""


# Dense bf16 peak TFLOP/s of known accelerators, by a substring of the device name (first match
# wins): the peak a launch assumes for a discovered device, and the one ``poseidon plan`` measures
# MFU against when a cluster file gives none.
NOMINAL_PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989.0), ("H100", 989.0), ("H800", 989.0), ("H20", 148.0), ("A100", 312.0),
    ("A800", 312.0), ("L40", 181.0), ("V100", 125.0), ("910B", 376.0), ("910", 320.0),
)


def nominal_peak_tflops(name: str) -> float | None:
    """The dense bf16 peak of a device known by ``name`` (a substring match), else None."""
    for key, value in NOMINAL_PEAK_TFLOPS:
        if key.lower() in name.lower():
            return value
    return None


def default_reserve_gib(memory_gib: float) -> float:
    """``DEFAULT_RESERVE_GIB``, at most an eighth of the device's memory."""
    return min(DEFAULT_RESERVE_GIB, memory_gib / 8)

MAX_DEVICE_TYPES = 16            # entries of device_types: the search's typed core holds
                                 # at most 16 (``MAXT`` in search/_search.pxd)
MAX_DEVICES_PER_NODE = 4096
MAX_NODES = 1 << 17              # 131072 nodes
MAX_DEVICES = 1 << 20            # 1048576 devices (the search is exercised up to 10k)
# field -> (lowest, highest) in the field's unit; a value outside is refused (keeps every product
# of the cost model finite and every printed figure meaningful)
_RANGES: dict[str, tuple[float, float]] = {
    "memory_gib": (1e-6, 65536.0),           # 1 KiB .. 64 TiB per device
    "reserve_gib": (0.0, 65536.0),           # runtime reserve (below memory_gib)
    "peak_tflops": (1e-6, 1e6),              # 1 MFLOP/s .. 1 EFLOP/s per device
    "intra_node_gbps": (1e-6, 1e9),          # 1 kbit/s .. 1 Ebit/s
    "memory_bandwidth_gbps": (1e-6, 1e9),
    "inter_node_gbps": (1e-6, 1e9),
    "cross_type_gbps": (1e-6, 1e9),
    "latency_ms": (0.0, 1e5),                # up to 100 s per message
}


@dataclass(frozen=True)
class DeviceType:
    name: str
    memory_gib: float
    peak_tflops: float | None       # dense bf16 peak, TFLOP/s; None: only measured layers
    intra_node_gbps: float          # device-to-device bandwidth inside one node, Gbit/s
    efficiency: float | None = None  # measured fraction of peak; None -> DEFAULT_EFFICIENCY
    reserve_gib: float = 0.0        # runtime reserve (context, buffers, fragments); the file
                                    # loader defaults it to default_reserve_gib(memory_gib)
    calibrated: bool = False        # the speed was set from measured layers (not the file)
    measured_peak: bool = False     # peak_tflops is a measured layer rate, not the device's
    #                                 peak (no MFU against it)
    memory_bandwidth_gbps: float | None = None   # device memory peak, Gbit/s (None: unknown)

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * BYTES_PER_GIB)

    @property
    def reserve_bytes(self) -> int:
        return int(self.reserve_gib * BYTES_PER_GIB)

    @property
    def effective_tflops(self) -> float:
        """TFLOP/s a transformer layer reaches: peak x efficiency (SpecError without a peak)."""
        if self.peak_tflops is None:
            raise SpecError("<cluster>", f"device_types.{self.name}.peak_tflops",
                            "a peak (the estimator needs it for layers no profile measured)",
                            "missing")
        eff = DEFAULT_EFFICIENCY if self.efficiency is None else self.efficiency
        return self.peak_tflops * eff


@dataclass(frozen=True)
class Node:
    index: int          # global node index, in file order (groups expanded)
    device_type: str
    num_devices: int


@dataclass(frozen=True)
class Links:
    inter_node_gbps: Mapping[str, float]   # per device type, between two nodes of that type
    cross_type_gbps: float                 # between nodes of different device types
    latency_ms: float = 0.0

    def __hash__(self) -> int:
        return hash((tuple(sorted(self.inter_node_gbps.items())), self.cross_type_gbps,
                     self.latency_ms))


@dataclass(frozen=True)
class Cluster:
    name: str
    device_types: Mapping[str, DeviceType]
    nodes: tuple[Node, ...]
    links: Links
    source: str = "<memory>"

    def __hash__(self) -> int:
        return hash((self.name, tuple(sorted(self.device_types.items())), self.nodes, self.links))

    def devices_of_type(self, device_type: str) -> int:
        """Number of devices of ``device_type`` over all nodes (0 if none)."""
        return sum(n.num_devices for n in self.nodes if n.device_type == device_type)

    def nodes_of_type(self, device_type: str) -> tuple[Node, ...]:
        return tuple(n for n in self.nodes if n.device_type == device_type)

    @property
    def type_names(self) -> tuple[str, ...]:
        """Device types used by nodes, in order of first appearance in ``nodes``."""
        return tuple(dict.fromkeys(n.device_type for n in self.nodes))

    @property
    def total_devices(self) -> int:
        return sum(n.num_devices for n in self.nodes)

    def link_gbps(self, node_a: int, node_b: int) -> float:
        """Bandwidth between a device on node_a and one on node_b (intra if equal)."""
        a = self.nodes[node_a]
        b = self.nodes[node_b]
        if node_a == node_b:
            return self.device_types[a.device_type].intra_node_gbps
        if a.device_type == b.device_type:
            return self.links.inter_node_gbps[a.device_type]
        return self.links.cross_type_gbps

    def transfer_ms(self, num_bytes: float, node_a: int, node_b: int) -> float:
        """Point-to-point time for ``num_bytes`` from node_a to node_b, latency included
        (``comm.send_ms``: 0 ms for 0 bytes)."""
        return send_ms(num_bytes, self.link_gbps(node_a, node_b), self.links.latency_ms)

    def max_intra_node_devices(self, device_type: str) -> int:
        """Largest number of devices of one node of ``device_type`` (0 if the type has none)."""
        return max((n.num_devices for n in self.nodes_of_type(device_type)), default=0)


# --------------------------------------------------------------------------- loading

_TOP_KEYS = {"name", "device_types", "nodes", "links"}
_DEVICE_KEYS = {"memory_gib", "peak_tflops", "intra_node_gbps", "efficiency", "reserve_gib",
                "memory_bandwidth_gbps"}
_DEVICE_REQUIRED = ("memory_gib", "intra_node_gbps")
_NODE_KEYS = {"device_type", "devices_per_node", "count"}
_LINK_KEYS = {"inter_node_gbps", "cross_type_gbps", "latency_ms"}


def _check_keys(data: Mapping[str, Any], allowed: set[str], required: tuple[str, ...],
                source: str, prefix: str) -> None:
    for key in data:
        if key not in allowed:
            raise SpecError(source, f"{prefix}{key}",
                            f"a known key (one of: {', '.join(sorted(allowed))})", "unknown key")
    for key in required:
        if key not in data:
            raise SpecError(source, f"{prefix}{key}", "a value", "missing")


def _positive_int(value: object, source: str, field: str, limit: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise SpecError(source, field, "an integer > 0", value)
    if value > limit:
        raise SpecError(source, field, f"an integer <= {limit}", value)
    return value


def _in_range(value: object, kind, source: str, field: str, key: str) -> float:
    """A quantity (``units.parse_quantity``) inside ``_RANGES[key]``."""
    low, high = _RANGES[key]
    number = (positive_quantity if low > 0 else parse_quantity)(value, kind, source=source,
                                                                field=field)
    if number < low:
        raise SpecError(source, field, f"a number >= {low:g}", value)
    if number > high:
        raise SpecError(source, field, f"a number <= {high:g}", value)
    return number


def _name(value: object, source: str, field: str, type_name: bool = False) -> str:
    why = name_problem(value, type_name)   # the rule JSON-loaded device types follow too
    if why is not None:
        raise SpecError(source, field, why, value)
    return value  # type: ignore[return-value]


def _check_totals(nodes: int, devices: int, source: str, path: str) -> None:
    """Refuse a cluster past ``MAX_NODES`` nodes or ``MAX_DEVICES`` devices (before expanding)."""
    if nodes > MAX_NODES:
        raise SpecError(source, path + ".count", f"at most {MAX_NODES} nodes in all",
                        f"{nodes} nodes")
    if devices > MAX_DEVICES:
        raise SpecError(source, path, f"at most {MAX_DEVICES} devices in all",
                        f"{devices} devices")


def _device_type(name: str, data: object, source: str) -> DeviceType:
    path = f"device_types.{name}"
    data = require_mapping(data, source, path)
    _check_keys(data, _DEVICE_KEYS, _DEVICE_REQUIRED, source, path + ".")
    efficiency = None
    if data.get("efficiency") is not None:
        field = path + ".efficiency"
        value = data["efficiency"]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
            raise SpecError(source, field, "a fraction 0 < efficiency <= 1", value)
        efficiency = float(value)

    def get(key: str, kind: str) -> float:
        return _in_range(data[key], kind, source, f"{path}.{key}", key)

    memory = get("memory_gib", "memory")
    reserve = default_reserve_gib(memory)
    if data.get("reserve_gib") is not None:
        reserve = get("reserve_gib", "memory")
        if not reserve < memory:
            raise SpecError(source, path + ".reserve_gib",
                            f"a number >= 0 and below memory_gib ({memory:g})",
                            data["reserve_gib"])
    peak = get("peak_tflops", "compute") if data.get("peak_tflops") is not None else None
    return DeviceType(
        name=name, memory_gib=memory, peak_tflops=peak,
        intra_node_gbps=get("intra_node_gbps", "bandwidth"), efficiency=efficiency,
        reserve_gib=float(reserve),
        memory_bandwidth_gbps=(get("memory_bandwidth_gbps", "bandwidth")
                               if data.get("memory_bandwidth_gbps") is not None else None))


def cluster_from_dict(data: Mapping[str, Any], source: str = "<dict>") -> Cluster:
    """Validate a parsed cluster spec; raises SpecError naming ``source`` and the field path."""
    data = require_mapping(data, source, "<top level>")
    _check_keys(data, _TOP_KEYS, ("device_types", "nodes", "links"), source, "")

    name = data.get("name")
    if name is None:
        name = os.path.splitext(os.path.basename(source))[0] if source[:1] != "<" else "cluster"
    else:
        name = _name(name, source, "name")

    raw_types = require_mapping(data["device_types"], source, "device_types")
    if not raw_types:
        raise SpecError(source, "device_types", "at least one device type", "an empty mapping")
    if len(raw_types) > MAX_DEVICE_TYPES:
        raise SpecError(source, "device_types", f"at most {MAX_DEVICE_TYPES} device types",
                        f"{len(raw_types)} types")
    device_types: dict[str, DeviceType] = {}
    for type_name, spec in raw_types.items():
        _name(type_name, source, "device_types (a type name)", type_name=True)
        device_types[type_name] = _device_type(type_name, spec, source)

    raw_nodes = data["nodes"]
    if not isinstance(raw_nodes, list) or not raw_nodes:
        raise SpecError(source, "nodes", "a non-empty list of node groups",
                        raw_nodes if not isinstance(raw_nodes, list) else "an empty list")
    nodes: list[Node] = []
    total_devices = 0
    for i, group in enumerate(raw_nodes):
        path = f"nodes[{i}]"
        group = require_mapping(group, source, path)
        _check_keys(group, _NODE_KEYS, ("device_type", "devices_per_node"), source, path + ".")
        dtype = group["device_type"]
        if not isinstance(dtype, str) or dtype not in device_types:
            raise SpecError(source, path + ".device_type",
                            f"a type declared in device_types ({', '.join(device_types)})", dtype)
        per_node = _positive_int(group["devices_per_node"], source, path + ".devices_per_node",
                                 MAX_DEVICES_PER_NODE)
        count = _positive_int(group.get("count", 1), source, path + ".count", MAX_NODES)
        _check_totals(len(nodes) + count, total_devices + count * per_node, source, path)
        total_devices += count * per_node
        for _ in range(count):
            nodes.append(Node(index=len(nodes), device_type=dtype, num_devices=per_node))
    used_types = tuple(dict.fromkeys(n.device_type for n in nodes))

    raw_links = require_mapping(data["links"], source, "links")
    _check_keys(raw_links, _LINK_KEYS, ("inter_node_gbps", "cross_type_gbps"), source, "links.")
    raw_inter = raw_links["inter_node_gbps"]
    inter: dict[str, float] = {}
    if isinstance(raw_inter, Mapping):
        for type_name, value in raw_inter.items():
            field = f"links.inter_node_gbps.{type_name}"
            if type_name not in device_types:
                raise SpecError(source, field,
                                f"a type declared in device_types ({', '.join(device_types)})",
                                "unknown device type")
            inter[type_name] = _in_range(value, "bandwidth", source, field, "inter_node_gbps")
        for type_name in used_types:
            if type_name not in inter:
                raise SpecError(source, f"links.inter_node_gbps.{type_name}",
                                "a bandwidth for every device type used by nodes", "missing")
    else:
        bandwidth = _in_range(raw_inter, "bandwidth", source, "links.inter_node_gbps",
                              "inter_node_gbps")
        inter = {t: bandwidth for t in device_types}
    cross = _in_range(raw_links["cross_type_gbps"], "bandwidth", source,
                      "links.cross_type_gbps", "cross_type_gbps")
    latency = _in_range(raw_links.get("latency_ms", 0.0), "time", source, "links.latency_ms",
                        "latency_ms")

    return Cluster(
        name=name,
        device_types=MappingProxyType(device_types),
        nodes=tuple(nodes),
        links=Links(inter_node_gbps=MappingProxyType(inter), cross_type_gbps=cross,
                    latency_ms=latency),
        source=source,
    )


def load_cluster(path: str) -> Cluster:
    """Load and validate a YAML cluster file; raises SpecError naming file and field path."""
    return cluster_from_dict(load_yaml_mapping(path, "cluster"), source=path)


def cluster_to_dict(cluster: Cluster) -> dict[str, Any]:
    """The inverse of ``cluster_from_dict`` (bare numbers in canonical units; groups unexpanded)."""
    groups: list[dict[str, Any]] = []
    for node in cluster.nodes:
        last = groups[-1] if groups else None
        if last and last["device_type"] == node.device_type \
                and last["devices_per_node"] == node.num_devices:
            last["count"] += 1
        else:
            groups.append({"device_type": node.device_type, "devices_per_node": node.num_devices,
                           "count": 1})
    types: dict[str, Any] = {}
    for name, dt in cluster.device_types.items():
        entry: dict[str, Any] = {"memory_gib": dt.memory_gib,
                                 "intra_node_gbps": dt.intra_node_gbps}
        if dt.peak_tflops is not None:
            entry["peak_tflops"] = dt.peak_tflops
        if dt.efficiency is not None:
            entry["efficiency"] = dt.efficiency
        if dt.reserve_gib != default_reserve_gib(dt.memory_gib):
            entry["reserve_gib"] = dt.reserve_gib
        types[name] = entry
    return {
        "name": cluster.name,
        "device_types": types,
        "nodes": groups,
        "links": {"inter_node_gbps": dict(cluster.links.inter_node_gbps),
                  "cross_type_gbps": cluster.links.cross_type_gbps,
                  "latency_ms": cluster.links.latency_ms},
    }
