"""One progress display for a whole search: phase, elapsed time, incumbent, proven bound, gap.

On a terminal it is one status line on stderr, rewritten in place (at most ``TTY_INTERVAL_S``
apart) and cleared at the end; elsewhere (a log file, CI) the same figures are logged as lines
through the ``poseidon`` logger at INFO level, at most ``LOG_INTERVAL_S`` apart and whenever the
incumbent improves, so ``poseidon -v plan ... 2> log`` records how the search converged. The
numbers come from a snapshot callable that is only called when a line is due (the bound is a
minimum over every configuration).
"""

from __future__ import annotations

import logging
import math
import sys
import time
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger("poseidon")

TTY_INTERVAL_S = 0.1
LOG_INTERVAL_S = 2.0


@dataclass(frozen=True)
class Snapshot:
    """What the display shows at one moment."""

    phase: str
    incumbent_ms: float | None      # best plan so far (None: none yet)
    bound_ms: float | None          # no plan of the stated space is faster (None: unknown)
    configs_done: int
    configs_total: int
    nodes: int

    @property
    def gap(self) -> float | None:
        if self.incumbent_ms is None or self.bound_ms is None or self.incumbent_ms <= 0:
            return None
        return max(0.0, (self.incumbent_ms - self.bound_ms) / self.incumbent_ms)


def _ms(x: float | None) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:.2f} ms"


def _count(n: int) -> str:
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if n >= div:
            return f"{n / div:.1f}{suffix}"
    return str(n)


def format_snapshot(s: Snapshot, elapsed_s: float) -> str:
    gap = "-" if s.gap is None else f"{100 * s.gap:.2f}%"
    return (f"search {elapsed_s:6.1f} s  {s.phase:<18}  best {_ms(s.incumbent_ms)}  "
            f"bound {_ms(s.bound_ms)}  gap {gap}  configs {s.configs_done}/{s.configs_total}  "
            f"nodes {_count(s.nodes)}")


class SearchProgress:
    """``mode``: ``off``, ``tty`` (one rewritten line on ``stream``) or ``log`` (INFO lines)."""

    def __init__(self, mode: str = "off", stream=None, clock: Callable[[], float] | None = None
                 ) -> None:
        if mode not in ("off", "tty", "log"):
            raise ValueError(f"progress mode {mode!r}")
        self.mode = mode
        self.stream = stream if stream is not None else sys.stderr
        self.clock = clock or time.monotonic
        self.t0 = self.clock()
        self._last = -math.inf
        self._last_best: float | None = None
        self._width = 0
        self.lines = 0          # lines written or logged (for the tests)

    @classmethod
    def for_options(cls, options, stream=None) -> "SearchProgress":
        if not options.progress:
            return cls("off")
        stream = stream if stream is not None else sys.stderr
        isatty = getattr(stream, "isatty", None)
        return cls("tty" if isatty is not None and isatty() else "log", stream)

    @property
    def interval_s(self) -> float:
        return TTY_INTERVAL_S if self.mode == "tty" else LOG_INTERVAL_S

    def tick(self, snapshot: Callable[[], Snapshot], *, improved: bool = False) -> None:
        """Show ``snapshot()`` if a line is due (always when ``improved`` in log mode)."""
        if self.mode == "off":
            return
        now = self.clock()
        if now - self._last < self.interval_s and not (improved and self.mode == "log"):
            return
        s = snapshot()
        if self.mode == "log" and improved and s.incumbent_ms == self._last_best \
                and now - self._last < self.interval_s:
            return
        self._last, self._last_best = now, s.incumbent_ms
        self._show(format_snapshot(s, now - self.t0))

    def _show(self, line: str) -> None:
        self.lines += 1
        if self.mode == "tty":
            pad = max(0, self._width - len(line))
            self.stream.write("\r" + line + " " * pad)
            self.stream.flush()
            self._width = len(line)
        else:
            log.info("%s", line)

    def close(self, snapshot: Snapshot | None = None) -> None:
        """Clear the status line (tty) or log the final figures (log)."""
        if self.mode == "tty" and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()
            self._width = 0
        elif self.mode == "log" and snapshot is not None:
            self._show(format_snapshot(snapshot, self.clock() - self.t0) + "  (done)")
