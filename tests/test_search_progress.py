"""One progress display for the whole search (issue 10): incumbent, proven bound and gap as
they move; lines under -v when stderr is not a terminal; --time-budget covers the baselines."""

from __future__ import annotations

import io
import logging
import os
import re
import subprocess
import sys
import time

import pytest

from poseidon_plugin import cli
from poseidon_plugin.cluster import load_cluster
from poseidon_plugin.model import get_model
from poseidon_plugin.search import SearchOptions, search_plan
from poseidon_plugin.search.progress import (LOG_INTERVAL_S, SearchProgress, Snapshot,
                                             format_snapshot)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINE = re.compile(r"search +([\d.]+) s +(.+?) +best (\S+)(?: ms)? +bound (\S+)(?: ms)? +gap (\S+)")


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


class _Tty(io.StringIO):
    def isatty(self):
        return True


def _snap(best=10.0, bound=9.0, phase="round 1"):
    return Snapshot(phase, best, bound, 3, 7, 12345)


def test_snapshot_line_shows_incumbent_bound_and_gap():
    line = format_snapshot(_snap(), 1.5)
    m = LINE.search(line)
    assert m and m.group(3) == "10.00" and m.group(4) == "9.00" and m.group(5) == "10.00%"
    assert "configs 3/7" in line and "nodes 12.3k" in line
    assert "gap -" in format_snapshot(_snap(best=None), 0.0)


def test_log_mode_throttles_but_logs_every_improvement(caplog):
    clock = _Clock()
    p = SearchProgress("log", clock=clock)
    caplog.set_level(logging.INFO, logger="poseidon")
    p.tick(_snap)                       # first line: due at once
    p.tick(_snap)                       # same instant: throttled
    clock.t += 0.1
    p.tick(lambda: _snap(best=9.5), improved=True)   # a better incumbent: logged at once
    clock.t += LOG_INTERVAL_S / 4
    p.tick(lambda: _snap(best=9.5))     # nothing new, not due
    clock.t += LOG_INTERVAL_S
    p.tick(lambda: _snap(best=9.5))     # due
    assert p.lines == 3
    assert [LINE.search(r.getMessage()).group(3) for r in caplog.records] == \
        ["10.00", "9.50", "9.50"]


def test_tty_mode_rewrites_one_line_and_clears_it():
    out, clock = _Tty(), _Clock()
    p = SearchProgress.for_options(SearchOptions(global_batch_size=8, seq_length=8,
                                                 progress=True), stream=out)
    p.clock, p.t0 = clock, 0.0
    assert p.mode == "tty"
    p.tick(_snap)
    clock.t += 1
    p.tick(lambda: _snap(best=9.2))
    p.close()
    text = out.getvalue()
    assert "\n" not in text and text.count("\r") == 4 and text.endswith("\r")
    assert "search    1.0 s" in text
    assert SearchProgress.for_options(SearchOptions(global_batch_size=8, seq_length=8)).mode \
        == "off"


def _tiny_search(progress=True, **kw):
    cluster = load_cluster(os.path.join(ROOT, "examples/clusters/paper-setting2.yaml"))
    return search_plan(cluster, get_model("llama3-8b"), SearchOptions(
        global_batch_size=128, seq_length=4096, workers=1, progress=progress, **kw))


def test_search_progress_moves_one_way_and_ends_at_the_plan(caplog, monkeypatch):
    """Over the whole search (construction, warm-up, both passes) the incumbent never rises,
    the proven bound never falls and never passes the incumbent, and the last line shows the
    returned plan and its bound."""
    monkeypatch.setattr("poseidon_plugin.search.progress.LOG_INTERVAL_S", 0.0)
    caplog.set_level(logging.INFO, logger="poseidon")
    plan = _tiny_search()
    rows = [LINE.search(r.getMessage()) for r in caplog.records]
    rows = [(float(m.group(3)), float(m.group(4))) for m in rows
            if m and m.group(3) != "-" and m.group(4) != "-"]
    assert len(rows) >= 3
    for (b0, l0), (b1, l1) in zip(rows, rows[1:]):
        assert b1 <= b0 + 1e-9 and l1 >= l0 - 1e-9
    assert all(lb <= best + 1e-9 for best, lb in rows)
    assert rows[-1][0] == pytest.approx(plan.predicted_iteration_time_ms, abs=0.01)
    assert rows[-1][1] == pytest.approx(plan.lower_bound_ms, abs=0.01)
    assert "(done)" in caplog.records[-1].getMessage()
    phases = {LINE.search(r.getMessage()).group(2).strip() for r in caplog.records
              if LINE.search(r.getMessage())}
    assert "construct" in phases and any(p.startswith("blocks round") for p in phases)


def test_cli_verbose_logs_progress_lines_when_not_a_terminal():
    r = subprocess.run(
        [sys.executable, "-m", "poseidon_plugin.cli", "-v", "plan", "--cluster",
         os.path.join(ROOT, "examples/clusters/paper-setting1.yaml"), "--model", "llama3-8b",
         "--global-batch-size", "128", "--seq-length", "4096", "--no-baselines",
         "--workers", "1"], capture_output=True, text=True, timeout=300,
        env=dict(os.environ))
    assert r.returncode == 0, r.stderr
    lines = [x for x in r.stderr.splitlines() if LINE.search(x)]
    assert lines and "(done)" in lines[-1] and "\r" not in r.stderr


def test_time_budget_covers_the_baselines(monkeypatch):
    """Every search the command starts (one per device type for the best-single-type
    baseline, then the plan's, seeded by the baselines) must end by the --time-budget's end.
    Checked against the clock, not against a margin: each search's budget was computed after
    the previous search returned, so it may not pass the end counted from that moment (or be
    the floor), and the plan's search gets all that is left when it starts."""
    import poseidon_plugin.search as search_pkg
    import poseidon_plugin.search.driver as driver_mod

    calls, budgets = [], []   # (time before the budget was computed, start, budget)
    real = driver_mod.search_plan
    real_budget = cli._Budget.__init__
    last = [None]

    def spy(cluster, model, options, profiles=None, **kw):
        calls.append((last[0], time.monotonic(), options.time_budget_s))
        try:
            return real(cluster, model, options, profiles, **kw)
        finally:
            last[0] = time.monotonic()

    def budget_spy(self, *a, **kw):
        real_budget(self, *a, **kw)
        budgets.append(self)
        last[0] = time.monotonic()

    monkeypatch.setattr(driver_mod, "search_plan", spy)
    monkeypatch.setattr(search_pkg, "search_plan", spy)
    monkeypatch.setattr(cli._Budget, "__init__", budget_spy)
    budget = 3.0
    rc = cli.main(["plan", "--cluster", os.path.join(ROOT, "examples/clusters/paper-setting3.yaml"),
                   "--model", "llama3-8b", "--global-batch-size", "128", "--seq-length", "4096",
                   "--workers", "1", "--time-budget", str(budget)])
    assert rc == 0
    (b_obj,) = budgets
    end = b_obj.end
    assert len(calls) >= 3     # the plan's search and one per type of the 2+ types
    assert all(b <= cli.BASELINE_SHARE * budget + 1e-9 for _, _, b in calls[:-1])
    for before, start, b in calls:
        assert b is not None and before is not None
        assert b <= max(cli.MIN_BUDGET_S, end - before) + 1e-9, (b, end - before)
    _, start, b = calls[-1]
    assert b >= end - start - 1e-9     # the plan's search: all that is left when it starts
