"""Draw pipeline timelines as Gantt charts (PNG or SVG, chosen by the file suffix).

One row per stage, labelled ``stage s`` (plus what ``stage_labels`` says, e.g. device type, TP
and layers: ``plan_stage_labels``); forward and backward boxes, labelled by micro-batch where
the label fits; idle time is the grey band behind the boxes and each row's idle share is written
at its right end; the ops of one critical path (``Timeline.critical_chain``: read off the op
times, so measured timelines get one too) are outlined in red. Given several timelines
(measured and predicted) they are drawn one above the other on a shared time axis.

Speed: the boxes of one colour are one compound path (one SVG element, not one per op), the
layout is computed in inches (no ``tight_layout``) and the Agg backend draws; micro-batch
labels are drawn only where they fit and at most ``MAX_LABELS`` of them.
"""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np

from poseidon_plugin.errors import PoseidonError
from poseidon_plugin.safeio import atomic_output
from poseidon_plugin.simulator.timeline import Timeline

_FORWARD = ("#9ecae1", "#4292c6", "#c6dbef", "#2171b5")   # one shade per chunk
_BACKWARD = ("#fdae6b", "#e6550d", "#fdd0a2", "#a63603")
_ALLREDUCE = "#bdbdbd"
_CRITICAL = "#d62728"
_IDLE = "#ececec"

MAX_LABELS = 600      # micro-batch labels per timeline (text is the slow part of a drawing)
_WIDTH_IN = 14.0
_DPI = 110
_ROW_IN = 0.26        # height of one stage row
_HEADER_LINE_IN = 0.3  # the title and the legend: one line, or two where they do not fit
_AXES_TITLE_IN = 0.3  # caption above each timeline
_BOTTOM_IN = 0.5      # time axis ticks and label
_RIGHT_IN = 0.75      # the "idle %" column


def plan_stage_labels(plan) -> list[str]:
    """Per stage of a ``Plan``: "<device type> · tp<T> · <L> layers"."""
    return [f"{s.device_type} · tp{s.tp} · {s.layers} layer{'s' if s.layers != 1 else ''}"
            for s in plan.stages]


def draw_gantt(timelines: Sequence[Timeline], path: str, title: str = "",
               stage_labels: Sequence[str] | None = None) -> str:
    """Write the chart to ``path`` (.png or .svg) and return the path. ``stage_labels``: one
    string per stage, appended to each row's ``stage s``."""
    ext = os.path.splitext(path)[1].lower()
    if ext not in (".png", ".svg"):
        raise PoseidonError(f"{path}: Gantt output must end in .png or .svg")
    if not timelines:
        raise PoseidonError("draw_gantt: no timeline to draw")
    plt = _pyplot()
    names = [_row_names(t.num_stages, stage_labels) for t in timelines]
    entries = _legend_entries(timelines)
    one_line = not title or (len(title) * 10 + sum(len(e[0]) * 8 + 40 for e in entries)) \
        * 0.55 / 72 < _WIDTH_IN - 0.4
    fig, axes = _layout(plt, timelines, max(len(x) for rows in names for x in rows),
                        _HEADER_LINE_IN * (1 if one_line else 2))
    if title:
        fig.text(0.01, 1 - 0.08 / fig.get_figheight(), title, ha="left", va="top", fontsize=10)
    _legend(fig, entries, 0.08 if one_line else 0.08 + _HEADER_LINE_IN)
    span = max(t.span_ms for t in timelines) or 1.0
    for ax, tl, rows in zip(axes, timelines, names):
        ax.set_xlim(0, span * 1.005)
        _draw_one(ax, tl, rows, span)
    axes[-1].set_xlabel("time (ms)", fontsize=8)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    try:
        with atomic_output(path) as tmp, plt.rc_context({"svg.fonttype": "none"}):
            # SVG text as text, not glyph paths; written atomically (temporary file, replace)
            fig.savefig(tmp, dpi=_DPI, format=ext[1:], **({"pil_kwargs": {"compress_level": 2}}
                                                          if ext == ".png" else {}))
    finally:
        plt.close(fig)
    return path


def _pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - matplotlib is in the default set-up
        raise PoseidonError("drawing a Gantt chart needs matplotlib: pip install matplotlib") from None
    return plt


