"""Thin Python API over the Cython DAG simulator (``poseidon_plugin._core``).

Semantics (the contract the tests hold it to; the DAG is spelled out in ``_core.pyx``): one
pipeline of N stages (devices), M micro-batches; per-stage ``forward_ms[s]``,
``backward_ms[s]``, ``allreduce_ms[s]``;
``send_forward_ms[s]`` is the activation send s -> s+1 and ``send_backward_ms[s]`` the gradient
send s+1 -> s (length N-1; for interleaved-1f1b length N, the last entry being the wrap-around
link device N-1 -> device 0, used from chunk c on device N-1 to chunk c+1 on device 0 and back).
For interleaved-1f1b with V chunks each chunk costs ``forward_ms[s] / V`` unless per-chunk
arrays (shape (V, N)) are passed.

The per-device op orders come from ``poseidon_plugin.simulator.schedules``; the DAG is documented in
``_core.pyx`` and built literally in ``reference.py``. The structure of the DAG is
precomputed and cached per (schedule, N, M, V) (``_core.get_dag``); each call here validates the
inputs once and runs one ``nogil`` sweep. Other Cython modules use the C API in ``_core.pxd``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from poseidon_plugin import _core
from poseidon_plugin.errors import PoseidonError
from poseidon_plugin.simulator.schedules import SCHEDULES, validate_schedule
from poseidon_plugin.simulator.timeline import Timeline

__all__ = ["SCHEDULES", "Timeline", "SimInputs", "normalize_inputs", "simulate_pipeline",
           "iteration_time_ms", "static_estimate_ms", "get_dag"]

get_dag = _core.get_dag


@dataclass(frozen=True)
class SimInputs:
    """Validated, contiguous float64 inputs in ``_core``'s layout (see ``_core.pxd``)."""

    forward_ms: np.ndarray        # (V*N,), chunk-major: [c*N + s]
    backward_ms: np.ndarray       # (V*N,)
    send_forward_ms: np.ndarray   # (num_links,)
    send_backward_ms: np.ndarray  # (num_links,)
    allreduce_ms: np.ndarray      # (N,)
    num_stages: int
    num_microbatches: int
    schedule: str
    virtual_stages: int


def _times(name: str, values, shape_hint: str) -> np.ndarray:
    try:
        arr = np.array(values, dtype=np.float64)
    except (TypeError, ValueError):
        raise PoseidonError(f"{name}: expected {shape_hint} of numbers (ms), "
                            f"got {values!r}") from None
    if arr.size and not np.all(np.isfinite(arr)):
        raise PoseidonError(f"{name}: expected finite times (ms), got {arr.tolist()}")
    if arr.size and float(arr.min()) < 0.0:
        raise PoseidonError(f"{name}: expected times >= 0 ms, got {arr.tolist()}")
    return arr


def normalize_inputs(forward_ms, backward_ms, send_forward_ms, send_backward_ms, allreduce_ms,
                     num_microbatches: int, schedule: str = "1f1b",
                     virtual_stages: int = 1) -> SimInputs:
    """Validate once and lay the inputs out for ``_core`` (raises PoseidonError)."""
    ar = _times("allreduce_ms", allreduce_ms, "one time per stage")
    if ar.ndim != 1 or ar.size == 0:
        raise PoseidonError(f"allreduce_ms: expected one time per stage (a non-empty 1-D "
                            f"sequence), got shape {ar.shape}")
    n = ar.size
    n, m, v = validate_schedule(schedule, n, num_microbatches, virtual_stages)
    per_chunk = []
    for name, values in (("forward_ms", forward_ms), ("backward_ms", backward_ms)):
        arr = _times(name, values, f"{n} per-stage times or a ({v}, {n}) per-chunk table")
        if arr.shape == (n,):
            arr = np.tile(arr / v, v) if v > 1 else arr
        elif arr.shape == (v, n):
            arr = arr.reshape(-1)
        else:
            expected = f"shape ({n},)" + (f" or ({v}, {n})" if v > 1 else "")
            raise PoseidonError(f"{name}: expected {expected} (N={n} from allreduce_ms), "
                                f"got shape {arr.shape}")
        per_chunk.append(np.ascontiguousarray(arr))
    links = n if schedule == "interleaved-1f1b" else n - 1
    sends = []
    for name, values in (("send_forward_ms", send_forward_ms),
                         ("send_backward_ms", send_backward_ms)):
        arr = _times(name, values, f"{links} link times")
        if arr.shape != (links,):
            why = ("N, the last being the wrap-around link N-1 -> 0"
                   if schedule == "interleaved-1f1b" else "N-1, one per link s -> s+1")
            raise PoseidonError(f"{name}: expected {links} times ({why}) for schedule "
                                f"{schedule!r} with N={n}, got shape {arr.shape}")
        sends.append(np.ascontiguousarray(arr))
    return SimInputs(per_chunk[0], per_chunk[1], sends[0], sends[1], np.ascontiguousarray(ar),
                     n, m, schedule, v)


