"""Discovery: what every rank runs on, grouped into nodes and device types, plus a short link probe.

The launch ranks are grouped into cluster nodes by (host, device type): a host with two device types
becomes two nodes (the CPU emulation does exactly that). Node order is the order of first appearance
in launch-rank order, so the cluster and the plan are deterministic for a given launch.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from poseidon_plugin.cluster import NOMINAL_PEAK_TFLOPS, Cluster, cluster_from_dict
from poseidon_plugin.errors import SpecError

log = logging.getLogger("poseidon")

_INTRA_GBPS: tuple[tuple[str, float], ...] = (
    ("H200", 3600.0), ("H100", 3600.0), ("H800", 1600.0), ("A100", 2400.0), ("A800", 1600.0),
    ("V100", 1200.0), ("910B", 1400.0),
)


def _lookup(table: Sequence[tuple[str, float]], name: str, default: float) -> float:
    for key, value in table:
        if key.lower() in name.lower():
            return value
    return default


@dataclass(frozen=True)
class DeviceInfo:
    rank: int              # launch rank
    local_rank: int
    host: str
    device_type: str       # type name (device name, renamed by the cluster file, or emulated type)
    memory_bytes: int
    kind: str              # cuda | npu | cpu | emulated
    speed_hint: float = 1.0  # emulated speed (only for the analytic peak of an emulated type)
    device_name: str = ""    # the device's own name (the emulated type's under emulation)


@dataclass(frozen=True)
class Topology:
    """Launch ranks grouped into cluster nodes."""

    infos: tuple[DeviceInfo, ...]                 # by launch rank
    nodes: tuple[tuple[int, ...], ...]            # node index -> launch ranks, by local device index
    node_types: tuple[str, ...]                   # node index -> device type
    node_hosts: tuple[str, ...]

    def slot_of(self, rank: int) -> tuple[int, int]:
        for n, ranks in enumerate(self.nodes):
            if rank in ranks:
                return n, ranks.index(rank)
        raise KeyError(rank)

    def rank_of(self, node: int, local_device: int) -> int:
        return self.nodes[node][local_device]

    def summary(self) -> str:
        """``4 rank(s) on 1 host(s), 2 device type(s)`` (a cluster node is one host's devices
        of one type; hosts and types are what the user knows)."""
        return (f"{len(self.infos)} rank(s) on {len(set(self.node_hosts))} host(s), "
                f"{len(set(self.node_types))} device type(s)")

    def describe(self, rank: int) -> str:
        i = self.infos[rank]
        return f"launch rank {rank} (host {i.host}, local rank {i.local_rank}, {i.device_type})"


def group_nodes(infos: Sequence[DeviceInfo]) -> Topology:
    infos = tuple(sorted(infos, key=lambda i: i.rank))
    order: list[tuple[str, str]] = []
    members: dict[tuple[str, str], list[DeviceInfo]] = {}
    for info in infos:
        key = (info.host, info.device_type)
        if key not in members:
            order.append(key)
            members[key] = []
        members[key].append(info)
    nodes = tuple(tuple(i.rank for i in sorted(members[k], key=lambda i: (i.local_rank, i.rank)))
                  for k in order)
    return Topology(infos, nodes, tuple(k[1] for k in order), tuple(k[0] for k in order))


# ----------------------------------------------------------------------------------------------
# link probe
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LinkMeasurements:
    intra_gbps: Mapping[str, float] = field(default_factory=dict)   # per device type
    inter_gbps: Mapping[str, float] = field(default_factory=dict)   # per device type
    cross_gbps: float | None = None
    latency_ms: float | None = None


def probe_pairs(topo: Topology, skip: set[str] = frozenset()) -> list[tuple[str, str, int, int]]:
    """One representative (category, type, rank_a, rank_b) per link class not in ``skip``."""
    pairs: list[tuple[str, str, int, int]] = []
    seen: set[tuple[str, str]] = set()
    for n, ranks in enumerate(topo.nodes):
        t = topo.node_types[n]
        if len(ranks) >= 2 and ("intra", t) not in seen and f"intra:{t}" not in skip:
            seen.add(("intra", t))
            pairs.append(("intra", t, ranks[0], ranks[1]))
    for a in range(len(topo.nodes)):
        for b in range(a + 1, len(topo.nodes)):
            ta, tb = topo.node_types[a], topo.node_types[b]
            if ta == tb:
                key, name = ("inter", ta), f"inter:{ta}"
            else:
                key, name = ("cross", ""), "cross"
            if key not in seen and name not in skip:
                seen.add(key)
                pairs.append((key[0], key[1], topo.nodes[a][0], topo.nodes[b][0]))
    return pairs


def measure_links(boot: Any, topo: Topology, device: Any, skip: set[str] = frozenset(),
                  message_bytes: int = 4 << 20, reps: int = 3) -> LinkMeasurements:
    """Point-to-point bandwidth for each link class, measured by one pair at a time (ping-pong)."""
    import torch
    import torch.distributed as dist

    pairs = probe_pairs(topo, skip)
    if not pairs:
        return LinkMeasurements()
    rank = boot.env.rank
    group = None
    dev = torch.device("cpu")
    if device.kind in ("cuda", "npu"):
        # the probe group is gloo (host memory); device links need the device backend
        from poseidon_plugin.megatron.launch.bootstrap import device_backend

        group = dist.new_group(backend=device_backend(device.kind))
        dev = torch.device(device.kind, device.index)
    big = torch.empty(message_bytes // 4, dtype=torch.float32, device=dev)
    small = torch.zeros(1, dtype=torch.float32, device=dev)
    results: dict[str, float] = {}
    latency: list[float] = []

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    for idx, (cat, t, a, b) in enumerate(pairs):
        if rank not in (a, b):
            continue
        peer = b if rank == a else a
        best_s = float("inf")
        for rep in range(reps + 1):  # first round is a warm-up (connection setup)
            t0 = time.perf_counter()
            if rank == a:
                dist.send(big, peer, group=group)
                dist.recv(small, peer, group=group)
            else:
                dist.recv(big, peer, group=group)
                dist.send(small, peer, group=group)
            sync()
            if rep:
                best_s = min(best_s, time.perf_counter() - t0)
        # latency: small round trips
        t0 = time.perf_counter()
        for _ in range(3):
            if rank == a:
                dist.send(small, peer, group=group)
                dist.recv(small, peer, group=group)
            else:
                dist.recv(small, peer, group=group)
                dist.send(small, peer, group=group)
        sync()
        rtt_s = (time.perf_counter() - t0) / 3
        if rank == a:
            gbps = message_bytes * 8 / max(best_s - rtt_s / 2, 1e-9) / 1e9
            results[f"{cat}:{t}" if cat != "cross" else "cross"] = gbps
            latency.append(rtt_s / 2 * 1e3)
    gathered = boot.all_gather_object((results, latency), "link-probe")
    if group is not None:
        dist.destroy_process_group(group)
    merged: dict[str, float] = {}
    lat: list[float] = []
    for res, l in gathered:
        merged.update(res)
        lat.extend(l)
    intra = {k.split(":", 1)[1]: v for k, v in merged.items() if k.startswith("intra:")}
    inter = {k.split(":", 1)[1]: v for k, v in merged.items() if k.startswith("inter:")}
    return LinkMeasurements(intra, inter, merged.get("cross"),
                            statistics.median(lat) if lat else None)


# ----------------------------------------------------------------------------------------------
# the Cluster (calibrating its compute speed to the profiles is profile_gather.calibrate)
# ----------------------------------------------------------------------------------------------


def links_given(overrides: Mapping[str, Any], types: Sequence[str]) -> set[str]:
    """Link classes the cluster file fixes (those are not probed)."""
    skip: set[str] = set()
    dtypes = overrides.get("device_types") or {}
    for t in types:
        if isinstance(dtypes.get(t), Mapping) and "intra_node_gbps" in dtypes[t]:
            skip.add(f"intra:{t}")
    links = overrides.get("links") or {}
    inter = links.get("inter_node_gbps") or {}
    if isinstance(inter, Mapping):
        skip.update(f"inter:{t}" for t in inter)
    if "cross_type_gbps" in links:
        skip.add("cross")
    return skip


def speed_given(overrides: Mapping[str, Any]) -> set[str]:
    """Device types whose compute speed the cluster file fixes (profiles do not calibrate them)."""
    dtypes = overrides.get("device_types") or {}
    if not isinstance(dtypes, Mapping):
        return set()
    return {t for t, body in dtypes.items()
            if isinstance(body, Mapping) and ("efficiency" in body or "peak_tflops" in body)}


def discover_cluster(topo: Topology, links: LinkMeasurements,
                     overrides: Mapping[str, Any] | None = None,
                     source: str = "<discovered>") -> Cluster:
    """The ``Cluster`` of the discovered launch: devices and measured links, the cluster file's
    overrides on top, validated once by ``cluster_from_dict`` (errors name ``source``)."""
    return cluster_from_dict(_cluster_spec(topo, links, overrides, source), source=source)


def _cluster_spec(topo: Topology, links: LinkMeasurements, overrides: Mapping[str, Any] | None,
                  source: str) -> dict[str, Any]:
    """The YAML-shaped cluster dict (see poseidon_plugin.cluster) for the discovered launch."""
    overrides = dict(overrides or {})
    types: dict[str, dict[str, Any]] = {}
    for info in topo.infos:
        if info.device_type in types:
            continue
        peak = (_lookup(NOMINAL_PEAK_TFLOPS, info.device_type, 100.0) if info.kind in ("cuda", "npu")
                else 1.0 * info.speed_hint)
        intra_default = _lookup(_INTRA_GBPS, info.device_type, 100.0)
        types[info.device_type] = {
            "memory_gib": round(info.memory_bytes / (1 << 30), 3),
            "peak_tflops": peak,
            "intra_node_gbps": round(links.intra_gbps.get(info.device_type, intra_default), 3),
        }
    over_types = overrides.get("device_types") or {}
    if not isinstance(over_types, Mapping):
        raise SpecError(source, "device_types", "a mapping of device type overrides", over_types)
    for name, body in over_types.items():
        if name not in types:
            continue  # a type this launch does not have: harmless
        if not isinstance(body, Mapping):
            raise SpecError(source, f"device_types.{name}", "a mapping of fields", body)
        types[name].update(body)
    inter = {t: round(v, 3) for t, v in links.inter_gbps.items()}
    present = list(dict.fromkeys(topo.node_types))
    default_inter = min(inter.values()) if inter else 100.0
    for t in present:
        inter.setdefault(t, default_inter)
    cross = links.cross_gbps if links.cross_gbps is not None else min(inter.values())
    link_dict: dict[str, Any] = {"inter_node_gbps": inter, "cross_type_gbps": round(cross, 3),
                                 "latency_ms": round(links.latency_ms or 0.0, 4)}
    over_links = overrides.get("links") or {}
    if not isinstance(over_links, Mapping):
        raise SpecError(source, "links", "a mapping", over_links)
    for k, v in over_links.items():
        if k == "inter_node_gbps" and isinstance(v, Mapping):
            link_dict["inter_node_gbps"].update(v)
        else:
            link_dict[k] = v
    nodes = [{"device_type": topo.node_types[n], "devices_per_node": len(r), "count": 1}
             for n, r in enumerate(topo.nodes)]
    return {"name": overrides.get("name", "discovered"), "device_types": types, "nodes": nodes,
            "links": link_dict}


def rename_type(raw_name: str, overrides: Mapping[str, Any] | None) -> str:
    names = (overrides or {}).get("device_names") or {}
    return str(names.get(raw_name, raw_name))


def load_overrides(path: str | None) -> dict[str, Any]:
    if not path:
        return {}
    from poseidon_plugin.specfile import load_yaml

    data = load_yaml(path, "cluster override") or {}  # bounded: size, depth, aliases, keys
    if not isinstance(data, dict):
        raise SpecError(path, "<root>", "a mapping", type(data).__name__)
    if "nodes" in data:    # accepted and then ignored before: say so instead
        raise SpecError(path, "nodes", "no nodes: a launch's nodes are its ranks, found by "
                        "discovery (override device_types, links or device_names)",
                        data["nodes"])
    allowed = {"name", "device_types", "links", "device_names"}
    unknown = set(data) - allowed
    if unknown:
        raise SpecError(path, "<root>", f"only the keys {sorted(allowed)}", sorted(unknown))
    return data
