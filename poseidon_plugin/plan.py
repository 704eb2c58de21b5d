"""The Plan value: stable JSON, readable table, flags for Megatron-LM and MindSpeed-LLM, rank order.

INTERFACE STUB (owned by the search work) — fields below are the contract with the integration.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class DeviceSlot:
    node: int            # cluster node index
    local_device: int    # device index inside the node (LOCAL_RANK on that node)


@dataclass(frozen=True)
class StagePlan:
    index: int
    device_type: str
    tp: int
    dp: int
    layers: int
    forward_ms: float
    backward_ms: float
    send_forward_ms: float      # to the next stage (0 on the last)
    send_backward_ms: float     # gradient from the next stage (0 on the last)
    allreduce_ms: float
    memory_bytes: int
    memory_capacity_bytes: int
    # devices[dp_rank][tp_rank] -> slot; Megatron rank order tp-cp-ep-dp-pp
    devices: tuple[tuple[DeviceSlot, ...], ...] = ()


@dataclass(frozen=True)
class Plan:
    schedule: str
    virtual_stages: int
    dp: int
    micro_batch_size: int
    num_microbatches: int
    global_batch_size: int
    seq_length: int
    stages: tuple[StagePlan, ...]
    predicted_iteration_time_ms: float
    model_name: str = ""
    cluster_name: str = ""
    unused_devices: tuple[DeviceSlot, ...] = ()
    search: dict[str, Any] = field(default_factory=dict)

    @property
    def tp(self) -> int: ...                      # uniform TP (error if per-stage differs)
    @property
    def pp(self) -> int: ...
    @property
    def layers_per_stage(self) -> tuple[int, ...]: ...

    def megatron_args(self) -> list[str]: ...     # argv tokens
    def mindspeed_llm_args(self) -> list[str]: ...
    def rank_order(self) -> list[DeviceSlot]:
        """new_rank -> physical slot, Megatron's default order tp-cp-ep-dp-pp."""
        ...
    def to_json(self) -> str: ...                 # deterministic
    @classmethod
    def from_json(cls, text: str) -> "Plan": ...
    def table(self) -> str: ...                   # human-readable
