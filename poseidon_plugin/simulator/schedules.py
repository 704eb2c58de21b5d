"""Per-stage op orders of the pipeline schedules the simulator models (pure Python).

One pipeline has ``num_stages`` devices (N), ``num_microbatches`` micro-batches (M) and, for
``interleaved-1f1b``, ``virtual_stages`` model chunks per device (V). A schedule is, for every
device, the fixed order in which it runs its forward (F) and backward (B) ops. The simulator
(``_core``), its pure-Python reference and the tests all take the orders from here.

Orders (0-based device s; w = warm-up forwards, capped at M):

- ``gpipe``: all F in micro-batch order, then all B in micro-batch order.
- ``1f1b`` (megatron-core's non-interleaved schedule): w = N-1-s; then M-w times
  (F(w+k), B(k)); then the remaining w backwards.
- ``eager-1f1b`` (the paper's appendix): w = 2(N-1-s)+1; then M-w times (B(k), F(w+k)); then
  the remaining backwards.
- ``interleaved-1f1b`` (megatron-core 0.19's ``forward_backward_pipelining_with_interleaving``
  with the default ``microbatch_group_size_per_vp_stage`` G = N): the M*V "virtual
  micro-batches" are numbered by a table that walks micro-batches in groups of G: for each group,
  chunk 0 for the group's micro-batches, then chunk 1, ..., then chunk V-1 (the last group takes
  every remaining micro-batch). Virtual micro-batch k runs forward on (chunk[k], mb[k]) and
  backward on (V-1-chunk[k], mb[k]). Device s runs w = min(M*V, 2(N-1-s) + (V-1)G) warm-up
  forwards, then M*V-w times (F(w+k), B(k)), then the remaining w backwards.
  megatron-core rejects G > M and a last group of size 0 < M mod G < N; with G = N that means
  M must be a multiple of N. With V = 1 megatron runs its non-interleaved schedule, so
  ``interleaved-1f1b`` with V = 1 is ``1f1b``. Virtual pipelining needs N >= 2.

The DAG edges that link these ops across devices are documented in ``pipeline.py`` and ``_core.pyx``.
"""

from __future__ import annotations

import operator
from typing import NamedTuple

from poseidon_plugin.errors import PoseidonError

SCHEDULES: tuple[str, ...] = ("1f1b", "eager-1f1b", "interleaved-1f1b", "gpipe")
"""Every schedule the simulator and the search know: the one list of schedule names. Its order
is the search's tie-break between plans of equal time (earlier wins)."""
LAUNCHABLE_SCHEDULES: tuple[str, ...] = ("1f1b", "interleaved-1f1b")
"""The schedules megatron-core 0.19 executes (eager-1f1b and gpipe give analysis-only plans)."""


class Op(NamedTuple):
    """One compute op of one device: forward or backward of (chunk, micro-batch)."""

    is_backward: bool
    chunk: int
    microbatch: int


def _check_int(name: str, value: object, minimum: int) -> int:
    """``value`` as an int >= minimum (Python or numpy integers; not bool, not float)."""
    try:
        if isinstance(value, bool):
            raise TypeError
        result = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise PoseidonError(f"{name}: expected an integer >= {minimum}, got {value!r}") from None
    if result < minimum:
        raise PoseidonError(f"{name}: expected an integer >= {minimum}, got {result}")
    return result