def _row_names(n: int, stage_labels: Sequence[str] | None) -> list[str]:
    if stage_labels is not None and len(stage_labels) != n:
        raise PoseidonError(f"draw_gantt: {len(stage_labels)} stage labels for {n} stages")
    return [f"stage {s}" + (f" · {stage_labels[s]}" if stage_labels is not None else "")
            for s in range(n)] or [""]


def _row_in(stages: int) -> float:
    """Row height: _ROW_IN from 6 stages on (height proportional to the stages), taller rows
    for shallow pipelines so their boxes stay readable."""
    return max(_ROW_IN, min(0.42, 1.6 / max(stages, 1)))


def _layout(plt, timelines: Sequence[Timeline], label_chars: int, header_in: float):
    """Figure and one axes per timeline, placed in inches: the height follows the stages."""
    rows = [max(t.num_stages, 1) for t in timelines]
    row_in = _row_in(max(rows))
    height = header_in + sum(_AXES_TITLE_IN + row_in * n for n in rows) + _BOTTOM_IN
    left = 0.25 + label_chars * 7 * 0.55 / 72        # the row labels at 7 pt
    fig = plt.figure(figsize=(_WIDTH_IN, height), dpi=_DPI)
    axes, top = [], height - header_in
    for n in rows:
        top -= _AXES_TITLE_IN + row_in * n
        rect = (left / _WIDTH_IN, top / height, (_WIDTH_IN - left - _RIGHT_IN) / _WIDTH_IN,
                row_in * n / height)
        axes.append(fig.add_axes(rect, sharex=axes[0] if axes else None))
    for ax in axes[:-1]:
        ax.tick_params(labelbottom=False)
    return fig, axes


def _legend_entries(timelines: Sequence[Timeline]) -> list[tuple[str, dict]]:
    """(label, patch style) of every legend entry."""
    chunks = max((int(t.op_chunk.max()) + 1 if len(t.op_chunk) else 1) for t in timelines)
    if chunks > 1:   # one shade per model chunk (interleaved schedules)
        entries = [(f"F chunk {c}", {"facecolor": _FORWARD[c % 4]}) for c in range(chunks)]
        entries += [(f"B chunk {c}", {"facecolor": _BACKWARD[c % 4]}) for c in range(chunks)]
    else:
        entries = [("forward", {"facecolor": _FORWARD[0]}),
                   ("backward", {"facecolor": _BACKWARD[0]})]
    return entries + [
        ("DP all-reduce", {"facecolor": _ALLREDUCE, "hatch": "//", "edgecolor": "white"}),
        ("idle", {"facecolor": _IDLE}),
        ("critical path", {"facecolor": "white", "edgecolor": _CRITICAL, "linewidth": 1.5})]


def _legend(fig, entries: list[tuple[str, dict]], from_top_in: float) -> None:
    from matplotlib.patches import Patch

    handles = [Patch(label=label, **style) for label, style in entries]
    fig.legend(handles=handles, loc="upper right", ncol=len(handles), fontsize=8,
               frameon=False, bbox_to_anchor=(0.995, 1 - from_top_in / fig.get_figheight()),
               borderaxespad=0, handlelength=1.6)


def _boxes(t0: np.ndarray, t1: np.ndarray, rows: np.ndarray, h: float = 0.8) -> np.ndarray:
    """Rectangles as (k, 4, 2) vertices, row r spanning r - h/2 .. r + h/2."""
    lo, hi = rows - h / 2, rows + h / 2
    return np.stack([np.stack([t0, lo], 1), np.stack([t1, lo], 1),
                     np.stack([t1, hi], 1), np.stack([t0, hi], 1)], 1)


def _compound(ax, verts: np.ndarray, **style) -> None:
    """All of ``verts``'s rectangles as one patch (one path: cheap to draw and to write)."""
    from matplotlib.patches import PathPatch
    from matplotlib.path import Path

    if len(verts):   # add_artist: add_patch would walk every vertex in Python for the limits
        ax.add_artist(PathPatch(Path.make_compound_path_from_polys(verts), **style))


