"""Stable timing of a repeated measurement (torch-free; the profiler's sampling rule).

:func:`sample` calls ``measure()`` (one forward + backward of the profiled layer, say) after
``warmup`` untimed calls, until

* at least ``min_reps`` samples are in, and the 95% confidence interval of the median of every
  timed quantity (after outlier rejection) is within ``rel_ci`` of that median (half-width), or
* ``max_reps`` samples are in, or ``max_seconds`` have passed on ``clock`` (the result then says
  ``converged=False``).

Outliers: a sample whose modified z-score ``0.6745 |x - median| / MAD`` exceeds ``mad_cutoff``
(Iglewicz and Hoaglin's rule) is dropped before the median is taken; a quantity with MAD 0 keeps
every sample. The median's interval is distribution-free: order statistics ``x_(j)`` and
``x_(k)`` with ``j, k = n/2 -/+ 1.96 sqrt(n)/2`` (the normal approximation of the binomial).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence

Z95 = 1.96
MAD_SCALE = 0.6745


@dataclass(frozen=True)
class SamplingPolicy:
    warmup: int = 3
    min_reps: int = 8
    max_reps: int = 40
    max_seconds: float = 5.0
    rel_ci: float = 0.02
    mad_cutoff: float = 3.5


@dataclass(frozen=True)
class Sampled:
    """Medians of each timed quantity, after outlier rejection."""

    medians: tuple[float, ...]
    samples: int
    rejected: tuple[int, ...]        # outliers dropped, per quantity
    rel_half_width: tuple[float, ...]  # the median's 95% CI half-width / median, per quantity
    converged: bool


def reject_outliers(xs: Sequence[float], cutoff: float = 3.5) -> list[float]:
    """``xs`` without the samples whose modified z-score exceeds ``cutoff``."""
    if len(xs) < 3:
        return list(xs)
    med = statistics.median(xs)
    mad = statistics.median(abs(x - med) for x in xs)
    if mad <= 0.0:
        return list(xs)
    return [x for x in xs if MAD_SCALE * abs(x - med) / mad <= cutoff]


def median_ci(xs: Sequence[float]) -> tuple[float, float] | None:
    """Distribution-free 95% confidence interval of the median; None below 6 samples."""
    n = len(xs)
    if n < 6:
        return None
    s = sorted(xs)
    half = Z95 * math.sqrt(n) / 2.0
    j = max(1, math.floor(n / 2.0 - half))
    k = min(n, math.ceil(1 + n / 2.0 + half))
    return s[j - 1], s[k - 1]


def rel_half_width(xs: Sequence[float]) -> float:
    """Half the median's 95% CI width over the median (inf when undefined)."""
    ci = median_ci(xs)
    med = statistics.median(xs) if xs else 0.0
    if ci is None or med <= 0.0:
        return math.inf
    return (ci[1] - ci[0]) / 2.0 / med


def summarize(columns: Sequence[Sequence[float]], policy: SamplingPolicy) -> Sampled:
    kept = [reject_outliers(c, policy.mad_cutoff) for c in columns]
    widths = tuple(rel_half_width(k) for k in kept)
    n = len(columns[0]) if columns else 0
    return Sampled(medians=tuple(statistics.median(k) for k in kept), samples=n,
                   rejected=tuple(len(c) - len(k) for c, k in zip(columns, kept)),
                   rel_half_width=widths,
                   converged=n >= policy.min_reps and all(w <= policy.rel_ci for w in widths))


def sample(measure: Callable[[], Sequence[float]], policy: SamplingPolicy = SamplingPolicy(),
           clock: Callable[[], float] = time.monotonic,
           agree: Callable[[bool], bool] | None = None) -> Sampled:
    """Repeat ``measure()`` (it returns one value per timed quantity) under ``policy``.

    ``agree(stop)``: when ``measure`` is collective (a tensor-parallel layer), every rank of the
    group must run it equally often: the ranks stop together, as soon as one of them would
    (``agree`` returns whether any rank wants to stop)."""
    for _ in range(policy.warmup):
        measure()
    t0 = clock()
    columns: list[list[float]] = []
    while True:
        values = measure()
        if not columns:
            columns = [[] for _ in values]
        for col, v in zip(columns, values):
            col.append(float(v))
        n = len(columns[0])
        if n >= policy.min_reps:
            result = summarize(columns, policy)
            stop = result.converged or n >= policy.max_reps or clock() - t0 >= policy.max_seconds
            if agree is not None:
                stop = agree(stop)
            if stop:
                return result


@dataclass(frozen=True)
class Settled:
    """What :func:`settle` ran: ``readings`` untimed calls; ``agreed``: the last two agreed
    within the band (False: stopped by the count or time bound, or by another rank)."""

    readings: int
    agreed: bool
    last: tuple[float, ...]


def settle(measure: Callable[[], Sequence[float]], band: float, max_readings: int,
           max_seconds: float, clock: Callable[[], float] = time.monotonic,
           agree: Callable[[bool], bool] | None = None) -> Settled:
    """A device warm-up: call ``measure()`` (its readings are discarded) until two consecutive
    readings agree within ``band`` (``|a - b| <= band x max(a, b)`` for every quantity), or
    ``max_readings`` calls, or ``max_seconds`` on ``clock`` since the first call started (at
    least two calls unless ``max_readings`` is below 2). ``agree`` as in :func:`sample`: the
    ranks of a group stop together."""
    t0 = clock()
    prev: tuple[float, ...] | None = None
    n = 0
    while True:
        cur = tuple(float(v) for v in measure())
        n += 1
        ok = prev is not None and all(abs(a - b) <= band * max(abs(a), abs(b))
                                      for a, b in zip(prev, cur))
        stop = ok or n >= max_readings or clock() - t0 >= max_seconds
        if agree is not None:
            stop = agree(stop)
        if stop:
            return Settled(n, ok, cur)
        prev = cur
