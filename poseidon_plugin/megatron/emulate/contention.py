"""Host contention under CPU emulation: how much the ranks of one host slow each other's compute.

The profiler times every rank's layer in turns (one TP group of a host at a time, every core
free), but the ranks train together. Their compute then shares the host's cores and runs slower
by a factor the fixed rule ``ranks x threads / cores`` (:func:`.profiler.host_share`, 2 for 4
single-thread ranks on 2 cores) overstates: a slow emulated type sleeps through most of its
layer time (the emulation pads with ``sleep``), pipeline bubbles and collectives leave cores idle,
and other processes on the host take their share too.

It is measured instead, with the rank's own layer (forward + backward):

* :func:`measure_alone` -- the ranks of a host in turns, each on a free host
  (``ALONE_SECONDS``): the step's median wall time;
* :func:`measure_contention` -- every rank of every host at once for the same window
  (``CONTENTION_SECONDS``), each step followed by the sleep its emulated type would pad it
  with, so the host carries the load training puts on it: the step's median wall time over the
  alone one is how much longer the compute takes when the ranks share the host -- waiting for a
  core, and the caches and memory bandwidth the others take (a CPU-time ratio would miss those).

The median, not the mean: on the 2-core reference host a slow-type rank's steps took 6 ms at
the median (4.3 ms alone) but now and then one took 60-700 ms (a rank that woke from its
padding sleep onto busy cores and waited), one to three such steps in a 1-s window of 10-40, so
the window's mean jumped between 1.3x and 26x from one window to the next. Six identical dry
runs then read the slow type at x1.24-x3.93 (one launch x14.5) and chose three different plans;
with the median, x1.43-x2.21 and the same plan six times. Training meets those stalls too: what
they cost an iteration is in the live calibration (the per-iteration overhead and the stages'
measured compute), not in the profile.

:func:`host_shares` turns the per-rank ratios into one factor per host and device type (the
median of those ranks, at least 1): the ``share`` of :class:`.profiler.EmulatedClock`, which
multiplies the compute part of every emulated time (not the padding: a sleeping process needs
no core). Per type, because the types are slowed differently: a slow type's compute starts
when it wakes from its padding sleep, onto cores the busy ranks hold (measured here: about 2.4x
for the slow type against 1.0-2.3x for the fast one, 4 ranks on 2 cores).

Torch-free; the step is passed in (``profiler.profile_rank`` builds it from the user's layer).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

CONTENTION_SECONDS = 1.5   # every rank of a host runs its layer for this long, all at once
ALONE_SECONDS = 0.3        # each rank alone on the host, in turns
MIN_STEPS = 3              # steps of a rank whose step is longer than the window
MAX_STEPS = 400


@dataclass(frozen=True)
class ContentionSample:
    """One rank's concurrent run: its mean step wall time over the alone one, steps run."""

    ratio: float
    steps: int


def _steps(step: Callable[[], tuple[float, float]], seconds: float, min_steps: int,
           max_steps: int, clock: Callable[[], float],
           after: Callable[[float], None] = lambda cpu: None) -> list[float]:
    """Wall times of ``step()`` repeated for ``seconds`` (at least ``min_steps``, at most
    ``max_steps``) after one untimed warm-up step; ``after(cpu s)`` follows each step."""
    step()
    walls: list[float] = []
    end = clock() + seconds
    while len(walls) < min_steps or (clock() < end and len(walls) < max_steps):
        wall, cpu = step()
        walls.append(max(0.0, wall))
        after(max(0.0, cpu))
    return walls


def measure_alone(step: Callable[[], tuple[float, float]], *, seconds: float = ALONE_SECONDS,
                  min_steps: int = MIN_STEPS, max_steps: int = MAX_STEPS,
                  clock: Callable[[], float] = time.perf_counter) -> float:
    """Median wall seconds of ``step()`` (one forward + backward -> (wall s, CPU s)) on a free
    host (the caller runs the ranks of a host in turns)."""
    return statistics.median(_steps(step, seconds, min_steps, max_steps, clock))


def measure_contention(step: Callable[[], tuple[float, float]], factor: float, alone_s: float,
                       *, seconds: float = CONTENTION_SECONDS, min_steps: int = MIN_STEPS,
                       max_steps: int = MAX_STEPS,
                       clock: Callable[[], float] = time.perf_counter,
                       sleep: Callable[[float], None] = time.sleep) -> ContentionSample:
    """Run ``step()`` for ``seconds``, each step followed by the emulated type's padding sleep
    ``(factor - 1) x`` its CPU time (as training pads it); ratio = the median wall time of the
    steps over ``alone_s`` (:func:`measure_alone`'s), at least 1.

    The caller starts every rank of the host at once (a barrier) so they contend as in training."""
    def pad(cpu: float) -> None:
        if (factor - 1.0) * cpu > 0.0:
            sleep((factor - 1.0) * cpu)

    walls = _steps(step, seconds, min_steps, max_steps, clock, pad)
    ratio = statistics.median(walls) / alone_s if alone_s > 0.0 else 1.0
    return ContentionSample(max(1.0, ratio), len(walls))


