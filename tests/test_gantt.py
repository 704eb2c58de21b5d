"""Gantt pictures: PNG and SVG, sane size and pixel dimensions, a bad suffix is an error."""

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
