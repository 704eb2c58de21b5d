"""Packing stage replicas onto concrete nodes (deterministic), and the links that follow.

Rule (the search's Cython loop implements the same rule; ``tests/test_placement.py`` holds them
equal):

* The devices of one type form a *pool* in cluster order: nodes in file order, devices 0..k-1
  inside each node.
* Stages are placed in pipeline order. Stage s of type k and TP degree t takes the next d*t
  devices of pool k: the pool's cursor is first aligned up to a multiple of t *inside its node*
  (the search only offers t dividing every node size of the type, so no TP group spans nodes;
  ``place_stages`` raises ``PoseidonError`` for a t that would put a TP group on two nodes); DP
  replica r of the stage is the TP group of devices start + r*t .. start + r*t + t-1. Skipped
  (alignment) and never reached devices are reported unused.
* Activation send s -> s+1: replica r of stage s sends to replica r of stage s+1; the link is
  intra-node (same node), inter-node of the type (same type, other node) or cross-type. All
  pipelines are simulated as one, so the stage's send time uses the slowest replica link.
  Interleaved schedules add the wrap-around link last stage -> first stage.
* DP all-reduce of stage s: t parallel rings of d ranks (one per TP rank); a ring's bandwidth is
  its slowest link: intra-node if all d*t devices share one node, else the type's inter-node link.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from .errors import PoseidonError


@dataclass(frozen=True)
class Pool:
    """Devices of one type in placement order."""

    device_type: str
    node_of: tuple[int, ...]     # pool index -> global node index
    local_of: tuple[int, ...]    # pool index -> device index inside its node

    @property
    def size(self) -> int:
        return len(self.node_of)

    @cached_property
    def node_span(self) -> int:
        """The most pool positions one node's devices spread over (last - first + 1): two
        devices of the pool at least this far apart are on different nodes."""
        first: dict[int, int] = {}
        span = 1
        for i, n in enumerate(self.node_of):
            first.setdefault(n, i)
            span = max(span, i - first[n] + 1)
        return span


def type_pools(cluster) -> tuple[Pool, ...]:
    """One pool per device type, in ``cluster.type_names`` order."""
    pools = []
    for name in cluster.type_names:
        node_of: list[int] = []
        local_of: list[int] = []
        for node in cluster.nodes_of_type(name):
            node_of.extend([node.index] * node.num_devices)
            local_of.extend(range(node.num_devices))
        pools.append(Pool(name, tuple(node_of), tuple(local_of)))
    return tuple(pools)


@dataclass(frozen=True)
class StagePlacement:
    type_index: int
    tp: int
    start: int                                   # pool index of replica 0, TP rank 0
    slots: tuple[tuple[tuple[int, int], ...], ...]  # [dp_rank][tp_rank] -> (node, local device)


def aligned_start(pool: Pool, cursor: int, tp: int) -> int:
    """Cursor moved up to the next TP-aligned position inside its node."""
    if cursor < pool.size:
        local = pool.local_of[cursor]
        if local % tp:
            cursor += tp - local % tp
    return cursor


def place_stages(pools: tuple[Pool, ...], stage_types: list[int] | tuple[int, ...],
                 stage_tps: list[int] | tuple[int, ...], dp: int
                 ) -> tuple[tuple[StagePlacement, ...], tuple[tuple[int, int], ...]]:
    """Place every stage; return (placements, unused (node, local device) slots, sorted)."""
    cursors = [0] * len(pools)
    placements: list[StagePlacement] = []
    used: set[tuple[int, int]] = set()
    for k, t in zip(stage_types, stage_tps):
        pool = pools[k]
        start = aligned_start(pool, cursors[k], t)
        if start + dp * t > pool.size:
            raise PoseidonError(
                f"placement: not enough {pool.device_type} devices for a stage of dp={dp} x "
                f"tp={t} (pool of {pool.size}, next free {start})")
        slots = []
        for r in range(dp):
            first, last = start + r * t, start + r * t + t - 1
            if pool.node_of[first] != pool.node_of[last]:
                raise PoseidonError(
                    f"placement: a TP group of tp={t} would span nodes {pool.node_of[first]} "
                    f"and {pool.node_of[last]} ({pool.device_type} devices {first}..{last} of "
                    f"the pool); tp must divide the number of devices of every "
                    f"{pool.device_type} node")
            group = []
            for j in range(t):
                i = start + r * t + j
                group.append((pool.node_of[i], pool.local_of[i]))
                used.add((pool.node_of[i], pool.local_of[i]))
            slots.append(tuple(group))
        placements.append(StagePlacement(k, t, start, tuple(slots)))
        cursors[k] = start + dp * t
    unused = sorted((pool.node_of[i], pool.local_of[i]) for pool in pools
                    for i in range(pool.size) if (pool.node_of[i], pool.local_of[i]) not in used)
    return tuple(placements), tuple(unused)


def send_link_gbps(cluster, a: StagePlacement, b: StagePlacement) -> float:
    """Slowest bandwidth between replica r of stage a and replica r of stage b, over r."""
    return min(cluster.link_gbps(ra[0][0], rb[0][0]) for ra, rb in zip(a.slots, b.slots))


def ring_gbps(cluster, p: StagePlacement) -> float:
    """Slowest link of the stage's DP all-reduce ring(s)."""
    nodes = {slot[0] for group in p.slots for slot in group}
    first = next(iter(nodes))
    if len(nodes) == 1:
        return cluster.link_gbps(first, first)
    return min(cluster.link_gbps(x, y) for x in nodes for y in nodes if x != y)
