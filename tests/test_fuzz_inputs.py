"""Fuzzing the planner's input files (issue 12): hypothesis mutates a valid cluster YAML, model
YAML and profile DB (wrong types, signs, NaN/inf, huge and tiny values, deleted or wrapped
fields, deep nesting, raw-text damage) and runs ``poseidon plan`` on them.

Every run must end in one of two ways:

* exit 0 with a plan whose figures make sense (a finite iteration time > 0, tokens/s > 0,
  0 < MFU <= 100 %), or
* exit 2 with exactly one line on stderr, starting ``poseidon: error:``;

never a traceback, a hang (the CLI runs with ``--time-budget 5`` under a 90 s timeout) or a
nonsense figure. ``test_fuzz_cli_subprocess`` runs the real command (``python -m
poseidon_plugin.cli``); ``test_fuzz_cli_in_process`` runs more examples through ``cli.main``
and also fails on any exception that is not a ``PoseidonError``.

Plan JSON is mutated the same way: ``poseidon plan --keep`` on it gives a plan or one error
line; the launch's cached plan (``plan-<hash>.json``) is read as a plan or as none (the damaged
file moved aside) and the search then keeps it, replaces it or plans afresh.
"""

from __future__ import annotations

import contextlib
import functools
import copy
import io
import json
import math
import os
import random
import subprocess
import sys
import tempfile

import pytest
import yaml
from hypothesis import HealthCheck, given, settings, strategies as st

from poseidon_plugin import cli
from test_bad_input import SMALL_TEXT, TINY_TEXT, _db_payload

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEEP = "__DEEP__"          # replaced in the written text by a value nested thousands deep
VALUES = [None, True, False, 0, -1, 1, 3, 0.0, -0.0, float("nan"), float("inf"), float("-inf"),
          1e300, -1e300, 1e-300, 10**30, 2**63, "", "x", "1e300", "64 GiB", "-5 ms", "nan",
          "1e-300 TFLOPs", [], {}, [1, 2], {"a": 1}, DEEP]
ALL_RECORD_VALUES = [0, 0.0, -1, 1e-300, 1e300, float("nan"), float("inf"), 10**30, "x", None]
FACTORS = [-1, 0, 1e-9, 1e-3, 0.25, 0.5, 0.9, 1.1, 2, 4, 1e3, 1e9, 1e300]
OPS = ["replace", "replace", "scale", "scale", "delete", "wrap"]
TEXT_OPS = ["truncate", "bad-byte", "duplicate-line", "deep", "tab"]


