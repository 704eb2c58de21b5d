"""Pure-Python reference simulator: the paper's DAG built literally, then its longest path.

Slow on purpose and written to be read next to §3.1 of the paper: an explicit node list
(start, end, F/B compute nodes, R all-reduce nodes) and an explicit, typed edge list
(inter-stage, turnaround, intra-stage, all-reduce, auxiliary), a topological order by Kahn's
algorithm and a dynamic programme over it. The tests hold ``_core`` to this.

Edge kinds (one pipeline, D = 1):

- ``inter``: F(v, m) -> F(v+1, m) weighted Pf[v mod N] and B(v+1, m) -> B(v, m) weighted
  Pb[v mod N], v = c*N + s the virtual stage: 2(NV-1)M edges (2(N-1)M when V = 1).
- ``turnaround``: F(last v, m) -> B(last v, m), weight 0: M edges. (The paper draws this
  dependency but does not count it among the inter-stage edges.)
- ``intra``: consecutive ops of one device's order, weight 0: N(2VM-1) edges.
- ``allreduce``: the device's last op -> R(s): N edges.
- ``auxiliary``: start -> the first op of device 0, and R(s) -> end: 1 + N edges.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from poseidon_plugin.simulator.schedules import op_orders, validate_schedule

Node = tuple  # ("start",), ("end",), ("F"|"B", device, chunk, microbatch), ("R", device)


@dataclass(frozen=True)
class ReferenceDAG:
    nodes: tuple[Node, ...]
    node_weight_ms: dict
    edges: tuple[tuple[Node, Node, float, str], ...]   # (tail, head, weight_ms, kind)

    def count(self, kind: str) -> int:
        return sum(1 for e in self.edges if e[3] == kind)

    @property
    def num_compute_nodes(self) -> int:
        return sum(1 for n in self.nodes if n[0] in ("F", "B"))


def build_dag(forward_ms, backward_ms, send_forward_ms, send_backward_ms, allreduce_ms,
              num_microbatches: int, schedule: str = "1f1b",
              virtual_stages: int = 1) -> ReferenceDAG:
    """The DAG of one pipeline. ``forward_ms``/``backward_ms``: N per-device times (each of the
    V chunks costing 1/V of it) or a V x N per-(chunk, device) table."""
    n = len(allreduce_ms)
    n, m, v = validate_schedule(schedule, n, num_microbatches, virtual_stages)
    fwd = _per_chunk(forward_ms, v)
    bwd = _per_chunk(backward_ms, v)
    orders = op_orders(schedule, n, m, v)

    nodes: list[Node] = [("start",)]
    weight: dict = {("start",): 0.0, ("end",): 0.0}
    for s in range(n):
        for op in orders[s]:
            kind = "B" if op.is_backward else "F"
            node = (kind, s, op.chunk, op.microbatch)
            nodes.append(node)
            weight[node] = float((bwd if op.is_backward else fwd)[op.chunk][s])
    for s in range(n):
        nodes.append(("R", s))
        weight[("R", s)] = float(allreduce_ms[s])
    nodes.append(("end",))

    def at(kind: str, vs: int, mb: int) -> Node:
        return (kind, vs % n, vs // n, mb)

    edges: list[tuple[Node, Node, float, str]] = []
    nv = n * v
    for mb in range(m):
        for vs in range(nv - 1):
            edges.append((at("F", vs, mb), at("F", vs + 1, mb), float(send_forward_ms[vs % n]),
                          "inter"))
            edges.append((at("B", vs + 1, mb), at("B", vs, mb), float(send_backward_ms[vs % n]),
                          "inter"))
        edges.append((at("F", nv - 1, mb), at("B", nv - 1, mb), 0.0, "turnaround"))
    for s in range(n):
        labels = [("B" if op.is_backward else "F", s, op.chunk, op.microbatch)
                  for op in orders[s]]
        for a, b in zip(labels, labels[1:]):
            edges.append((a, b, 0.0, "intra"))
        edges.append((labels[-1], ("R", s), 0.0, "allreduce"))
    first = orders[0][0]
    edges.append((("start",), ("B" if first.is_backward else "F", 0, first.chunk,
                               first.microbatch), 0.0, "auxiliary"))
    for s in range(n):
        edges.append((("R", s), ("end",), 0.0, "auxiliary"))
    return ReferenceDAG(nodes=tuple(nodes), node_weight_ms=weight, edges=tuple(edges))


def _per_chunk(values, v: int) -> list[list[float]]:
    """Rows per chunk: a (V, N) table as is; N per-device times split evenly over V chunks."""
    rows = list(values)
    if rows and not hasattr(rows[0], "__len__"):
        return [[float(x) / v if v > 1 else float(x) for x in rows] for _ in range(v)]
    return [[float(x) for x in row] for row in rows]


def longest_path(dag: ReferenceDAG) -> tuple[float, dict, tuple[Node, ...]]:
    """(length, finish time per node, critical path start..end) by DP in topological order.

    finish(v) = weight(v) + max over edges (u, v) of finish(u) + weight(u, v); finish(start) = 0.
    """
    succ: dict = {node: [] for node in dag.nodes}
    indeg: dict = {node: 0 for node in dag.nodes}
    for tail, head, w, _ in dag.edges:
        succ[tail].append((head, w))
        indeg[head] += 1
    ready = deque(node for node in dag.nodes if indeg[node] == 0)
    order: list[Node] = []
    while ready:
        node = ready.popleft()
        order.append(node)
        for head, _ in succ[node]:
            indeg[head] -= 1
            if indeg[head] == 0:
                ready.append(head)
    if len(order) != len(dag.nodes):
        raise RuntimeError("the DAG has a cycle")  # a bug in the schedules, not a user error
    arrive: dict = {node: 0.0 for node in dag.nodes}
    parent: dict = {node: None for node in dag.nodes}
    finish: dict = {}
    for node in order:
        finish[node] = arrive[node] + dag.node_weight_ms[node]
        for head, w in succ[node]:
            if parent[head] is None or finish[node] + w > arrive[head]:
                arrive[head] = finish[node] + w
                parent[head] = node
    path = [("end",)]
    while parent[path[-1]] is not None:
        path.append(parent[path[-1]])
    return finish[("end",)], finish, tuple(reversed(path))


def iteration_time_ms(forward_ms, backward_ms, send_forward_ms, send_backward_ms, allreduce_ms,
                      num_microbatches: int, schedule: str = "1f1b",
                      virtual_stages: int = 1) -> float:
    """Longest path of the literal DAG (per-(chunk, device) times, see ``build_dag``)."""
    dag = build_dag(forward_ms, backward_ms, send_forward_ms, send_backward_ms, allreduce_ms,
                    num_microbatches, schedule, virtual_stages)
    return longest_path(dag)[0]
