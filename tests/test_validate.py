"""poseidon_plugin.fidelity (``poseidon validate``): table and statistics on synthetic rows, the
engine-aware model's invariants, the torch-free modules importing without torch, and one small
real megatron-core run (integration)."""

from __future__ import annotations

import argparse
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from poseidon_plugin.simulator.engine import EngineCosts, device_program, simulate_engine
from poseidon_plugin.errors import PoseidonError
from poseidon_plugin.simulator.schedules import op_orders
from poseidon_plugin.simulator import iteration_time_ms
from poseidon_plugin.fidelity import main
from poseidon_plugin.fidelity.cases import DEFAULT_CASES, FULL_EXTRA
from poseidon_plugin.fidelity.predict import (StageProfile, predict_dag, predict_engine,
                                              predict_eq1)
from poseidon_plugin.fidelity.report import Row, error_stats, format_table


def _row(name, measured, dag, eq1, engine):
    return Row(name, "1f1b", 2, 4, 1, measured, dag, eq1, engine)


def test_error_and_stats():
    rows = [_row("a", 100.0, 90.0, 130.0, 101.0), _row("b", 200.0, 210.0, 200.0, 196.0),
            _row("c", 50.0, 50.0, 40.0, 50.5)]
    assert rows[0].error("dag") == pytest.approx(-0.10)
    assert rows[0].error("eq1") == pytest.approx(0.30)
    med, mx = error_stats(rows, "dag")
    assert med == pytest.approx(0.05) and mx == pytest.approx(0.10)
    med, mx = error_stats(rows, "engine")
    assert med == pytest.approx(0.01) and mx == pytest.approx(0.02)
    assert np.isnan(error_stats([], "dag")[0])


def test_table_layout():
    rows = [_row("pp2-x", 100.0, 90.0, 130.0, 101.0), _row("pp2-y", 200.0, 210.0, 200.0, 196.0)]
    text = format_table(rows)
    lines = text.splitlines()
    assert "measured" in lines[0] and "Eq.(1)" in lines[0] and "engine" in lines[0]
    assert lines[2].startswith("pp2-x") and "-10.0%" in lines[2] and "+30.0%" in lines[2]
    assert lines[-2].startswith("median |err|") and lines[-1].startswith("max |err|")
    assert "30.0%" in lines[-1] and "10.0%" in lines[-1]
    assert format_table(rows) == text   # deterministic


def test_table_columns_align():
    """Every '%' of an error column sits under the end of its header ('err'), rows of either
    schedule and the summary lines alike (interleaved-1f1b once pushed its row 4 columns
    right, the summary lines sat 2 columns left)."""
    rows = [_row("pp2-x", 100.0, 90.0, 130.0, 101.0),
            dataclasses.replace(_row("pp4-v2-interleaved", 200.0, 210.0, 200.0, 196.0),
                                schedule="interleaved-1f1b", virtual_stages=2)]
    lines = format_table(rows).splitlines()
    ends = [m.end() - 1 for m in re.finditer(r"err", lines[0])]
    assert len(ends) == 3
    for ln in lines[2:4] + lines[-2:]:
        assert [i for i, ch in enumerate(ln) if ch == "%"] == ends, ln
        assert len(ln) == len(lines[0])


def test_cases_are_valid_and_unique():
    names = [c.name for c in DEFAULT_CASES + FULL_EXTRA]
    assert len(names) == len(set(names))
    for c in DEFAULT_CASES + FULL_EXTRA:
        op_orders(c.schedule, c.pp, c.num_microbatches, c.virtual_stages)   # megatron-valid
        assert all(sum(c.chunk_layers(s)) == c.layers[s] for s in range(c.pp))
        assert all(min(c.chunk_layers(s)) >= 1 for s in range(c.pp))
    assert {c.pp for c in DEFAULT_CASES} == {2, 4}
    assert {c.schedule for c in DEFAULT_CASES} == {"1f1b", "interleaved-1f1b"}


def _profiles(case, overhead=None):
    rng = np.random.default_rng(1)
    out = []
    for s in range(case.pp):
        v = case.virtual_stages
        f = list(rng.uniform(5, 10, v))
        out.append(StageProfile(f, [2 * x for x in f], 0.3, 0.1, 1.0, dict(overhead or {})))
    return out


