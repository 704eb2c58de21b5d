"""Engine-aware timing model: the pipeline as megatron-core 0.19 actually runs it.

The paper's DAG (``pipeline.py``) lets an op start as soon as its own input has arrived and its
device is free; a send costs only the link time and never holds the sender. megatron-core's
schedules (without ``overlap_p2p_comm``, the default) run each device as a sequence of compute
ops and *blocking communication calls*; one call posts the sends of what was just computed and
waits for the inputs of what comes next, in pairs. This model replays exactly that sequence:

* ``1f1b`` (``forward_backward_pipelining_without_interleaving``): warm-up
  ``recv_forward, F, send_forward``; steady state ``F, send_forward_recv_backward, B,
  send_backward_recv_forward`` (the last one a bare ``send_backward``); cool-down
  ``recv_backward, B, send_backward``.
* ``interleaved-1f1b`` (``forward_backward_pipelining_with_interleaving``): the first input is
  received up front; warm-up ``F, send_forward_recv_forward`` (receiving the *next* forward's
  input), the last warm-up call ``send_forward_backward_recv_forward_backward``; steady state
  ``F, B, send_forward_backward_recv_forward_backward`` -- the forward's activation leaves only
  after the backward has run, and the next forward waits for the next backward's gradient too;
  cool-down ``B, send_backward_recv_backward``.

Timing of one call on device s posted at time t: every tensor it sends arrives at
``t + link_ms`` (the one-way latency of the link); a call that only sends returns at
``t + send_call_ms[s]``; a call that receives returns ``recv_ready_ms[s]`` after
``max(t, arrival of everything it receives)`` (and not before ``t + send_call_ms[s]`` if it also
sends). The three are measured with megatron-core's own ``P2PCommunicator`` (see
``fidelity.harness._p2p_costs``). A compute op costs
its profiled time plus ``op_overhead_ms`` (megatron's ``forward_step`` / ``backward_step`` around
the model). After the last op: the finalize hook (DP all-reduce) ``finalize_ms[s]``, then the
optimizer step, whose grad-norm all-reduce spans the model-parallel group -- every stage waits for
the slowest -- followed by the stage's update; the iteration ends when the last stage is done.
With zero call and op overheads, a zero-time sync and only the data dependencies kept, this is
the paper's DAG for ``1f1b``; the difference for interleaved is structural (bundled calls).

API::

    costs = EngineCosts.from_profiles(fwd, bwd, send, finalize, optimizer, overheads)
    res = simulate_engine(costs, num_microbatches, schedule, virtual_stages)
    res.iteration_time_ms        # res is a ``timeline.Timeline`` (no critical path)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..errors import PoseidonError
from .schedules import Op, interleaved_table, stage_op_order, validate_schedule
from .timeline import Timeline


@dataclass(frozen=True)
class EngineCosts:
    forward_ms: np.ndarray        # (V, N) per chunk and device
    backward_ms: np.ndarray       # (V, N)
    link_ms: np.ndarray           # (L,): link s -> s+1 (and N-1 -> 0 for interleaved), both ways
    finalize_ms: np.ndarray       # (N,)
    optimizer_ms: np.ndarray      # (N,) (grad-norm all-reduce + update, measured after a barrier)
    send_call_ms: np.ndarray      # (N,) a blocking call that only sends
    recv_ready_ms: np.ndarray     # (N,) a receive whose data is there: returns this long after
    fwd_overhead_ms: np.ndarray   # (N,) megatron's forward_step around the model
    bwd_overhead_ms: np.ndarray   # (N,)

    @classmethod
    def from_profiles(cls, fwd, bwd, send, finalize, optimizer,
                      overheads: Sequence[dict] | None = None) -> "EngineCosts":
        fwd = np.atleast_2d(np.asarray(fwd, dtype=float))
        bwd = np.atleast_2d(np.asarray(bwd, dtype=float))
        n = fwd.shape[1]
        ov = list(overheads or [{}] * n)
        get = (lambda k: np.array([float(o.get(k, 0.0)) for o in ov]))
        link = np.asarray(send, dtype=float)
        if all("latency_ms" in o for o in ov) and ov:
            link = np.full(link.shape, float(np.median(get("latency_ms"))))
        return cls(fwd, bwd, link, np.asarray(finalize, dtype=float),
                   np.asarray(optimizer, dtype=float), get("send_call_ms"), get("recv_ready_ms"),
                   get("forward_ms"), get("backward_ms"))


# A device program: a list of items, each ("op", Op) or ("call", sends, recvs) where sends and
# recvs are message keys (kind, chunk, microbatch, device_from, device_to).


def _fwd_dest(n: int, v: int, s: int, c: int) -> tuple[int, int] | None:
    """(device, chunk) receiving the activation of F(chunk c) on device s; None = pipeline end."""
    if s < n - 1:
        return s + 1, c
    return (0, c + 1) if c + 1 < v else None


def _bwd_dest(n: int, v: int, s: int, c: int) -> tuple[int, int] | None:
    if s > 0:
        return s - 1, c
    return (n - 1, c - 1) if c > 0 else None


def _send_of(n: int, v: int, s: int, op: Op):
    dest = (_bwd_dest if op.is_backward else _fwd_dest)(n, v, s, op.chunk)
    if dest is None:
        return None
    return ("B" if op.is_backward else "F", dest[1], op.microbatch, s, dest[0])


def _recv_of(n: int, v: int, s: int, op: Op):
    """The message op needs before it can run (None for the pipeline's first F / last B)."""
    if op.is_backward:
        if s < n - 1:
            return ("B", op.chunk, op.microbatch, s + 1, s)
        return ("B", op.chunk, op.microbatch, 0, s) if op.chunk + 1 < v else None
    if s > 0:
        return ("F", op.chunk, op.microbatch, s - 1, s)
    return ("F", op.chunk, op.microbatch, n - 1, s) if op.chunk > 0 else None


def device_program(schedule: str, n: int, m: int, s: int, v: int = 1,
                   unbundled: bool = False) -> list[tuple]:
    """The op / blocking-call sequence megatron-core runs on device ``s``. ``unbundled``: for
    the schedules megatron-core does not run (eager-1f1b, gpipe), the same op order with one
    blocking receive before each op that takes its input from another device and one blocking
    send after each op whose output goes to one (what the search charges them with when
    per-call costs are measured, so every schedule pays for its calls)."""
    ops = stage_op_order(schedule, n, m, s, v)   # this device's only (not every device's)
    snd = (lambda op: [k for k in [_send_of(n, v, s, op)] if k is not None])
    rcv = (lambda op: [k for k in [_recv_of(n, v, s, op)] if k is not None])
    if unbundled:
        prog: list[tuple] = []
        for op in ops:
            prog += [("call", [], rcv(op)), ("op", op), ("call", snd(op), [])]
    elif schedule in ("1f1b", "gpipe", "eager-1f1b") or v == 1:
        if schedule != "1f1b" and not (schedule == "interleaved-1f1b" and v == 1):
            raise PoseidonError(f"engine model: schedule {schedule!r} is not run by megatron-core")
        prog = _one_chunk_program(ops, n, m, s, snd, rcv)
    else:
        prog = _interleaved_program(n, m, s, v, snd, rcv)
    return [p for p in prog if p[0] == "op" or p[1] or p[2]]


def _one_chunk_program(ops, n: int, m: int, s: int, snd, rcv) -> list[tuple]:
    """megatron-core's 1F1B on device ``s``: warm-up forwards, the steady one-forward-one-
    backward pairs (send and receive bundled in one call), the cool-down backwards."""
    prog: list[tuple] = []
    w = min(n - 1 - s, m)
    r = m - w
    fw = [o for o in ops if not o.is_backward]
    bw = [o for o in ops if o.is_backward]
    for i in range(w):
        prog += [("call", [], rcv(fw[i])), ("op", fw[i]), ("call", snd(fw[i]), [])]
    if r > 0:
        prog.append(("call", [], rcv(fw[w])))
    for i in range(r):
        prog += [("op", fw[w + i]), ("call", snd(fw[w + i]), rcv(bw[i])), ("op", bw[i])]
        nxt = rcv(fw[w + i + 1]) if i < r - 1 else []
        prog.append(("call", snd(bw[i]), nxt))
    for i in range(r, m):
        prog += [("call", [], rcv(bw[i])), ("op", bw[i]), ("call", snd(bw[i]), [])]
    return prog


def _interleaved_program(n: int, m: int, s: int, v: int, snd, rcv) -> list[tuple]:
    """megatron-core's interleaved 1F1B on device ``s``: virtual micro-batch k runs
    F(table[k]) and B(reversed chunk)."""
    prog: list[tuple] = []
    total = m * v
    table = interleaved_table(m, v, n)
    w = min(total, 2 * (n - 1 - s) + (v - 1) * n)
    F = [Op(False, c, mb) for mb, c in table]
    B = [Op(True, v - 1 - c, mb) for mb, c in table]
    all_warm = w == total

    def recv_f(k: int) -> list:
        """What the call after forward k receives (megatron's recv_tensor_from_previous_stage):
        the next forward's input, or on the first device the output the last device made
        N-1 virtual micro-batches earlier (it runs that far behind)."""
        if s > 0:
            return rcv(F[k + 1]) if k + 1 < total else []
        j = k - (n - 1)
        if j < 0 or table[j][1] == v - 1:
            return []
        return [("F", table[j][1] + 1, table[j][0], n - 1, 0)]

    def recv_b(k: int) -> list:
        if s < n - 1:
            return rcv(B[k + 1]) if k + 1 < total else []
        j = k - (n - 1)
        bc = v - 1 - table[j][1] if j >= 0 else 0
        if j < 0 or bc == 0:
            return []
        return [("B", bc - 1, table[j][0], 0, n - 1)]

    prog.append(("call", [], rcv(F[0])))
    for k in range(w):
        prog.append(("op", F[k]))
        nxt = recv_f(k) if k != total - 1 else []
        if k == w - 1 and not all_warm:
            prog.append(("call", snd(F[k]), nxt + rcv(B[0])))
        else:
            prog.append(("call", snd(F[k]), nxt))
    r = total - w
    for k in range(r):
        f, b = F[w + k], B[k]
        prog += [("op", f), ("op", b)]
        nf = recv_f(w + k) if k != r - 1 else []
        prog.append(("call", snd(f) + snd(b), nf + recv_b(k)))
    if all_warm:
        prog.append(("call", [], rcv(B[0])))
    for k in range(r, total):
        prog.append(("op", B[k]))
        nb = recv_b(k) if k != total - 1 else []
        prog.append(("call", snd(B[k]), nb))
    return prog


def link_index(msg, n: int) -> int:
    """The link a message travels: s -> s+1 (activation) or s+1 -> s (gradient) is link s,
    the wrap-around N-1 <-> 0 of the interleaved schedule is link N-1."""
    kind, _, _, a, b = msg
    lo = a if kind == "F" else b           # F: a -> b is link a; B: b <- a is link b
    if (kind == "F" and a == n - 1 and b == 0) or (kind == "B" and a == 0 and b == n - 1):
        lo = n - 1
    return lo


def walk_programs(progs: list[list[tuple]]):
    """The device programs' items in one order in which every received message was posted
    before: yields ("post", s, msg) when device s reaches a call (its sends leave then, even
    if the call must wait for its receives) and ("run", s, item) when an op or a call
    completes. Raises PoseidonError if the programs deadlock."""
    n = len(progs)
    pos = [0] * n
    posted = [-1] * n
    sent: set = set()
    remaining = sum(len(p) for p in progs)
    while remaining:
        progressed = False
        for s in range(n):
            prog = progs[s]
            while pos[s] < len(prog):
                item = prog[pos[s]]
                if item[0] == "call":
                    _, sends, recvs = item
                    if posted[s] != pos[s]:        # sends go out first, then the call waits
                        posted[s] = pos[s]
                        for msg in sends:
                            sent.add(msg)
                            yield "post", s, msg
                    if any(r not in sent for r in recvs):
                        break
                yield "run", s, item
                pos[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise PoseidonError("engine model: the device programs deadlock (a bug)")


def simulate_engine(costs: EngineCosts, num_microbatches: int, schedule: str = "1f1b",
                    virtual_stages: int = 1) -> Timeline:
    """Replay the device programs; a ``Timeline`` labelled "predicted (engine-aware)" whose
    ``iteration_time_ms`` is the end of the slowest stage's optimizer step (no critical path:
    every ``op_on_critical_path`` is False)."""
    n = costs.forward_ms.shape[1]
    n, m, v = validate_schedule(schedule, n, num_microbatches, virtual_stages)
    if costs.forward_ms.shape != (v, n):
        raise PoseidonError(f"engine model: forward_ms has shape {costs.forward_ms.shape}, "
                            f"expected ({v}, {n})")
    unbundled = schedule not in ("1f1b", "interleaved-1f1b")   # not run by megatron-core
    progs = [device_program(schedule, n, m, s, v, unbundled) for s in range(n)]

    def link(msg) -> float:
        lo = link_index(msg, n)
        return float(costs.link_ms[lo]) if lo < len(costs.link_ms) else 0.0

    arrival: dict[tuple, float] = {}
    now = [0.0] * n
    rows: list[tuple] = []
    for event, s, x in walk_programs(progs):
        if event == "post":
            arrival[x] = now[s] + link(x)
        elif x[0] == "op":
            op = x[1]
            base = (costs.backward_ms if op.is_backward else costs.forward_ms)[op.chunk, s]
            extra = (costs.bwd_overhead_ms if op.is_backward else costs.fwd_overhead_ms)[s]
            t0 = now[s]
            now[s] = t0 + float(base) + float(extra)
            rows.append((s, op.chunk, op.microbatch, op.is_backward, t0, now[s]))
        else:
            _, sends, recvs = x
            t = now[s]
            done = t + float(costs.send_call_ms[s]) if sends else t
            if recvs:
                ready = max([t] + [arrival[r] for r in recvs])
                done = max(done, ready + float(costs.recv_ready_ms[s]))
            now[s] = done
    ar0 = np.array(now)
    ar1 = ar0 + costs.finalize_ms
    sync = float(ar1.max())
    end = sync + costs.optimizer_ms
    arr = np.array(rows, dtype=float)
    order = np.lexsort((np.arange(len(arr)), arr[:, 0]))   # stage-major, execution order
    arr = arr[order]
    return Timeline(
        iteration_time_ms=float(end.max()), op_stage=arr[:, 0].astype(np.int64),
        op_chunk=arr[:, 1].astype(np.int64), op_microbatch=arr[:, 2].astype(np.int64),
        op_is_backward=arr[:, 3].astype(bool), op_start_ms=arr[:, 4], op_finish_ms=arr[:, 5],
        op_on_critical_path=np.zeros(len(arr), dtype=bool), allreduce_start_ms=ar0,
        allreduce_finish_ms=ar1, label="predicted (engine-aware)")
