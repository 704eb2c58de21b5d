"""Per-p2p-call costs measured at profiling time (``poseidon profile`` under torchrun), stored
as the profile DB's ``p2p_calls`` records (``callcosts.py``); the search charges them.

Between two ranks of the default group (``a`` sends, ``b`` receives), with the blocking form
megatron-core's ``P2PCommunicator`` uses by default (``batch_p2p_comm``: the ops posted with
``torch.distributed.batch_isend_irecv``, then waited on), for one activation-sized message
(``numel`` elements of ``dtype``), medians over ``reps`` after one warm-up:

- ``send_call_ms``: a send whose receiver has long posted its receive;
- ``recv_ready_ms``: a receive posted after the data was sent (no waiting for it);
- ``latency_ms``: half a send-then-receive round trip minus ``recv_ready_ms`` (>= 0).

Every rank of the group calls :func:`measure_p2p_call` (it holds barriers); ranks other than
``a`` and ``b`` only pass them. Not measured here yet: the per-op overheads (megatron's
``forward_step`` / ``backward_step`` around the model; ``poseidon validate --profile-db``
stores those of the CPU emulation).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

PAUSE_S = 0.004   # long enough for the other side to be waiting / the data to have arrived


def _call(ops) -> None:
    import torch.distributed as dist

    for req in dist.batch_isend_irecv(ops):
        req.wait()


def _sync(device) -> None:
    if getattr(device, "type", "cpu") == "cuda":
        import torch

        torch.cuda.synchronize(device)


def measure_p2p_call(a: int, b: int, numel: int, *, device: Any = None, dtype: Any = None,
                     reps: int = 8) -> tuple[float, float, float] | None:
    """(send_call_ms, recv_ready_ms, latency_ms) on rank ``a`` (None on every other rank)."""
    import torch
    import torch.distributed as dist

    me = dist.get_rank()
    dtype = dtype or torch.float32
    x = torch.zeros(max(int(numel), 1), dtype=dtype, device=device)
    y = torch.empty_like(x)
    send_to_b = [dist.P2POp(dist.isend, x, b)]
    recv_from_a = [dist.P2POp(dist.irecv, y, a)]
    send_to_a = [dist.P2POp(dist.isend, y, a)]
    recv_from_b = [dist.P2POp(dist.irecv, x, b)]
    sc, rr, rt = [], [], []
    for _ in range(reps + 1):
        dist.barrier()
        if me == a:                              # 1. send into a posted receive
            time.sleep(PAUSE_S)
            t0 = time.perf_counter()
            _call(send_to_b)
            _sync(device)
            sc.append(time.perf_counter() - t0)
        elif me == b:
            _call(recv_from_a)
        dist.barrier()
        if me == b:                              # 2. receive of data already sent (b times it)
            time.sleep(PAUSE_S)
            t0 = time.perf_counter()
            _call(recv_from_a)
            _sync(device)
            rr.append(time.perf_counter() - t0)
        elif me == a:
            _call(send_to_b)
        dist.barrier()
        if me == a:                              # 3. round trip
            t0 = time.perf_counter()
            _call(send_to_b)
            _call(recv_from_b)
            _sync(device)
            rt.append((time.perf_counter() - t0) / 2)
        elif me == b:
            _call(recv_from_a)
            _call(send_to_a)
    # b's receive-ready times to a
    got = torch.tensor([statistics.median(rr[1:]) if rr else 0.0], dtype=torch.float64)
    dist.broadcast(got, src=b)
    if me != a:
        return None
    ready = float(got) * 1e3
    return (statistics.median(sc[1:]) * 1e3, ready,
            max(0.0, statistics.median(rt[1:]) * 1e3 - ready))


def p2p_call_records(device_type: str, link: str, message_bytes: dict[int, int], *,
                     a: int = 0, b: int = 1, device: Any = None, reps: int = 8) -> list:
    """``callcosts.P2PCall`` records of ``device_type`` over ``link`` for each message size
    (``{bytes: numel of bf16}``; measured in bf16 on a device, fp32 on the CPU: the bytes are
    the key either way), on rank ``a``; [] on the other ranks."""
    import torch
    import torch.distributed as dist

    from ..callcosts import P2PCall

    on_cpu = getattr(device, "type", "cpu") == "cpu"
    out = []
    for nbytes in sorted(message_bytes):
        numel = nbytes // 4 if on_cpu else message_bytes[nbytes]
        got = measure_p2p_call(a, b, numel, device=device,
                               dtype=torch.float32 if on_cpu else torch.bfloat16, reps=reps)
        if got is not None:
            out.append(P2PCall(device_type, link, int(nbytes), *got))
    dist.barrier()
    return out


__all__ = ["measure_p2p_call", "p2p_call_records"]