def _draw_one(ax, tl: Timeline, names: list[str], span: float) -> None:
    n = max(tl.num_stages, 1)
    _compound(ax, _boxes(np.zeros(n), np.full(n, tl.span_ms), np.arange(n, dtype=float), 0.9),
              facecolor=_IDLE, edgecolor="none", zorder=0)
    chunk = tl.op_chunk % 4
    boxes = _boxes(tl.op_start_ms, tl.op_finish_ms, tl.op_stage.astype(float))
    # white separators between boxes wide enough for them (thin boxes would turn pale)
    edge = "white" if np.median(_box_px(ax, tl, span)) >= 4 else "none"
    for backward, palette in ((False, _FORWARD), (True, _BACKWARD)):
        for c, colour in enumerate(palette):
            pick = (tl.op_is_backward == backward) & (chunk == c)
            _compound(ax, boxes[pick], facecolor=colour, edgecolor=edge, linewidth=0.3,
                      zorder=1)
    _draw_allreduce(ax, tl)
    _draw_critical(ax, tl)
    _label_microbatches(ax, tl, span, n)
    _idle_column(ax, tl, n)
    ax.set_yticks(range(n))
    ax.set_yticklabels(names, fontsize=7)
    ax.tick_params(axis="both", labelsize=7, length=2)
    ax.set_ylim(n - 0.5, -0.5)
    label = tl.label or "timeline"
    ax.set_title(f"{label}: {tl.span_ms:.2f} ms", fontsize=8, loc="left", pad=3)
    ax.grid(axis="x", linestyle=":", linewidth=0.5)
    ax.set_axisbelow(True)


def _draw_allreduce(ax, tl: Timeline) -> None:
    if not len(tl.allreduce_start_ms):
        return
    keep = tl.allreduce_finish_ms > tl.allreduce_start_ms
    rows = np.flatnonzero(keep).astype(float)
    _compound(ax, _boxes(tl.allreduce_start_ms[keep], tl.allreduce_finish_ms[keep], rows),
              facecolor=_ALLREDUCE, edgecolor="white", hatch="//", linewidth=0.3, zorder=1)


def _draw_critical(ax, tl: Timeline) -> None:
    """Red outlines on the critical chain's ops, and on the all-reduce it ends in."""
    chain = tl.critical_chain()
    if not len(chain):
        return
    t0, t1 = tl.op_start_ms[chain], tl.op_finish_ms[chain]
    rows = tl.op_stage[chain].astype(float)
    last = int(tl.op_stage[chain[-1]])
    if len(tl.allreduce_finish_ms) and tl.allreduce_finish_ms[last] > tl.allreduce_start_ms[last]:
        t0 = np.append(t0, tl.allreduce_start_ms[last])
        t1 = np.append(t1, tl.allreduce_finish_ms[last])
        rows = np.append(rows, float(last))
    _compound(ax, _boxes(t0, t1, rows), facecolor="none", edgecolor=_CRITICAL, linewidth=1.1,
              zorder=2)


def _box_px(ax, tl: Timeline, span: float) -> np.ndarray:
    """Per op: its box's width in pixels."""
    width_px = ax.get_position().width * _WIDTH_IN * _DPI
    return (tl.op_finish_ms - tl.op_start_ms) * width_px / (span * 1.005)


def _label_microbatches(ax, tl: Timeline, span: float, n: int) -> None:
    """Micro-batch numbers inside the boxes wide enough for them (at most MAX_LABELS)."""
    dur_px = _box_px(ax, tl, span)
    digits = len(str(int(tl.op_microbatch.max()))) if len(tl.op_microbatch) else 1
    fits = np.flatnonzero(dur_px >= digits * 6 * 0.62 * _DPI / 72 + 3)   # one width for all
    if len(fits) > MAX_LABELS:   # too many to read anyway: keep the widest
        fits = fits[np.argsort(-dur_px[fits], kind="stable")[:MAX_LABELS]]
    mid = (tl.op_start_ms + tl.op_finish_ms) / 2
    for i in fits:
        ax.text(mid[i], tl.op_stage[i], str(int(tl.op_microbatch[i])), ha="center",
                va="center", fontsize=6, zorder=3)


def _idle_column(ax, tl: Timeline, n: int) -> None:
    """Each row's idle share of the timeline's span, right of the axes."""
    if not tl.span_ms:
        return
    idle = 100 * tl.idle_ms() / tl.span_ms
    trans = ax.get_yaxis_transform()    # x in axes fraction, y in rows
    ax.text(1.005, -0.5, "idle", transform=trans, fontsize=7, va="bottom", ha="left",
            color="#555555")
    for s in range(len(idle)):
        ax.text(1.005, s, f"{idle[s]:.0f}%", transform=trans, fontsize=7, va="center",
                ha="left", color="#555555")
