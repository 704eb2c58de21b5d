"""What changed between the launch a checkpoint (or a kept plan) was made for and this one.

One line, e.g. ``lost 1 x emu-slow (host a); plan 1f1b pp=2 dp=2 -> pp=3 dp=1, layers 7,1 ->
2,3,3; 778 -> 901 ms predicted``. Devices are compared as counts per (place, device type): a
place is a host in a launch, ``node i`` in a cluster file. Torch-free.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

from poseidon_plugin.safeio import bound_line, bounded_join

if TYPE_CHECKING:
    from poseidon_plugin.cluster import Cluster
    from poseidon_plugin.plan import Plan


MAX_STAGES = 16   # stages listed in a change line (the rest counted)
MAX_CHANGES = 8   # device changes listed (the rest counted)


@dataclass(frozen=True)
class DeviceGroup:
    """``count`` devices of ``device_type`` at ``place`` (a host, ``node i``, or "": anywhere)."""

    place: str
    device_type: str
    count: int

    def to_dict(self) -> dict[str, Any]:
        return {"place": self.place, "device_type": self.device_type, "count": self.count}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "DeviceGroup":
        return cls(str(d["place"]), str(d["device_type"]), int(d["count"]))


def cluster_devices(cluster: "Cluster") -> tuple[DeviceGroup, ...]:
    """A cluster file's devices, one group per node (``node i``)."""
    return tuple(DeviceGroup(f"node {n.index}", n.device_type, n.num_devices)
                 for n in cluster.nodes)


def plan_devices(plan: "Plan") -> tuple[DeviceGroup, ...]:
    """The devices a plan was made for: its stages' devices and the ones it left unused (an
    unused device takes the type of its node's used devices; ``unknown`` if none is used)."""
    node_type: dict[int, str] = {}
    counts: Counter[int] = Counter()
    for stage in plan.stages:
        for group in stage.devices:
            for slot in group:
                node_type[slot.node] = stage.device_type
                counts[slot.node] += 1
    for slot in plan.unused_devices:
        counts[slot.node] += 1
    node_type.update(enumerate(plan.node_types))   # recorded by the search (newer plans)
    return tuple(DeviceGroup(f"node {n}", node_type.get(n, "unknown"), counts[n])
                 for n in sorted(counts))


def device_changes(old: Iterable[DeviceGroup], new: Iterable[DeviceGroup]) -> list[str]:
    """``lost 1 x A (host h)`` / ``added 8 x B (node 4)`` per place and type; [] if the same."""
    before: Counter[tuple[str, str]] = Counter()
    after: Counter[tuple[str, str]] = Counter()
    for g in old:
        before[(g.place, g.device_type)] += g.count
    for g in new:
        after[(g.place, g.device_type)] += g.count
    out = []
    for key in sorted(set(before) | set(after)):
        diff = after[key] - before[key]
        if diff:
            where = f" ({key[0]})" if key[0] else ""
            out.append(f"{'added' if diff > 0 else 'lost'} {abs(diff)} x {key[1]}{where}")
    return out


def type_totals(groups: Iterable[DeviceGroup]) -> list[DeviceGroup]:
    """The same devices counted per type only (places dropped: a cluster file's node indices
    shift when a node goes)."""
    total: Counter[str] = Counter()
    for g in groups:
        total[g.device_type] += g.count
    return [DeviceGroup("", t, c) for t, c in sorted(total.items())]


def _tp(plan: "Plan") -> str:
    """The plan's TP degree; a per-stage-TP plan (``--per-stage-tp``) lists its stages'."""
    if plan.uniform_tp:
        return str(plan.tp)
    return bounded_join([s.tp for s in plan.stages], ",", MAX_STAGES)


def _shape(plan: "Plan") -> dict[str, str]:
    return {"": plan.schedule, "pp": str(plan.pp), "tp": _tp(plan), "dp": str(plan.dp),
            "ep": str(getattr(plan, "ep", 1)), "v": str(plan.virtual_stages),
            "mbs": str(plan.micro_batch_size), "cp": str(getattr(plan, "cp", 1))}


def _ms(value: float) -> str:
    """``9,412`` at and above 100 ms, three significant digits below (``0.391``)."""
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def plan_changes(old: "Plan", new: "Plan") -> str:
    """``plan 1f1b pp=2 dp=2 -> pp=3 dp=1, layers 7,1 -> 2,3,3, stage types a,b -> b,a,a;
    778 -> 901 ms predicted`` (only what differs; ``plan unchanged (1f1b pp=2)`` if nothing)."""
    a, b = _shape(old), _shape(new)
    changed = [k for k in a if k and a[k] != b[k]]
    parts = []
    if changed or a[""] != b[""]:
        was = [a[""]] + [f"{k}={a[k]}" for k in changed]
        now = ([b[""]] if a[""] != b[""] else []) + [f"{k}={b[k]}" for k in changed]
        parts.append(f"{' '.join(was)} -> {' '.join(now)}")
    la, lb = old.layers_per_stage, new.layers_per_stage
    if la != lb:
        parts.append(f"layers {bounded_join(la, ',', MAX_STAGES)} -> "
                     f"{bounded_join(lb, ',', MAX_STAGES)}")
    ta = [s.device_type for s in old.stages]
    tb = [s.device_type for s in new.stages]
    if ta != tb:
        parts.append(f"stage types {bounded_join(ta, ',', MAX_STAGES)} -> "
                     f"{bounded_join(tb, ',', MAX_STAGES)}")
    times = (f"{_ms(old.predicted_iteration_time_ms)} -> {_ms(new.predicted_iteration_time_ms)} "
             "ms predicted")
    if not parts:
        return f"plan unchanged ({old.schedule} pp={old.pp}), {times}"
    return f"plan {', '.join(parts)}; {times}"


def change_summary(old_devices: Iterable[DeviceGroup], new_devices: Iterable[DeviceGroup],
                   old_plan: "Plan", new_plan: "Plan") -> str:
    """The one line a relaunch prints: the devices that went or came, then the plan's change."""
    devices = device_changes(old_devices, new_devices) or ["the same devices"]
    return bound_line(f"{bounded_join(devices, ', ', MAX_CHANGES)}; "
                      f"{plan_changes(old_plan, new_plan)}")


def kept_plan_summary(previous: "Plan", cluster: "Cluster", plan: "Plan") -> str:
    """``poseidon plan --keep PLAN.json``: the change summary of a relaunch, offline (devices
    per type: a cluster file's node indices shift when a node goes)."""
    return change_summary(type_totals(plan_devices(previous)),
                          type_totals(cluster_devices(cluster)), previous, plan)
