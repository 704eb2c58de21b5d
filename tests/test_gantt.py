"""Gantt pictures: PNG and SVG, sane size and pixel dimensions, a bad suffix is an error; rows
labelled with device type, TP and layers; the critical path outlined; height follows the
stages (no timing assertions: ``benchmarks/bench_gantt.py`` measures the drawing time)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("matplotlib")

from poseidon_plugin.errors import PoseidonError
from poseidon_plugin.gantt import draw_gantt
from poseidon_plugin.simulator import simulate_pipeline


def _tl(n=4, m=8, schedule="1f1b", v=1, label="predicted"):
    rng = np.random.default_rng(n * 100 + m)
    f = rng.uniform(5, 10, n)
    links = n if schedule == "interleaved-1f1b" else n - 1
    tl = simulate_pipeline(f, 2 * f, np.full(links, 0.5), np.full(links, 0.5), np.full(n, 3.0),
                           m, schedule, v)
    return tl.with_label(label)


def _png_size(path):
    with open(path, "rb") as fh:
        head = fh.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


def test_png_for_16_stages(tmp_path):
    path = draw_gantt([_tl(16, 32)], str(tmp_path / "g.png"), title="N=16")
    w, h = _png_size(path)
    assert 1000 <= w <= 2200 and 400 <= h <= 1400
    assert 20_000 < (tmp_path / "g.png").stat().st_size < 600_000


def test_png_two_timelines_stack(tmp_path):
    one = _png_size(draw_gantt([_tl(4, 8)], str(tmp_path / "a.png")))
    two = _png_size(draw_gantt([_tl(4, 8, label="measured"), _tl(4, 8)],
                               str(tmp_path / "b.png")))
    assert two[0] == one[0] and two[1] > one[1]


def test_svg_interleaved(tmp_path):
    path = draw_gantt([_tl(4, 8, "interleaved-1f1b", 2)], str(tmp_path / "g.svg"))
    text = open(path, encoding="utf-8").read()
    assert text.lstrip().startswith("<?xml") and "<svg" in text
    assert "stage 3" in text or "stage&#160;3" in text or len(text) > 10_000


@pytest.mark.parametrize("name", ["g.pdf", "g", "g.PNG.txt"])
def test_bad_suffix(tmp_path, name):
    with pytest.raises(PoseidonError, match="png or .svg"):
        draw_gantt([_tl()], str(tmp_path / name))


def test_no_timeline(tmp_path):
    with pytest.raises(PoseidonError):
        draw_gantt([], str(tmp_path / "g.png"))


def test_height_follows_the_stages(tmp_path):
    """Rows of a fixed height from 6 stages on: 24 more stages are 24 more rows, and what is
    not rows (title, legend, caption, time axis) stays under 1.5 inches."""
    from poseidon_plugin import gantt

    h8 = _png_size(draw_gantt([_tl(8, 16)], str(tmp_path / "a.png"), title="x"))[1]
    h32 = _png_size(draw_gantt([_tl(32, 64)], str(tmp_path / "b.png"), title="x"))[1]
    row_px = gantt._ROW_IN * gantt._DPI
    assert abs((h32 - h8) - 24 * row_px) <= 2
    assert h8 - 8 * row_px <= 1.5 * gantt._DPI


def test_row_labels_in_the_svg(tmp_path):
    path = draw_gantt([_tl(3, 6)], str(tmp_path / "g.svg"),
                      stage_labels=["A100 · tp2 · 10 layers", "V100 · tp1 · 6 layers",
                                    "V100 · tp1 · 1 layer"])
    text = open(path, encoding="utf-8").read()
    for row in ("stage 0 · A100 · tp2 · 10 layers", "stage 1 · V100 · tp1 · 6 layers",
                "stage 2 · V100 · tp1 · 1 layer"):
        assert row in text, row
    assert "critical path" in text and "idle" in text
    with pytest.raises(PoseidonError, match="2 stage labels for 3 stages"):
        draw_gantt([_tl(3, 6)], str(tmp_path / "h.svg"), stage_labels=["a", "b"])


def test_critical_path_is_outlined(tmp_path, monkeypatch):
    """The red outline covers exactly the critical chain's ops (plus its final all-reduce)."""
    from poseidon_plugin import gantt

    drawn = []
    real = gantt._compound

    def spy(ax, verts, **style):
        if style.get("edgecolor") == gantt._CRITICAL:
            drawn.append(verts)
        return real(ax, verts, **style)

    monkeypatch.setattr(gantt, "_compound", spy)
    tl = _tl(4, 8)
    draw_gantt([tl], str(tmp_path / "g.png"))
    (verts,) = drawn
    chain = tl.critical_chain()
    assert len(verts) == len(chain) + 1          # + the all-reduce the chain ends in
    assert np.allclose(verts[:-1, 0, 0], tl.op_start_ms[chain])
    assert np.allclose(verts[:-1, 1, 0], tl.op_finish_ms[chain])
    assert verts[-1, 1, 0] == pytest.approx(tl.span_ms)


def test_microbatch_labels_only_where_they_fit(tmp_path):
    """A shallow pipeline gets its micro-batch numbers; 8,192 narrow boxes get none."""
    few = open(draw_gantt([_tl(2, 4)], str(tmp_path / "a.svg")), encoding="utf-8").read()
    many = open(draw_gantt([_tl(32, 128)], str(tmp_path / "b.svg")), encoding="utf-8").read()
    import re
    labels = lambda t: re.findall(r">(\d+)</text>", t)   # noqa: E731
    assert {"0", "1", "2", "3"} <= set(labels(few))
    assert len(labels(many)) < 20     # the time axis's tick labels only


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved-1f1b"])
def test_plan_gantt_from_the_cli(tmp_path, capsys, schedule):
    """``poseidon plan --gantt``: the paper's DAG for 1f1b, the engine model for interleaved."""
    import os

    from poseidon_plugin import cli

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = tmp_path / "plan.png"
    cluster = os.path.join(root, "examples/clusters/small-two-type.yaml")
    rc = cli.main(["plan", "--cluster", cluster,
                   "--model", os.path.join(root, "examples/models/tiny-gpt.yaml"),
                   "--global-batch-size", "16", "--seq-length", "128", "--workers", "1",
                   "--schedules", schedule, "--no-baselines", "--gantt", str(path)])
    assert rc == 0 and f"wrote {path}" in capsys.readouterr().err
    assert _png_size(str(path))[0] > 1000 and path.stat().st_size > 10_000


def test_plan_gantt_rows_name_the_plans_stages(tmp_path, capsys):
    """``--gantt x.svg``: every row says the stage's device type, TP and layers of the plan."""
    import json
    import os

    from poseidon_plugin import cli

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    svg = tmp_path / "plan.svg"
    rc = cli.main(["plan", "--cluster", os.path.join(root, "examples/clusters/small-two-type.yaml"),
                   "--model", os.path.join(root, "examples/models/tiny-gpt.yaml"),
                   "--global-batch-size", "16", "--seq-length", "128", "--workers", "1",
                   "--no-baselines", "--json", "--gantt", str(svg)])
    assert rc == 0
    plan = json.loads(capsys.readouterr().out)
    text = svg.read_text(encoding="utf-8")
    for st in plan["stages"]:
        layers = f"{st['layers']} layer" + ("s" if st["layers"] != 1 else "")
        assert f"stage {st['index']} · {st['device_type']} · tp{st['tp']} · {layers}" in text
