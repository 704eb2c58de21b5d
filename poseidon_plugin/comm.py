"""Communication cost formulas: one definition each, shared by every Python caller.

Units: bytes, Gbit/s (10**9 bits per second), milliseconds. ``num_bytes * 8.0 / (gbps * 1e6)``
is the wire time in ms (bits / (Gbit/s) = 1e-9 s per bit -> 1e-6 ms per bit per Gbit/s).

Zero bytes: nothing is sent, so nothing is paid -- ``num_bytes <= 0`` costs 0 ms in both formulas
(no latency either). A single rank likewise: ``ranks <= 1`` all-reduces in 0 ms.

The plan search's Cython loop (``search/_search.pyx``: ``_send_ms``, ``_allreduce_ms``) repeats
these formulas with the same floating-point arithmetic, term for term, so that the costs it
searches on and the costs ``costs.CostModel`` reports for the chosen plan are the same doubles;
change them together (``tests/test_costs.py`` pins the values).
"""

from __future__ import annotations

import math


def send_ms(num_bytes: float, gbps: float, latency_ms: float) -> float:
    """Point-to-point send of ``num_bytes`` over a ``gbps`` link with a per-message latency.

    ``num_bytes * 8.0 / (gbps * 1e6) + latency_ms``; 0 ms for ``num_bytes <= 0``.
    """
    if num_bytes <= 0:
        return 0.0
    return num_bytes * 8.0 / (gbps * 1e6) + latency_ms


def allreduce_ms(num_bytes: float, ranks: int, gbps: float, latency_ms: float) -> float:
    """Ring all-reduce of ``num_bytes`` over ``ranks`` ranks whose slowest link is ``gbps``.

    2(d-1) steps, each a latency and 1/d of the bytes:
    ``2(d-1) * latency_ms + 2(d-1)/d * num_bytes * 8.0 / (gbps * 1e6)`` with d = ``ranks``;
    0 ms for ``ranks <= 1`` or ``num_bytes <= 0``.
    """
    if ranks <= 1 or num_bytes <= 0:
        return 0.0
    return (2.0 * (ranks - 1) * latency_ms
            + 2.0 * (ranks - 1) / ranks * num_bytes * 8.0 / (gbps * 1e6))


def reduce_scatter_ms(num_bytes: float, ranks: int, gbps: float, latency_ms: float) -> float:
    """Ring reduce-scatter of ``num_bytes`` (each rank ends with 1/d of the sum); a ring
    all-gather of ``num_bytes`` costs the same.

    d-1 steps, each a latency and 1/d of the bytes:
    ``(d-1) * latency_ms + (d-1)/d * num_bytes * 8.0 / (gbps * 1e6)`` with d = ``ranks``;
    0 ms for ``ranks <= 1`` or ``num_bytes <= 0``.
    """
    if ranks <= 1 or num_bytes <= 0:
        return 0.0
    return ((ranks - 1) * latency_ms
            + (ranks - 1) / ranks * num_bytes * 8.0 / (gbps * 1e6))


DDP_BUCKET_PARAMS = 40_000_000   # megatron-core's default bucket: max(4e7, 1e6 x dp) params
MAX_BUCKETS = 1 << 30            # a count the search's C int holds (more changes nothing)


def ddp_buckets(params: float, ranks: int, bucket_params: float = 0.0) -> int:
    """How many buckets megatron-core's DDP splits ``params`` parameters into under
    ``--overlap-grad-reduce``: ``bucket_params`` each (``--ddp-bucket-size``), or when 0 its
    default max(4e7, 1e6 x dp)."""
    if params <= 0:
        return 1
    size = bucket_params if bucket_params > 0 else max(float(DDP_BUCKET_PARAMS), 1e6 * ranks)
    return min(MAX_BUCKETS, max(1, math.ceil(params / size)))


def exposed_ms(comm_ms: float, window_ms: float, buckets: int) -> float:
    """What remains of ``comm_ms`` after the compute it overlaps: ``buckets`` equal buckets
    ready one by one over ``window_ms`` (the i-th at i/k of it) and sent one after another on
    one stream; the last ends ``max(comm/k, comm - window (k-1)/k)`` after the window (one
    bucket, or no window: nothing overlaps)."""
    if buckets <= 1 or window_ms <= 0.0:
        return comm_ms
    return max(comm_ms / buckets, comm_ms - window_ms * (buckets - 1) / buckets)


