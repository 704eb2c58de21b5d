"""Rank renumbering: put each physical device on the pipeline stage the plan chose for it.

Megatron (default order tp-cp-ep-dp-pp) puts new ranks ``[s*B, (s+1)*B)`` on stage ``s`` with
``B = tp*dp``. The plan's ``rank_order()`` lists, for every new rank, the physical slot
(cluster node, device index inside the node) that must take it; the discovery topology maps slots
back to launch ranks. Launch ranks absent from the order are not used by the plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from poseidon_plugin.errors import PoseidonError

if TYPE_CHECKING:
    from poseidon_plugin.plan import DeviceSlot, Plan
    from poseidon_plugin.megatron.launch.discovery import Topology


@dataclass(frozen=True)
class Renumbering:
    new_rank_of: dict[int, int]      # launch rank -> new rank (used ranks only)
    launch_rank_of: tuple[int, ...]  # new rank -> launch rank
    unused: tuple[int, ...]          # launch ranks the plan leaves idle

    @property
    def world_size(self) -> int:
        return len(self.launch_rank_of)


def renumber(rank_order: Sequence[DeviceSlot], topo: Topology, world_size: int) -> Renumbering:
    """Map the plan's new-rank order (``Plan.rank_order()``) onto launch ranks; PoseidonError if
    it does not fit the launch."""
    launch_of: list[int] = []
    for new_rank, slot in enumerate(rank_order):
        node, dev = slot.node, slot.local_device
        if not 0 <= node < len(topo.nodes) or not 0 <= dev < len(topo.nodes[node]):
            raise PoseidonError(f"the plan places new rank {new_rank} on node {node} device {dev}, "
                                "which this launch does not have (was it made for another cluster?)")
        launch_of.append(topo.nodes[node][dev])
    if len(set(launch_of)) != len(launch_of):
        raise PoseidonError("the plan's rank order uses a device twice")
    if not launch_of:
        raise PoseidonError("the plan uses no device")
    new_of = {lr: nr for nr, lr in enumerate(launch_of)}
    unused = tuple(r for r in range(world_size) if r not in new_of)
    return Renumbering(new_of, tuple(launch_of), unused)


def stage_map(plan: Plan, renum: Renumbering, topo: Topology) -> list[str]:
    """Human-readable new rank -> stage lines (for the dry-run and the log)."""
    per_stage = max(1, renum.world_size // max(1, plan.pp))
    lines = []
    for new_rank, launch in enumerate(renum.launch_rank_of):
        stage = new_rank // per_stage
        lines.append(f"new rank {new_rank:>3} <- {topo.describe(launch)} -> pipeline stage {stage}")
    for launch in renum.unused:
        lines.append(f"  (unused) {topo.describe(launch)}")
    return lines
