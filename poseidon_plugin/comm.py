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


__all__ = ["send_ms", "allreduce_ms"]