@pytest.mark.parametrize("case", DEFAULT_CASES, ids=lambda c: c.name)
def test_predictors_on_synthetic_profiles(case):
    prof = _profiles(case)
    dag = predict_dag(case, prof).iteration_time_ms
    eng = predict_engine(case, prof).iteration_time_ms
    eq1 = predict_eq1(case, prof)
    assert dag > 0 and eng > 0 and eq1 > 0
    if case.schedule == "1f1b":
        # no engine overheads, zero-cost tail sync: the engine model is the DAG (+ nothing)
        assert eng == pytest.approx(dag, rel=1e-9)
    else:
        assert eng >= dag - 1e-9    # bundled calls only ever delay


def test_engine_overheads_only_add_time():
    case = DEFAULT_CASES[1]
    base = predict_engine(case, _profiles(case)).iteration_time_ms
    slow = predict_engine(case, _profiles(case, {"send_call_ms": 0.5, "recv_ready_ms": 1.0,
                                                 "latency_ms": 0.2, "forward_ms": 0.1,
                                                 "backward_ms": 0.1})).iteration_time_ms
    assert slow > base


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 5), m=st.integers(1, 9), seed=st.integers(0, 10_000))
def test_engine_1f1b_without_overheads_equals_dag(n, m, seed):
    rng = np.random.default_rng(seed)
    f, b = rng.uniform(0.1, 5, n), rng.uniform(0.1, 9, n)
    p = rng.uniform(0, 1, max(n - 1, 0))
    costs = EngineCosts.from_profiles(f[None, :], b[None, :], p, np.zeros(n), np.zeros(n))
    got = simulate_engine(costs, m, "1f1b").iteration_time_ms
    assert got == pytest.approx(iteration_time_ms(f, b, p, p, np.zeros(n), m, "1f1b"), abs=1e-9)


@pytest.mark.parametrize("n,m,v", [(2, 4, 2), (2, 6, 3), (4, 8, 2), (4, 4, 2), (3, 6, 2)])
def test_engine_programs_run_every_op_in_schedule_order(n, m, v):
    orders = op_orders("interleaved-1f1b", n, m, v)
    for s in range(n):
        ops = [item[1] for item in device_program("interleaved-1f1b", n, m, s, v)
               if item[0] == "op"]
        assert ops == orders[s]
    costs = EngineCosts.from_profiles(np.ones((v, n)), 2 * np.ones((v, n)), np.full(n, 0.1),
                                      np.zeros(n), np.zeros(n))
    res = simulate_engine(costs, m, "interleaved-1f1b", v)
    assert len(res.op_stage) == 2 * n * m * v
    ref = iteration_time_ms(np.ones((v, n)), 2 * np.ones((v, n)), np.full(n, 0.1),
                            np.full(n, 0.1), np.zeros(n), m, "interleaved-1f1b", v)
    assert res.iteration_time_ms >= ref - 1e-9


def test_engine_rejects_unsupported_schedule():
    with pytest.raises(PoseidonError):
        device_program("eager-1f1b", 2, 4, 0)


def test_main_list_and_errors(capsys):
    assert main(["--list"]) == 0
    out = capsys.readouterr().out
    assert "pp2-1f1b-m4" in out and "pp4-int2-m8" in out
    assert main(argparse.Namespace(args=["--list", "--full"])) == 0
    assert "pp2-dp2-1f1b-m8" in capsys.readouterr().out
    with pytest.raises(PoseidonError):
        main(["--cases", "no-such-case"])


def test_cli_validate_runs_the_fidelity_package(capsys):
    from poseidon_plugin import cli

    assert cli.main(["validate", "--list", "--cases", "pp2-int3-m6"]) == 0
    assert capsys.readouterr().out.startswith("pp2-int3-m6")
    assert cli.main(["validate", "--cases", "no-such-case"]) == 2
    assert "unknown case(s) ['no-such-case']" in capsys.readouterr().err