def host_shares(ratios: Mapping[int, float], host_of: Mapping[int, str],
                type_of: Mapping[int, str] | None = None) -> dict[int, float]:
    """Per rank: the median measured ratio of the ranks of its host and device type
    (``type_of``; None: of its host), at least 1."""
    group = {r: (host_of[r], type_of[r] if type_of is not None else "") for r in ratios}
    by_group: dict[tuple[str, str], list[float]] = {}
    for rank, ratio in ratios.items():
        by_group.setdefault(group[rank], []).append(float(ratio))
    med = {g: max(1.0, statistics.median(xs)) for g, xs in by_group.items()}
    return {rank: med[group[rank]] for rank in ratios}


def timed_compute(run: Callable[[], None], wall: Callable[[], float] = time.perf_counter,
                  cpu: Callable[[], float] = time.process_time) -> tuple[float, float]:
    """(wall s, CPU s) of ``run()``."""
    t0, c0 = wall(), cpu()
    run()
    return wall() - t0, cpu() - c0


SPEED_TOLERANCE = 0.10
SPEED_ATTEMPTS = 3    # profiling runs at most this often while an emulated type is off by more
                      # than SPEED_TOLERANCE; the attempt that missed least is kept
"""The emulation's promise, checked after profiling: each emulated type's measured TP-1 times
over the fastest type's within 10 % of what its speed and the host shares make them."""


@dataclass(frozen=True)
class SpeedCheck:
    """One emulated type's measured slowdown against the fastest emulated type's (TP 1, the
    smallest micro-batch): ``forward`` and ``backward`` measured, ``expected`` from the speeds
    and the host shares (:class:`.profiler.EmulatedClock`: (share + 1/speed - 1) x CPU time),
    ``configured`` the speed ratio alone (free cores, share 1)."""

    device_type: str
    reference: str
    forward: float
    backward: float
    expected: float
    configured: float

    @property
    def ok(self) -> bool:
        return all(abs(r / self.expected - 1.0) <= SPEED_TOLERANCE
                   for r in (self.forward, self.backward))

    def describe(self) -> str:
        return (f"{self.device_type} forward x{self.forward:.2f}, backward x{self.backward:.2f} "
                f"of {self.reference}'s; expected x{self.expected:.2f} (x{self.configured:.2f} "
                f"configured, with the host shares)")


def speed_error(checks: Sequence[SpeedCheck]) -> float:
    """The largest relative miss of any check's forward or backward ratio (0 with none)."""
    return max((abs(r / c.expected - 1.0) for c in checks for r in (c.forward, c.backward)),
               default=0.0)


def emulated_speed_checks(aggs, speeds: Mapping[str, float], shares: Mapping[str, float]
                          ) -> list[SpeedCheck]:
    """A :class:`SpeedCheck` per emulated type but the fastest, from the profiled aggregates
    (``profiler.Aggregate``: one per type, TP and micro-batch) at TP 1 and the smallest
    micro-batch they share; none without TP 1 or a second type. Of a model of several layer
    kinds, the first kind's (by name) aggregates: every kind runs at the same emulated speed."""
    tp1 = {}
    kind = min((getattr(a, "kind", "") for a in aggs), default="")
    for a in aggs:
        if a.tp == 1 and a.device_type in speeds and getattr(a, "kind", "") == kind:
            tp1.setdefault(a.device_type, {})[a.micro_batch_size] = a
    common = set.intersection(*(set(v) for v in tp1.values())) if len(tp1) > 1 else set()
    if not common:
        return []
    mbs = min(common)
    ref = max(tp1, key=lambda t: (speeds[t], t))

    def unit(t: str) -> float:   # emulated time per CPU second of the same work
        return shares.get(t, 1.0) + 1.0 / speeds[t] - 1.0

    r = tp1[ref][mbs]
    return [SpeedCheck(t, ref, tp1[t][mbs].forward_ms / r.forward_ms,
                       tp1[t][mbs].backward_ms / r.backward_ms, unit(t) / unit(ref),
                       speeds[ref] / speeds[t])
            for t in sorted(tp1) if t != ref]
