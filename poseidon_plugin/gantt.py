"""Draw pipeline timelines as Gantt charts (PNG or SVG, chosen by the file suffix).

One row per stage; forward and backward boxes labelled by micro-batch; idle time is the white
space between boxes; ops on the critical path get a red outline. Given two timelines (predicted
and measured) they are drawn one above the other on a shared time axis.
"""

from __future__ import annotations

import os
from typing import Sequence

from poseidon_plugin.errors import PoseidonError
from poseidon_plugin.simulator.timeline import Timeline

_FORWARD = ("#9ecae1", "#4292c6", "#c6dbef", "#2171b5")   # one shade per chunk
_BACKWARD = ("#fdae6b", "#e6550d", "#fdd0a2", "#a63603")
_ALLREDUCE = "#bdbdbd"
_CRITICAL = "#d62728"


def draw_gantt(timelines: Sequence[Timeline], path: str, title: str = "") -> str:
    """Write the chart to ``path`` (.png or .svg) and return the path."""
    ext = os.path.splitext(path)[1].lower()
    if ext not in (".png", ".svg"):
        raise PoseidonError(f"{path}: Gantt output must end in .png or .svg")
    if not timelines:
        raise PoseidonError("draw_gantt: no timeline to draw")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:  # pragma: no cover - matplotlib is in the default set-up
        raise PoseidonError("drawing a Gantt chart needs matplotlib: pip install matplotlib") from None

    span = max(t.span_ms for t in timelines) or 1.0
    rows = [t.num_stages for t in timelines]
    width_in = 14.0
    height_in = sum(0.32 * n + 0.9 for n in rows) + 0.6
    fig, axes = plt.subplots(len(timelines), 1, figsize=(width_in, height_in), sharex=True,
                             squeeze=False, gridspec_kw={"height_ratios": [max(n, 1) for n in rows]})
    px_per_ms = (width_in * 0.85 * fig.dpi) / span
    for ax, tl in zip(axes[:, 0], timelines):
        _draw_one(ax, tl, px_per_ms)
    axes[-1, 0].set_xlabel("time (ms)")
    axes[-1, 0].set_xlim(0, span * 1.01)
    chunks = max((int(t.op_chunk.max()) + 1 if len(t.op_chunk) else 1) for t in timelines)
    if chunks > 1:   # one shade per model chunk (interleaved schedules)
        handles = [Patch(facecolor=_FORWARD[c % 4], label=f"F chunk {c}") for c in range(chunks)]
        handles += [Patch(facecolor=_BACKWARD[c % 4], label=f"B chunk {c}") for c in range(chunks)]
    else:
        handles = [Patch(facecolor=_FORWARD[0], label="forward"),
                   Patch(facecolor=_BACKWARD[0], label="backward")]
    handles += [
               Patch(facecolor=_ALLREDUCE, label="DP all-reduce"),
               Patch(facecolor="white", edgecolor=_CRITICAL, linewidth=1.5, label="critical path")]
    top = 1.0 - 0.55 / height_in      # title line, then the legend line, then the axes
    fig.legend(handles=handles, loc="upper right", ncol=min(len(handles), 6), fontsize=8,
               frameon=False, bbox_to_anchor=(0.995, 1.0 - 0.25 / height_in))
    if title:
        fig.suptitle(title, x=0.01, y=0.998, ha="left", va="top", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, top))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _draw_one(ax, tl: Timeline, px_per_ms: float) -> None:
    n = tl.num_stages
    for i in range(len(tl.op_stage)):
        s = int(tl.op_stage[i])
        t0 = float(tl.op_start_ms[i])
        dur = float(tl.op_finish_ms[i]) - t0
        chunk = int(tl.op_chunk[i])
        backward = bool(tl.op_is_backward[i])
        colour = (_BACKWARD if backward else _FORWARD)[chunk % 4]
        crit = bool(tl.op_on_critical_path[i])
        ax.barh(s, dur, left=t0, height=0.8, color=colour,
                edgecolor=_CRITICAL if crit else "white", linewidth=1.4 if crit else 0.4)
        if dur * px_per_ms >= 11:  # label only boxes wide enough to read
            ax.text(t0 + dur / 2, s, str(int(tl.op_microbatch[i])), ha="center", va="center",
                    fontsize=6 if n > 8 else 7)
    for s in range(len(tl.allreduce_start_ms)):
        t0 = float(tl.allreduce_start_ms[s])
        dur = float(tl.allreduce_finish_ms[s]) - t0
        if dur > 0:
            ax.barh(s, dur, left=t0, height=0.8, color=_ALLREDUCE, hatch="//", edgecolor="white")
    ax.set_yticks(range(n))
    ax.set_yticklabels([f"stage {s}" for s in range(n)], fontsize=7 if n > 8 else 8)
    ax.set_ylim(n - 0.5, -0.5)
    label = tl.label or "timeline"
    ax.set_title(f"{label}: {tl.span_ms:.2f} ms", fontsize=9, loc="left")
    ax.grid(axis="x", linestyle=":", linewidth=0.5)