TORCH_FREE = ("poseidon_plugin.fidelity", "poseidon_plugin.fidelity.cases",
              "poseidon_plugin.fidelity.predict", "poseidon_plugin.fidelity.report",
              "poseidon_plugin.fidelity.command")


def test_torch_free_modules_import_without_torch():
    """Everything but ``fidelity.harness`` imports (and lists the cases) with torch and megatron
    unimportable; the harness itself is where torch comes in."""
    code = "\n".join([
        "import importlib, sys",
        "sys.modules['torch'] = None",
        "sys.modules['megatron'] = None",
        f"for name in {TORCH_FREE!r}:",
        "    importlib.import_module(name)",
        "from poseidon_plugin.fidelity import main",
        "assert main(['--list']) == 0",
        "loaded = [k for k, m in list(sys.modules.items())",
        "          if k.split('.')[0] in ('torch', 'megatron') and m is not None]",
        "assert not loaded, loaded",
        "print('TORCH-FREE OK')",
    ])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr
    assert "TORCH-FREE OK" in out.stdout and "pp2-1f1b-m4" in out.stdout


def test_predictors_return_labelled_timelines():
    from poseidon_plugin.simulator.timeline import Timeline

    case = DEFAULT_CASES[2]   # interleaved
    prof = _profiles(case)
    dag, eng = predict_dag(case, prof), predict_engine(case, prof)
    assert isinstance(dag, Timeline) and isinstance(eng, Timeline)
    assert dag.label == "predicted, search's model" and eng.label == "predicted, engine-aware"
    assert eng.critical_path == () and not eng.op_on_critical_path.any()
    one = predict_dag(DEFAULT_CASES[0], _profiles(DEFAULT_CASES[0]))   # 1f1b, no call costs
    assert one.critical_path and one.op_on_critical_path.any()
    n_ops = 2 * case.pp * case.num_microbatches * case.virtual_stages
    assert len(dag.op_stage) == len(eng.op_stage) == n_ops


@pytest.mark.integration
def test_real_validate_run_small(tmp_path):
    """A real 2-process megatron-core run (1f1b and interleaved), few iterations."""
    pytest.importorskip("torch")
    pytest.importorskip("megatron.core")
    from poseidon_plugin.megatron.calibrate.recorder import IterationRecord
    from poseidon_plugin.fidelity.cases import Emulation
    from poseidon_plugin.fidelity.harness import run_cases

    cases = [c for c in DEFAULT_CASES if c.name in ("pp2-1f1b-m4", "pp2-int2-m4")]
    emu = Emulation(forward_ms_per_layer=1.5, backward_ms_per_layer=3.0,
                    optimizer_ms_per_layer=0.3)
    results = run_cases(cases, emu, iterations=4, discard=1)
    assert [r.case.name for r in results] == [c.name for c in cases]
    for res in results:
        c = res.case
        assert res.row.measured_ms > 0 and res.row.iterations == 3
        orders = op_orders(c.schedule, c.pp, c.num_microbatches, c.virtual_stages)
        assert res.ops_per_stage == [len(o) for o in orders]
        for s, d in enumerate(res.measured_records):
            rec = IterationRecord.from_dict(d)
            assert rec.stage == s
            ran = [(b, ch, mb) for ch, mb, b, _, _ in rec.ops]
            assert ran == [tuple(op) for op in orders[s]]
            starts = [t0 for _, _, _, t0, _ in rec.ops]
            assert starts == sorted(starts)
        # stage compute times follow the emulation: layers x per-layer time / speed
        for s, p in enumerate(res.profiles):
            want = c.layers[s] * emu.forward_ms_per_layer / c.speed(s)
            assert sum(p.forward_ms) == pytest.approx(want, rel=0.25)
    from poseidon_plugin.fidelity.report import draw_case
    path = draw_case(results[1], str(tmp_path / "val.png"))
    assert (tmp_path / "val.png").stat().st_size > 10_000 and path.endswith(".png")


