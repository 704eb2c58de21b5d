"""A tiny stand-in planner for the integration's own tests (``POSEIDON_PLANNER=poseidon_plugin.megatron._testing``).

It plans one pipeline stage per cluster node (fastest measured type first), DP = the smallest node,
TP = 1, and splits the layers in proportion to each type's measured speed. It exercises the flow
(broadcast, renumbering, argv rewrite) without depending on the real search.
``POSEIDON_FAKE_PLAN=fastest-node`` plans on the fastest node only (the other ranks stay unused).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class FakeSlot:
    node: int
    local_device: int


@dataclass(frozen=True)
class FakeStage:
    index: int
    device_type: str
    tp: int
    dp: int
    layers: int
    devices: tuple[tuple[FakeSlot, ...], ...] = ()


@dataclass(frozen=True)
class FakePlan:
    schedule: str
    virtual_stages: int
    dp: int
    micro_batch_size: int
    num_microbatches: int
    global_batch_size: int
    seq_length: int
    stages: tuple[FakeStage, ...]
    predicted_iteration_time_ms: float = 0.0
    search: dict = field(default_factory=dict)

    @property
    def tp(self) -> int:
        return self.stages[0].tp

    @property
    def pp(self) -> int:
        return len(self.stages)

    @property
    def layers_per_stage(self) -> tuple[int, ...]:
        return tuple(s.layers for s in self.stages)

    def megatron_args(self):  # like the interface stub: derived by the integration
        return None

    def rank_order(self) -> list[FakeSlot]:
        out = []
        for s in self.stages:
            for dp_row in s.devices:
                out.extend(dp_row)
        return out

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    def table(self) -> str:
        rows = [f"stage {s.index}: {s.device_type:<10} tp={s.tp} dp={s.dp} layers={s.layers}"
                for s in self.stages]
        return "\n".join([f"schedule {self.schedule}, mbs {self.micro_batch_size}, "
                          f"{self.num_microbatches} micro-batches", *rows])


def plan_from_json(text: str) -> FakePlan:
    d = json.loads(text)
    stages = tuple(FakeStage(s["index"], s["device_type"], s["tp"], s["dp"], s["layers"],
                             tuple(tuple(FakeSlot(**slot) for slot in row) for row in s["devices"]))
                   for s in d.pop("stages"))
    return FakePlan(stages=stages, **d)


def search_plan(cluster: Any, model: Any, *, global_batch_size: int, seq_length: int,
                profiles: Any = None, micro_batch_sizes: Any = None, **_: Any) -> FakePlan:
    from ..profiles import ProfileKey

    mbs = int((micro_batch_sizes or (1,))[0])
    dp = min(n.num_devices for n in cluster.nodes)

    def per_layer_ms(t: str) -> float:
        p = profiles.get(ProfileKey(t, "decoder", 1, mbs, seq_length, model.signature())) \
            if profiles is not None else None
        return (p.forward_ms + p.backward_ms) if p is not None else 1.0

    nodes = sorted(cluster.nodes, key=lambda n: (per_layer_ms(n.device_type), n.index))
    if os.environ.get("POSEIDON_FAKE_PLAN") == "fastest-node":  # leaves the other devices unused
        nodes = nodes[:1]
        dp = nodes[0].num_devices
    speed = [1.0 / per_layer_ms(n.device_type) for n in nodes]
    total = model.num_layers
    raw = [total * s / sum(speed) for s in speed]
    layers = [max(1, int(r)) for r in raw]
    while sum(layers) < total:
        i = max(range(len(raw)), key=lambda k: raw[k] - layers[k])
        layers[i] += 1
    while sum(layers) > total:
        i = max(range(len(layers)), key=lambda k: layers[k])
        layers[i] -= 1
    stages = tuple(FakeStage(k, n.device_type, 1, dp, layers[k],
                             tuple((FakeSlot(n.index, d),) for d in range(dp)))
                   for k, n in enumerate(nodes))
    return FakePlan("1f1b", 1, dp, mbs, global_batch_size // (mbs * dp), global_batch_size,
                    seq_length, stages)