def _paths(obj, prefix=()):
    """Every path (a tuple of keys / indexes) to a value inside ``obj``, containers included."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield prefix + (k,)
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield prefix + (i,)
            yield from _paths(v, prefix + (i,))


def _get(obj, path):
    for part in path:
        obj = obj[part]
    return obj


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _mutate(obj, path, op, value, factor):
    *head, last = path
    parent = obj
    for part in head:
        parent = parent[part]
    old = parent[last]
    if op == "delete":
        del parent[last]
    elif op == "replace":
        parent[last] = copy.deepcopy(value)
    elif op == "scale":
        if _is_number(old):
            scaled = old * factor
            parent[last] = int(scaled) if isinstance(old, int) and math.isfinite(scaled) \
                and abs(scaled) < 1e18 else scaled
        else:
            parent[last] = copy.deepcopy(value)
    elif op == "wrap":
        parent[last] = [old] if isinstance(value, list) else {"x": old}


def _damage_text(text: str, op: str, rnd: random.Random) -> bytes:
    data = text.encode()
    at = rnd.randrange(len(data) + 1)
    if op == "truncate":
        return data[:at]
    if op == "bad-byte":
        return data[:at] + b"\xff" + data[at:]
    if op == "duplicate-line":
        lines = data.splitlines(keepends=True)
        i = rnd.randrange(len(lines))
        return b"".join(lines[:i + 1] + [lines[i]] + lines[i + 1:])
    if op == "tab":
        return data[:at] + b"\t" + data[at:]
    depth = rnd.choice([40, 5000, 100_000])  # "deep"
    return data.rstrip(b"\n") + b"\nzz: " + b"[" * depth + b"]" * depth + b"\n"


def _mutate_some(draw, doc, name: str, done: list) -> None:
    """1-3 structured mutations of ``doc`` in place, each recorded in ``done``."""
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(OPS))
        paths = list(_paths(doc))
        if op == "scale":   # numbers scaled stay numbers: more runs reach the search
            paths = [p for p in paths if _is_number(_get(doc, p))] or paths
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        value = draw(st.sampled_from(VALUES))
        factor = draw(st.sampled_from(FACTORS))
        _mutate(doc, path, op, value, factor)
        done.append((name, path, op, value if op != "scale" else factor))


@st.composite
def mutated_inputs(draw):
    """({"cluster"|"model"|"profiles": file bytes}, what was done): one file damaged by 1-3
    structured mutations or by one raw-text damage; a third of the time, also one field of
    every profile record changed at once."""
    docs = {"cluster": yaml.safe_load(SMALL_TEXT), "model": yaml.safe_load(TINY_TEXT),
            "profiles": _db_payload()}
    target = draw(st.sampled_from(sorted(docs)))
    done = []
    if draw(st.integers(0, 2)) == 0:
        # one field of every record at once (every time 0, every time x 1e300, ...);
        # the times are drawn most often
        records = docs["profiles"]["records"]
        field = draw(st.sampled_from(["forward_ms", "backward_ms"] * 3 + sorted(records[0])))
        op = draw(st.sampled_from(["replace", "scale"]))
        value = draw(st.sampled_from(ALL_RECORD_VALUES))
        factor = draw(st.sampled_from(FACTORS))
        for i in range(len(records)):
            _mutate(docs["profiles"], ("records", i, field), op, value, factor)
        done.append(("profiles", ("records", "*", field), op, value if op != "scale" else factor))
    raw = None
    if draw(st.integers(0, 4)) == 0:
        op = draw(st.sampled_from(TEXT_OPS))
        seed = draw(st.integers(0, 2**16))
        raw = (target, op, seed)
        done.append((target, op, seed))
    else:
        _mutate_some(draw, docs[target], target, done)
    texts = {
        "cluster": yaml.safe_dump(docs["cluster"], sort_keys=False),
        "model": yaml.safe_dump(docs["model"], sort_keys=False),
        "profiles": json.dumps(docs["profiles"]),
    }
    nested = "[" * 3000 + "]" * 3000
    out = {}
    for name, text in texts.items():
        text = text.replace(f'"{DEEP}"', nested).replace(DEEP, nested)
        out[name] = text.encode()
    if raw is not None:
        name, op, seed = raw
        out[name] = _damage_text(texts[name], op, random.Random(seed))
    return out, done


def _write_inputs(directory: str, files: dict) -> list[str]:
    paths = {}
    for name, ext in (("cluster", "yaml"), ("model", "yaml"), ("profiles", "json")):
        paths[name] = os.path.join(directory, f"{name}.{ext}")
        with open(paths[name], "wb") as f:
            f.write(files[name])
    return ["plan", "--cluster", paths["cluster"], "--model", paths["model"],
            "--profiles", paths["profiles"], "--global-batch-size", "16", "--seq-length", "128",
            "--time-budget", "5", "--no-baselines", "--json", "--workers", "1"]


def _no_peak_types(cluster_text: bytes) -> set[str] | None:
    """The device types of a cluster file without a peak_tflops (None: not readable here)."""
    try:
        doc = yaml.safe_load(cluster_text)
        return {str(name) for name, body in doc["device_types"].items()
                if not isinstance(body, dict) or body.get("peak_tflops") is None}
    except Exception:    # a mutated file our loader reads and PyYAML's safe_load does not
        return None


def _check_outcome(rc: int, out: str, err: str, done, files: dict | None = None) -> None:
    assert "Traceback" not in err and "Traceback" not in out, (done, err[-3000:])
    if rc == 0:
        plan = json.loads(out)
        t = plan["predicted_iteration_time_ms"]
        assert math.isfinite(t) and t > 0, (done, t)
        assert plan["predicted_tokens_per_s"] > 0, (done, plan["predicted_tokens_per_s"])
        assert 0 <= plan["mfu"] <= 1.0, (done, plan["mfu"])
        if plan["mfu"] == 0 and files is not None:
            # MFU 0 is "n/a": only where a stage's type has no peak to measure against
            missing = _no_peak_types(files["cluster"])
            if missing is not None:
                assert missing & {s["device_type"] for s in plan["stages"]}, (done, missing)
        return
    assert rc == 2, (done, rc, err[-3000:])
    # one error line, last; before it only warning lines (an input can earn a warning, e.g. a
    # profile record of another sequence length, and then fail on another field: hypothesis
    # found that case)
    assert err.endswith("\n"), (done, err[-3000:])
    *warnings, error = err.splitlines()
    assert error.startswith("poseidon: error: "), (done, err[-3000:])
    assert all(w.startswith("poseidon: warning: ") for w in warnings), (done, err[-3000:])
    assert len(error) < 1000, (done, len(error))
    assert out == "", (done, out[:500])


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(mutated_inputs())
def test_fuzz_cli_subprocess(case):
    files, done = case
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with tempfile.TemporaryDirectory() as d:
        argv = _write_inputs(d, files)
        try:
            proc = subprocess.run([sys.executable, "-m", "poseidon_plugin.cli", *argv],
                                  capture_output=True, text=True, cwd=ROOT, env=env,
                                  timeout=90)
        except subprocess.TimeoutExpired:
            pytest.fail(f"hang (> 90 s with --time-budget 5): {done}")
    _check_outcome(proc.returncode, proc.stdout, proc.stderr, done, files)


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(mutated_inputs())
def test_fuzz_cli_in_process(case):
    files, done = case
    with tempfile.TemporaryDirectory() as d:
        argv = _write_inputs(d, files)
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = cli.main(argv)   # anything but a PoseidonError propagates and fails the test
    _check_outcome(rc, out.getvalue(), err.getvalue(), done, files)


# ---------------------------------------------------------------------------------------------
# plan JSON: ``poseidon plan --keep PLAN`` and the launch's cached plan (issue 31 item 3)
# ---------------------------------------------------------------------------------------------

def _valid_files() -> dict:
    """The unmutated inputs (file bytes by name), as ``_write_inputs`` takes them."""
    return {"cluster": SMALL_TEXT.encode(), "model": TINY_TEXT.encode(),
            "profiles": json.dumps(_db_payload()).encode()}


@functools.lru_cache(maxsize=1)
def _valid_plan_text() -> str:
    """The plan ``poseidon plan`` writes (--out) for the unmutated inputs."""
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "plan.json")
        with contextlib.redirect_stdout(io.StringIO()):
            assert cli.main([*_write_inputs(d, _valid_files()), "--out", out]) == 0
        with open(out, encoding="utf-8") as f:
            return f.read()


@st.composite
def mutated_plans(draw):
    """(plan JSON bytes, what was done): the valid plan with 1-3 structured mutations (wrong
    types, signs, NaN/inf, huge values, deleted or wrapped fields, deep nesting) or one
    raw-text damage."""
    text = _valid_plan_text()
    doc = json.loads(text)
    done = []
    if draw(st.integers(0, 4)) == 0:
        op, seed = draw(st.sampled_from(TEXT_OPS)), draw(st.integers(0, 2**16))
        done.append(("plan", op, seed))
        return _damage_text(text, op, random.Random(seed)), done
    _mutate_some(draw, doc, "plan", done)
    nested = "[" * 3000 + "]" * 3000
    out = json.dumps(doc).replace(f'"{DEEP}"', nested)
    return out.encode(), done


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(mutated_plans())
def test_fuzz_keep_plan_json(case):
    """``poseidon plan --keep`` on a damaged plan JSON: a plan or one clean error line."""
    text, done = case
    files = _valid_files()
    with tempfile.TemporaryDirectory() as d:
        argv = _write_inputs(d, files)
        kept = os.path.join(d, "kept.json")
        with open(kept, "wb") as f:
            f.write(text)
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = cli.main([*argv, "--keep", kept])
    _check_outcome(rc, out.getvalue(), err.getvalue(), done, files)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(mutated_plans())
def test_fuzz_launch_cached_plan(case):
    """The launch's cached plan (``plan-<hash>.json`` beside the profile cache) damaged: the
    launch reads it as a plan or as none (a damaged file moved aside), and the search then
    keeps it or plans afresh; nothing but a plan comes out, and a file it could not read is no
    longer in the way of the next launch."""
    from poseidon_plugin.cluster import load_cluster
    from poseidon_plugin.megatron.launch.runner import _load_previous
    from poseidon_plugin.model import load_model
    from poseidon_plugin.search import SearchOptions, search_plan

    text, done = case
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "plan-0123456789abcdef.json")
        with open(path, "wb") as f:
            f.write(text)
        previous = _load_previous(path)
        if previous is None:   # unreadable: moved aside, so the next launch does not read it
            assert not os.path.exists(path), done
            assert any(n.startswith("plan-0123456789abcdef.json.corrupt-")
                       for n in os.listdir(d)), done
        cluster = load_cluster(os.path.join(ROOT, "examples", "clusters", "small-two-type.yaml"))
        model = load_model(os.path.join(ROOT, "examples", "models", "tiny-gpt.yaml"))
        plan = search_plan(cluster, model, SearchOptions(
            global_batch_size=16, seq_length=128, workers=1, time_budget_s=5,
            keep_tolerance=0.02, runner_up=False), previous=previous)
    assert plan.predicted_iteration_time_ms > 0, done
    state = plan.search["previous_plan"]
    if previous is None:
        assert state == "none", (done, state)
    else:
        assert state in ("kept", "replaced") or state.startswith("unusable: "), (done, state)