def validate_schedule(schedule: str, num_stages: int, num_microbatches: int,
                      virtual_stages: int = 1,
                      microbatch_group_size: int | None = None) -> tuple[int, int, int]:
    """Check a (schedule, N, M, V) request; return (N, M, V) as ints or raise PoseidonError."""
    if schedule not in SCHEDULES:
        raise PoseidonError(f"schedule: expected one of {', '.join(SCHEDULES)}, got {schedule!r}")
    n = _check_int("num_stages", num_stages, 1)
    m = _check_int("num_microbatches", num_microbatches, 1)
    v = _check_int("virtual_stages", virtual_stages, 1)
    if schedule != "interleaved-1f1b":
        if v != 1:
            raise PoseidonError(
                f"virtual_stages: schedule {schedule!r} has one model chunk per device, "
                f"expected 1, got {v} (use 'interleaved-1f1b' for V > 1)")
        return n, m, v
    if v == 1:
        return n, m, v
    if n < 2:
        raise PoseidonError(
            "num_stages: interleaved-1f1b with virtual_stages > 1 needs a pipeline of at least "
            f"2 stages (megatron-core runs no virtual pipeline without one), got {n}")
    g = n if microbatch_group_size is None else _check_int("microbatch_group_size",
                                                           microbatch_group_size, 1)
    if g < n or g > m:
        raise PoseidonError(
            f"num_microbatches: megatron-core's interleaved schedule needs the micro-batch group "
            f"size ({g}) within [N={n}, M={m}], i.e. M >= {g}; got M={m}")
    rem = m % g
    if 0 < rem < n:
        raise PoseidonError(
            f"num_microbatches: megatron-core's interleaved schedule needs M mod {g} to be 0 or "
            f">= N={n} (here: M a multiple of {n}); got M={m} (remainder {rem})")
    return n, m, v


def interleaved_table(num_microbatches: int, virtual_stages: int,
                      microbatch_group_size: int) -> list[tuple[int, int]]:
    """(microbatch, chunk) of every virtual micro-batch index, in megatron-core's order."""
    table: list[tuple[int, int]] = []
    m, g = num_microbatches, microbatch_group_size
    for first in range(0, m, g):
        last = m if first + g >= m else first + g
        table.extend((mb, c) for c in range(virtual_stages) for mb in range(first, last))
    return table


def _one_f_one_b(m: int, warmup: int, eager: bool) -> list[Op]:
    w = min(warmup, m)
    ops = [Op(False, 0, k) for k in range(w)]
    for k in range(m - w):
        pair = (Op(True, 0, k), Op(False, 0, w + k)) if eager else (Op(False, 0, w + k),
                                                                    Op(True, 0, k))
        ops.extend(pair)
    ops.extend(Op(True, 0, k) for k in range(m - w, m))
    return ops


def _interleaved(n: int, m: int, v: int, s: int, g: int) -> list[Op]:
    table = interleaved_table(m, v, g)
    total = m * v
    w = min(total, 2 * (n - 1 - s) + (v - 1) * g)

    def fwd(k: int) -> Op:
        mb, c = table[k]
        return Op(False, c, mb)

    def bwd(k: int) -> Op:
        mb, c = table[k]
        return Op(True, v - 1 - c, mb)

    ops = [fwd(k) for k in range(w)]
    for k in range(total - w):
        ops.append(fwd(w + k))
        ops.append(bwd(k))
    ops.extend(bwd(k) for k in range(total - w, total))
    return ops


def stage_op_order(schedule: str, num_stages: int, num_microbatches: int, stage: int,
                   virtual_stages: int = 1,
                   microbatch_group_size: int | None = None) -> list[Op]:
    """The ops device ``stage`` runs, in execution order (2*M*V ops)."""
    n, m, v = validate_schedule(schedule, num_stages, num_microbatches, virtual_stages,
                                microbatch_group_size)
    s = _check_int("stage", stage, 0)
    if s >= n:
        raise PoseidonError(f"stage: expected 0 <= stage < {n}, got {s}")
    if schedule == "gpipe":
        return [Op(False, 0, k) for k in range(m)] + [Op(True, 0, k) for k in range(m)]
    if schedule == "1f1b" or (schedule == "interleaved-1f1b" and v == 1):
        return _one_f_one_b(m, n - 1 - s, eager=False)
    if schedule == "eager-1f1b":
        return _one_f_one_b(m, 2 * (n - 1 - s) + 1, eager=True)
    g = n if microbatch_group_size is None else microbatch_group_size
    return _interleaved(n, m, v, s, g)


def op_orders(schedule: str, num_stages: int, num_microbatches: int, virtual_stages: int = 1,
              microbatch_group_size: int | None = None) -> list[list[Op]]:
    """``stage_op_order`` for every device, index = device."""
    return [stage_op_order(schedule, num_stages, num_microbatches, s, virtual_stages,
                           microbatch_group_size) for s in range(num_stages)]
