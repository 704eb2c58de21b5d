"""Host contention under CPU emulation: how much the ranks of one host slow each other's compute.

The profiler times every rank's layer in turns (one TP group of a host at a time, every core
free), but the ranks train together. Their compute then shares the host's cores and runs slower
by a factor the fixed rule ``ranks x threads / cores`` (:func:`.profiler.host_share`, 2 for 4
single-thread ranks on 2 cores) overstates: a slow emulated type sleeps through most of its
layer time (the emulation pads with ``sleep``), pipeline bubbles and collectives leave cores idle,
and other processes on the host take their share too.

:func:`measure_contention` measures it instead. Every rank of every host runs its own layer's
forward + backward for the same short window (``CONTENTION_SECONDS``), all at once, each one
followed by the sleep its emulated type would pad it with, so the host carries the load training
puts on it; each step's wall time over its CPU time is how much longer the compute took than on
a free core. :func:`host_shares` turns the per-rank means into one factor per host (the median
of its ranks, at least 1): the ``share`` of :class:`.profiler.EmulatedClock`, which multiplies
the compute part of every emulated time (not the padding: a sleeping process needs no core).

Torch-free; the step is passed in (``profiler.profile_rank`` builds it from the user's layer).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Mapping

CONTENTION_SECONDS = 1.5   # every rank of a host runs its layer for this long, all at once
MIN_STEPS = 3              # steps of a rank whose step is longer than the window
MAX_STEPS = 400


@dataclass(frozen=True)
class ContentionSample:
    """One rank's concurrent run: mean wall / CPU ratio of its steps (x threads), steps run."""

    ratio: float
    steps: int


def measure_contention(step: Callable[[], tuple[float, float]], factor: float, *,
                       threads: int = 1, seconds: float = CONTENTION_SECONDS,
                       min_steps: int = MIN_STEPS, max_steps: int = MAX_STEPS,
                       clock: Callable[[], float] = time.perf_counter,
                       sleep: Callable[[float], None] = time.sleep) -> ContentionSample:
    """Run ``step()`` -> (wall s, CPU s) of one forward + backward, each followed by the
    emulated type's padding sleep ``(factor - 1) x CPU s``, for ``seconds`` (at least
    ``min_steps`` steps, at most ``max_steps``); ratio = threads x sum(wall) / sum(CPU).

    The caller starts every rank of the host at once (a barrier) so they contend as in training.
    A first untimed step warms the layer up."""
    step()
    walls: list[float] = []
    cpus: list[float] = []
    end = clock() + seconds
    while len(walls) < min_steps or (clock() < end and len(walls) < max_steps):
        wall, cpu = step()
        walls.append(max(0.0, wall))
        cpus.append(max(0.0, cpu))
        pad = (factor - 1.0) * cpu
        if pad > 0.0:
            sleep(pad)
    total_cpu = sum(cpus)
    ratio = max(1, threads) * sum(walls) / total_cpu if total_cpu > 0.0 else 1.0
    return ContentionSample(ratio, len(walls))


def host_shares(ratios: Mapping[int, float], host_of: Mapping[int, str]) -> dict[int, float]:
    """Per rank: the median measured ratio of the ranks on its host, at least 1 (every type of a
    host gets the same factor, so noise between ranks does not move the plan's choices)."""
    by_host: dict[str, list[float]] = {}
    for rank, ratio in ratios.items():
        by_host.setdefault(host_of[rank], []).append(float(ratio))
    med = {h: max(1.0, statistics.median(xs)) for h, xs in by_host.items()}
    return {rank: med[host_of[rank]] for rank in ratios}


def timed_compute(run: Callable[[], None], wall: Callable[[], float] = time.perf_counter,
                  cpu: Callable[[], float] = time.process_time) -> tuple[float, float]:
    """(wall s, CPU s) of ``run()``."""
    t0, c0 = wall(), cpu()
    run()
    return wall() - t0, cpu() - c0