def dp_sync_ms(grad_bytes: float, param_bytes: float, ranks: int, gbps: float,
               latency_ms: float, sharded: bool, buckets: int = 1,
               grad_window_ms: float = 0.0, param_window_ms: float = 0.0) -> float:
    """A stage's data-parallel synchronisation per iteration (Megatron's DDP), the part the
    iteration waits for.

    Without the distributed optimizer: the gradients' ring all-reduce
    (``allreduce_ms(grad_bytes)``). With it (``sharded``): the gradients' reduce-scatter
    before each rank updates its 1/d shard, then the updated parameters' all-gather
    (``reduce_scatter_ms(grad_bytes) + reduce_scatter_ms(param_bytes)``): the same ring
    steps, but the second half moves parameters, not gradients (2 bytes each for a bf16
    model against 4 for fp32 gradients).

    Overlap (``--overlap-grad-reduce`` / ``--overlap-param-gather``): the gradients' sync in
    ``buckets`` during the last micro-batch's backward (``grad_window_ms``), the parameters'
    all-gather during the next iteration's first forward (``param_window_ms``), each reduced
    to ``exposed_ms``; a window of 0 overlaps nothing.
    """
    if not sharded:
        return exposed_ms(allreduce_ms(grad_bytes, ranks, gbps, latency_ms), grad_window_ms,
                          buckets)
    return (exposed_ms(reduce_scatter_ms(grad_bytes, ranks, gbps, latency_ms), grad_window_ms,
                       buckets)
            + exposed_ms(reduce_scatter_ms(param_bytes, ranks, gbps, latency_ms),
                         param_window_ms, buckets))


def expert_alltoall_bytes(micro_batch_size: int, seq_length: int, hidden_size: int,
                          top_k: int, tp: int, ep: int, bytes_per_value: int = 2) -> float:
    """Bytes one rank sends in one token all-to-all of a MoE layer (dispatch or combine) over
    its expert-parallel group of ``ep`` ranks, balanced routing.

    A rank holds b * s / t tokens (Megatron runs MoE with TP > 1 only under sequence
    parallelism, so the tokens are split over the t TP ranks before the dispatch; the TP
    all-gather after it is in the layer's EP-1 record), each sent to ``top_k`` experts, spread
    evenly over the EP group: (ep - 1) / ep of the copies leave the rank.
    ``b * s / t * top_k * hidden * bytes * (ep - 1) / ep``; 0 for ep <= 1."""
    if ep <= 1:
        return 0.0
    return (float(micro_batch_size) * seq_length / tp * top_k * hidden_size * bytes_per_value
            * (ep - 1) / ep)


def alltoall_ms(num_bytes: float, gbps: float, latency_ms: float) -> float:
    """One all-to-all in which each rank sends ``num_bytes`` in all: the bytes over the group's
    slowest link plus one latency per call (``send_ms``'s formula); 0 ms for no bytes."""
    return send_ms(num_bytes, gbps, latency_ms)


def expert_sync_ms(grad_bytes: float, param_bytes: float, dp: int, ep: int, gbps: float,
                   latency_ms: float, sharded: bool) -> float:
    """The routed experts' gradient synchronisation of a stage's device (EP > 1): Megatron
    keeps the experts' gradients in their own buffers, reduced over the expert-data-parallel
    group of dp / ep ranks (same ring formulas as ``dp_sync_ms``; not overlapped); 0 ms when
    that group is one rank."""
    ranks = dp // ep
    if ranks <= 1:
        return 0.0
    return dp_sync_ms(grad_bytes, param_bytes, ranks, gbps, latency_ms, sharded)


def expert_optimizer_ms(grad_bytes: float, ms_per_grad_byte: float, dp: int, ep: int,
                        sharded: bool) -> float:
    """The optimizer step of a device's routed-expert parameters (``grad_bytes`` of them):
    with the distributed optimizer the state is sharded over the expert-DP group (dp / ep
    ranks): ``grad_bytes * ms * ep / dp``; without it ``grad_bytes * ms``."""
    return grad_bytes * ms_per_grad_byte * ep / dp if sharded else grad_bytes * ms_per_grad_byte


__all__ = ["send_ms", "expert_alltoall_bytes", "alltoall_ms", "expert_sync_ms",
           "expert_optimizer_ms", "allreduce_ms", "reduce_scatter_ms", "dp_sync_ms", "ddp_buckets",
           "exposed_ms", "DDP_BUCKET_PARAMS"]
