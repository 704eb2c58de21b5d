"""The search's incumbent: the best plan found so far, as the driver, the runner-up and the
distributed search's merge compare them."""

from __future__ import annotations

from dataclasses import dataclass, field

from .configs import OuterConfig


@dataclass(frozen=True, order=True)
class Incumbent:
    """The best plan so far, ordered by (time, configuration key, options, layers)."""

    time_ms: float
    key: tuple
    opts: tuple[int, ...]
    layers: tuple[int, ...]
    cfg: OuterConfig = field(compare=False)
    origin: str = field(default="search", compare=False)   # what found it (SearchStats.plan_origin)
