"""Cluster specification: device types, nodes and links; loading and validation.

INTERFACE STUB — bodies to be filled in; signatures and field names are the contract other
modules (profiles, memory, search, integration) code against. Keep them.

YAML shape (units in names):

    name: paper-setting1
    device_types:
      A2-2: {memory_gib: 64, peak_tflops: 376, efficiency: 0.45, intra_node_gbps: 1400}
      A2-3: {memory_gib: 64, peak_tflops: 313, intra_node_gbps: 1400}
    nodes:
      - {device_type: A2-2, devices_per_node: 8, count: 1}
      - {device_type: A2-3, devices_per_node: 8, count: 1}
    links:
      inter_node_gbps: {A2-2: 200, A2-3: 200}   # between nodes of the same type
      cross_type_gbps: 75                        # between nodes of different types
      latency_ms: 0.01                           # per message, added to every transfer
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

DEFAULT_EFFICIENCY = 0.5  # fraction of peak dense bf16 TFLOP/s a transformer layer reaches


@dataclass(frozen=True)
class DeviceType:
    name: str
    memory_gib: float
    peak_tflops: float              # dense bf16 peak, TFLOP/s
    intra_node_gbps: float          # device-to-device bandwidth inside one node, Gbit/s
    efficiency: float | None = None  # measured fraction of peak; None -> DEFAULT_EFFICIENCY

    @property
    def memory_bytes(self) -> int: ...

    @property
    def effective_tflops(self) -> float: ...


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


@dataclass(frozen=True)
class Cluster:
    name: str
    device_types: Mapping[str, DeviceType]
    nodes: tuple[Node, ...]
    links: Links
    source: str = "<memory>"

    def devices_of_type(self, device_type: str) -> int: ...
    def nodes_of_type(self, device_type: str) -> tuple[Node, ...]: ...
    @property
    def type_names(self) -> tuple[str, ...]: ...   # in order of first appearance in `nodes`
    @property
    def total_devices(self) -> int: ...

    def link_gbps(self, node_a: int, node_b: int) -> float:
        """Bandwidth between a device on node_a and one on node_b (intra if equal)."""
        ...


def load_cluster(path: str) -> Cluster:
    """Load and validate a YAML cluster file; raises SpecError naming file and field path."""
    ...


def cluster_from_dict(data: Mapping[str, Any], source: str = "<dict>") -> Cluster: ...