def test_call_records_are_stored_in_a_profile_db(tmp_path):
    """``poseidon validate --profile-db``: the run's per-type medians as DB records, which the
    cost model then charges (``callcosts.engine_calls``)."""
    from poseidon_plugin.callcosts import engine_calls
    from poseidon_plugin.fidelity.cases import Emulation
    from poseidon_plugin.fidelity.report import CaseResult, assemble_case, store_call_records
    from poseidon_plugin.profiles import ProfileDB

    case = DEFAULT_CASES[3]       # pp4: fast, mid, slow, mid
    ov = [{"send_call_ms": 0.1 * (s + 1), "recv_ready_ms": 0.2, "latency_ms": 0.05,
           "forward_ms": 0.3 + s, "backward_ms": 0.4} for s in range(case.pp)]
    prof = [dataclasses.replace(p, overhead=o) for p, o in zip(_profiles(case), ov)]
    res = CaseResult(case, None, prof, [], [])
    path = str(tmp_path / "db.json")
    line = store_call_records([res], Emulation(), path)
    assert "3 op overhead and 3 p2p call" in line
    db = ProfileDB.load(path)
    by_type = {o.device_type: o for o in db.op_overheads()}
    assert by_type["emu-mid"].forward_ms == pytest.approx((1.3 + 3.3) / 2)   # stages 1 and 3
    calls = engine_calls(db, case.devices, 4 * 16 * 2 * 64)
    assert calls.op_forward_ms == pytest.approx(2.3)   # the largest type (mid and slow: 2.3)
    assert calls.send_call_ms == pytest.approx(0.3)


def test_calls_from_a_launchs_db_time_the_search_column(tmp_path, capsys):
    """``poseidon validate --calls-from DB``: the search column charged with a launch's (or
    ``poseidon profile``'s) own records instead of the run's; a DB without such records, or
    unreadable, is refused before any run (one line, exit 2)."""
    from poseidon_plugin import cli
    from poseidon_plugin.callcosts import OpOverhead, P2PCall, engine_calls
    from poseidon_plugin.fidelity.cases import Emulation
    from poseidon_plugin.fidelity.command import with_calls_from
    from poseidon_plugin.fidelity.report import CaseResult, message_bytes
    from poseidon_plugin.profiles import ProfileDB

    case = DEFAULT_CASES[3]
    prof = _profiles(case, {"send_call_ms": 0.1, "recv_ready_ms": 0.2, "latency_ms": 0.05,
                            "forward_ms": 0.1, "backward_ms": 0.1})
    own = predict_dag(case, prof).iteration_time_ms
    res = [CaseResult(case, _row(case.name, 100.0, own, 1.0, 1.0), prof, [], [])]
    db = ProfileDB(None)
    db.put_op_overhead(OpOverhead("emu-x", 0.5, 0.7))
    db.put_op_overhead(OpOverhead("emu-y", 0.2, 0.9))
    db.put_p2p_call(P2PCall("emu-x", "cross-type", 4096, 0.3, 0.6, 0.02))
    (got,) = with_calls_from(res, db, Emulation())
    want = predict_dag(case, prof, message_bytes(Emulation()), calls_db=db).iteration_time_ms
    assert got.row.dag_ms == pytest.approx(want) and got.row.dag_ms != pytest.approx(own)
    assert got.row.engine_ms == 1.0 and got.row.measured_ms == 100.0   # only the search column
    # the DB's types' largest: op forward emu-x's, backward emu-y's
    calls = engine_calls(db, {"emu-x", "emu-y"}, message_bytes(Emulation()))
    assert calls.as_tuple() == (0.5, 0.9, 0.3, 0.6)
    bigger = ProfileDB.from_json(db.to_json())
    bigger.put_op_overhead(OpOverhead("emu-y", 0.2, 1.9))
    (slower,) = with_calls_from(res, bigger, Emulation())
    assert slower.row.dag_ms > got.row.dag_ms
    empty = tmp_path / "empty.json"
    empty.write_text('{"version": 1, "records": []}')
    assert cli.main(["validate", "--calls-from", str(empty)]) == 2
    err = capsys.readouterr().err
    assert "has no op_overheads or p2p_calls records" in err and len(err.splitlines()) == 1
    assert cli.main(["validate", "--calls-from", str(tmp_path / "missing.json")]) == 2
    assert len(capsys.readouterr().err.splitlines()) == 1