def _dag_for(x: SimInputs, engine: bool = False, calls=None):
    return _core.get_dag(x.schedule, x.num_stages, x.num_microbatches, x.virtual_stages, engine,
                         None if calls is None else tuple(float(c) for c in calls))


def iteration_time_ms(forward_ms, backward_ms, send_forward_ms, send_backward_ms, allreduce_ms,
                      num_microbatches: int, schedule: str = "1f1b",
                      virtual_stages: int = 1, engine: bool = False, calls=None) -> float:
    """Fast path: the longest-path length only (no per-op arrays, no critical path).
    ``engine``: as megatron-core executes the schedule (``_core.EngineDAG``: blocking, bundled
    p2p calls; differs from the paper's DAG for interleaved-1f1b only). ``calls`` (with
    ``engine``): megatron's per-op and per-call costs ``(op forward, op backward, send call,
    receive ready)`` ms charged on 1f1b and interleaved-1f1b (``callcosts.py``)."""
    x = normalize_inputs(forward_ms, backward_ms, send_forward_ms, send_backward_ms,
                         allreduce_ms, num_microbatches, schedule, virtual_stages)
    return float(_dag_for(x, engine, calls).time_ms(x.forward_ms, x.backward_ms, x.send_forward_ms,
                                     x.send_backward_ms, x.allreduce_ms))


def simulate_pipeline(forward_ms, backward_ms, send_forward_ms, send_backward_ms, allreduce_ms,
                      num_microbatches: int, schedule: str = "1f1b",
                      virtual_stages: int = 1) -> Timeline:
    """Full simulation as a ``Timeline`` labelled "predicted": per-op times (stage-major, each
    stage in execution order), per-stage all-reduce window, one critical path (ties broken
    towards the cross-stage dependency) and its ops marked; ``iteration_time_ms`` is the
    longest path."""
    x = normalize_inputs(forward_ms, backward_ms, send_forward_ms, send_backward_ms,
                         allreduce_ms, num_microbatches, schedule, virtual_stages)
    dag = _dag_for(x)
    t, start, finish, via_dep, ar0, ar1 = dag.simulate(
        x.forward_ms, x.backward_ms, x.send_forward_ms, x.send_backward_ms, x.allreduce_ms)
    path, on_path = _critical_path(dag, via_dep, ar1)
    perm = dag.stage_major
    return Timeline(
        iteration_time_ms=float(t),
        op_stage=dag.op_stage[perm], op_chunk=dag.op_chunk[perm],
        op_microbatch=dag.op_microbatch[perm], op_is_backward=dag.op_is_backward[perm],
        op_start_ms=start[perm], op_finish_ms=finish[perm], op_on_critical_path=on_path[perm],
        allreduce_start_ms=ar0, allreduce_finish_ms=ar1, critical_path=path, label="predicted")


def _critical_path(dag, via_dep: np.ndarray, ar_finish: np.ndarray) -> tuple[tuple, np.ndarray]:
    """(node labels from start to end, per op in the DAG's order: on that path)."""
    prev, dep = dag.predecessor_slots()
    s_end = int(np.argmax(ar_finish))
    labels = [("end",), ("R", s_end)]
    slot = int(dag.last_op_slots()[s_end])
    stage, chunk = dag.op_stage, dag.op_chunk
    mb, bw = dag.op_microbatch, dag.op_is_backward
    on_path = np.zeros(len(stage), dtype=bool)
    while slot:
        i = slot - 1
        on_path[i] = True
        labels.append(("B" if bw[i] else "F", int(stage[i]), int(chunk[i]), int(mb[i])))
        slot = int(dep[i]) if via_dep[i] else int(prev[i])
    labels.append(("start",))
    return tuple(reversed(labels)), on_path


def static_estimate_ms(forward_ms, backward_ms, send_forward_ms, send_backward_ms, allreduce_ms,
                       num_microbatches: int) -> float:
    """Eq. (1) of the paper (Metis and others): sum t_s + (M-1) max t_s + DP all-reduce.

    Non-interleaved inputs (send arrays of length N-1). Choices:

    - t_s = F[s] + B[s] + the sends stage s *issues*: its activation send ``Pf[s]`` to s+1
      (s < N-1) and its gradient send ``Pb[s-1]`` to s-1 (s > 0). Communication is thus
      serialised with the stage's compute, which is what Eq. (1) assumes (it cannot overlap).
    - DP all-reduce = max_s R[s]: the stages' all-reduces run at the same time on disjoint
      data-parallel groups, and the iteration waits for the slowest (the Metis-style choice).
    """
    x = normalize_inputs(forward_ms, backward_ms, send_forward_ms, send_backward_ms,
                         allreduce_ms, num_microbatches, "1f1b", 1)
    t = x.forward_ms + x.backward_ms
    t[:-1] += x.send_forward_ms
    t[1:] += x.send_backward_ms
    return float(t.sum() + (x.num_microbatches - 1) * t.max() + x.allreduce_ms.max())
